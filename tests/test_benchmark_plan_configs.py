"""benchmarks/plan_configs.py (memory.py --plan): the table of predicted against measured peaks
and steps, from rows made up here, and one tiny row run end to end."""
from __future__ import annotations

import re

import pytest

from helpers.scripts import load_benchmark

plan_configs = load_benchmark("plan_configs")
MIB = 2**20


def row(name: str, workers: list[int], peaks: dict[str, int], replicas: int = 1) -> dict:
    return {"config": {"name": name, "replicas": replicas}, "workers": workers,
            "seconds": [9.0, 2.0, 3.0],
            "plan": {"peaks": peaks, "model": {k: v // 2 for k, v in peaks.items()},
                     "step": 2.5}}


def test_each_worker_gets_a_line_with_its_device_plan_and_error():
    rows = [row("a", [1000 * MIB, 500 * MIB], {"0": 1050 * MIB, "1": 490 * MIB}),
            # replica-major: workers 0 and 2 run device 0
            row("b", [100 * MIB] * 4, {"0": 100 * MIB, "1": 104 * MIB}, replicas=2),
            {"config": {"name": "c", "replicas": 1}, "workers": [1 * MIB, 2 * MIB],
             "seconds": [1.0, 1.0], "skipped": "ValueError: no interleaved plans"}]
    text = plan_configs.table(rows)
    assert "| a | 1050 / 1000 MiB | +5.0% | 52% | 2.50 / 2.00 s (+25%) |" in text
    assert "| a w1 | 490 / 500 MiB | -2.0% | 49% |  |" in text
    assert "| b w2 | 100 / 100 MiB | +0.0% |" in text and "| b w3 | 104 / 100 MiB | +4.0% |" in text
    assert "| c | measured 1 / 2 MiB; not planned (ValueError: no interleaved plans)" in text
    assert "largest peak error 5.0% over 6 workers; median step error 25%" in text


@pytest.mark.slow
@pytest.mark.transformers
@pytest.mark.timeout(600)  # one fresh interpreter training two workers, and a plan timed here
def test_a_tiny_row_runs_and_is_planned():
    tiny = plan_configs.Config("tiny", "gpt2", ("transformer.h.1",), layers=2, width=64,
                               vocab=256, batch=2, sequence=16)
    found = plan_configs.run(tiny, timeout=500)
    assert "plan" in found, found
    first, second = plan_configs.lines(found)
    assert re.match(r"\| tiny \| \d+ / \d+ MiB \| [+-][\d.]+% \| \d+% \| [\d.]+ / [\d.]+ s", first)
    assert second.startswith("| tiny w1 |")
    peaks, steps = plan_configs.errors([found])
    assert len(peaks) == 2 and all(abs(e) < 0.5 for e in peaks), peaks  # sane, not the target
