"""benchmarks/overlap.py: a row's numbers from the workers' traces, and --quick runs end to end."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipetorch.parallel.comm.payloads import Span, Trace
from helpers.scripts import load_benchmark

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "overlap.py"


def test_a_row_averages_steps_waits_and_early_buckets_over_workers() -> None:
    bench = load_benchmark("overlap")
    ms = 1_000_000
    # one worker: a 10 ms step waiting 2 ms at AR, two buckets started early; another: 6 ms, 1
    first = Trace(0, [Span("H2D", None, 0, 5 * ms), Span("F", 0, 5 * ms, 9 * ms),
                      Span("B", 0, 9 * ms, 13 * ms), Span("AR", None, 13 * ms, 15 * ms),
                      Span("STEP", None, 15 * ms, 15 * ms)],
                  early_reduces=[Span("AR", 0, 10 * ms, 15 * ms), Span("AR", 0, 12 * ms, 15 * ms)])
    second = Trace(1, [Span("B", 0, 0, 5 * ms), Span("AR", None, 5 * ms, 6 * ms),
                       Span("STEP", None, 6 * ms, 6 * ms)])
    row = bench._row([1.0, 3.0, 2.0], [first, second])
    assert row == bench.Row(call_s=2.0, step_ms=8.0, wait_ms=1.5, buckets=1.0)


@pytest.mark.slow  # starts 2 + 2 and then 4 + 4 pipetorch workers
def test_quick_run_prints_both_settings_and_their_ratio_for_each_row() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick"], capture_output=True,
                          text=True, timeout=170, cwd=SCRIPT.parent.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("R=2 x 1 stage", "R=2 x 2 stages"):
        early = {}
        for setting in ("at the step", "overlap"):
            found = re.search(rf"^{re.escape(name)}, {setting}\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+"
                              r"([\d.]+)$", proc.stdout, re.M)
            assert found, (name, setting, proc.stdout)
            early[setting] = float(found.group(1))
        assert early["at the step"] == 0 and early["overlap"] >= 1, proc.stdout
        assert re.search(rf"^{re.escape(name)}, ratio\s+[\d.]+\s+[\d.]+\s+[\d.]+$",
                         proc.stdout, re.M), proc.stdout
