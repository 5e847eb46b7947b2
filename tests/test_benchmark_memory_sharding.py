"""benchmarks/memory.py --sharding: both rows, off and on, with their ratios and call times."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "memory.py"


@pytest.mark.slow
@pytest.mark.timeout(600)  # two fresh interpreters, each starting 4 workers
def test_sharding_rows_print_peaks_ratios_and_call_times():
    done = subprocess.run([sys.executable, str(SCRIPT), "--sharding", "--layers", "2",
                           "--width", "256"], capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = dict(re.findall(r"^\| (off|on) \| ([\d.]+ GB \([\d.]+x\)(?: \| [^|]+)+) \|$",
                           done.stdout, re.M))
    assert set(rows) == {"off", "on"}, done.stdout
    assert rows["off"].count("(1.00x)") == 4, rows["off"]  # the baseline's own ratios
    assert re.search(r"\| [\d.]+ s \([\d.]+x\)$", rows["on"]), rows["on"]
