"""benchmarks/generate.py --quick: every row in one run, the same tokens plain and in stages."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "generate.py"

pytest.importorskip("transformers")


@pytest.mark.slow  # starts 2 + 2 pipetorch workers
def test_quick_run_prints_every_row_and_the_same_tokens() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick"], capture_output=True,
                          text=True, timeout=170, cwd=SCRIPT.parent.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "same tokens: True" in proc.stdout, proc.stdout
    for row in ("plain HF, 1 thread, 1 sequence", "plain HF, 2 threads, 4 sequences",
                "pipetorch 2 devices, 1 sequence", "pipetorch 2 devices, 4 sequences, 2 lanes",
                "pipetorch 2 devices, 4 sequences, 4 lanes"):
        assert re.search(rf"^{re.escape(row)}\s+[\d.]+\s+[\d.]+x\s+[\d.]+x\s+[\d.]+$",
                         proc.stdout, re.M), proc.stdout
