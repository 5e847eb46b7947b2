"""benchmarks/cross_process.py --quick: both pipelines over two torchrun processes, same losses."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "cross_process.py"


@pytest.mark.slow
def test_quick_run_prints_both_rows_with_the_same_losses() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    for row in ("pipetorch, stagesAcrossProcesses", "torch.distributed.pipelining"):
        assert re.search(rf"^{re.escape(row)}.*\s[\d.]+\s+[\d.]+$", done.stdout, re.M), done.stdout
    gap = re.search(r"between the two: (\S+)", done.stdout)
    assert gap and float(gap.group(1)) < 1e-5, done.stdout
