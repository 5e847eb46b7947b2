"""benchmarks/replicas.py: the all-reduce share of a step, and --quick runs end to end."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipetorch.parallel.comm.payloads import Span, Trace
from helpers.scripts import load_benchmark

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "replicas.py"


def test_all_reduce_share_splits_each_worker_into_steps_at_step() -> None:
    bench = load_benchmark("replicas")
    ms = 1_000_000
    # replica 0: steps of 10 ms (2 ms all-reduce) and 20 ms (4 ms); replica 1: 8 ms of 16 ms
    first = Trace(0, [Span("F", 0, 0, 3 * ms), Span("B", 0, 3 * ms, 8 * ms),
                      Span("AR", None, 8 * ms, 10 * ms, 500),
                      Span("STEP", None, 10 * ms, 10 * ms),
                      Span("R<F", 1, 12 * ms, 13 * ms, 64), Span("F", 1, 13 * ms, 26 * ms),
                      Span("AR", None, 26 * ms, 30 * ms, 500),
                      Span("STEP", None, 30 * ms, 32 * ms)],
                  replica=0)
    second = Trace(0, [Span("F", 0, 4 * ms, 12 * ms), Span("AR", None, 12 * ms, 20 * ms, 700),
                       Span("STEP", None, 20 * ms, 20 * ms)], replica=1)
    share = bench.all_reduce_share([first, second])
    assert share.fraction == pytest.approx((0.2 + 0.2 + 0.5) / 3)
    assert share.reduce_ms == pytest.approx((2 + 4 + 8) / 3)
    assert share.step_ms == pytest.approx((10 + 20 + 16) / 3)
    assert (share.gradient_bytes, share.steps) == (350, 3)  # span bytes: both ways
    assert bench.stage_compute_ms([first, second]) == pytest.approx({0: (21 / 2 + 8) / 2})
    with pytest.raises(RuntimeError, match="no optimiser step"):
        bench.all_reduce_share([Trace(0, [Span("F", 0, 0, ms)])])


def test_images_per_call_is_the_combined_batch() -> None:
    bench = load_benchmark("replicas")
    layout = bench.Bench(width=4, image_size=16, micro_batch=5, device_iterations=2)
    assert layout.images_per_call(2) == 2 * bench.ACCUMULATION * 2 * 5  # D * G * R * B


@pytest.mark.slow  # starts 2 and then 4 pipetorch workers on the whole machine's cores
def test_quick_run_prints_every_row_and_the_all_reduce_fraction() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick"], capture_output=True,
                          text=True, timeout=170, cwd=SCRIPT.parent.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    cores = int(re.match(r"(\d+) cores;", out).group(1))
    assert f"the R=2 workers {max(1, cores // 2)} thread(s) each while R=1 gets {cores}" in out
    rates = {}
    for row in {f"plain PyTorch, {cores} thread{'s' if cores > 1 else ''}",
                "plain PyTorch, 1 thread", "pipetorch R=1, 1 device, 1 thread",
                f"pipetorch R=1, 1 device, {cores} thread{'s' if cores > 1 else ''}",
                "pipetorch R=2, 2 devices", "pipetorch R=2 x 2 stages, 4 devices"}:
        found = re.search(rf"^{re.escape(row)}\s+([\d,]+\.\d)\s+(\S.*)$", out, re.M)
        assert found, (row, out)
        rates[row] = float(found.group(1).replace(",", ""))
        assert rates[row] > 0, (row, out)
    assert re.search(r"^pipetorch R=2, 2 devices .*\[1, 1\] +[\d.]+x plain PyTorch, "
                     r"\d+ threads?; [\d.]+x pipetorch R=1, 1 device", out, re.M), out
    fractions = re.findall(r"^  pipetorch R=2[^:]*: all-reduce fraction (\d\.\d{3}) "
                           r"\(([\d.]+) ms of a ([\d.]+) ms step", out, re.M)
    assert len(fractions) == 2, out
    for fraction, reduce_ms, step_ms in fractions:
        assert 0.0 < float(fraction) < 1.0, out
        assert 0.0 < float(reduce_ms) < float(step_ms), out
