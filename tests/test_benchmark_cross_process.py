"""benchmarks/cross_process.py --quick: every row (one process, both torchrun recipes; the MLP
and the tiny GPT-2) prints, and every row trains with the same losses."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "cross_process.py"
RECIPES = ("--nproc-per-node 2", "--nnodes 2")
RATE = r"\s+[\d,.]+\s+[\d,.]+\.\.[\d,.]+\s*$"  # samples/s, slowest..fastest


@pytest.mark.slow
@pytest.mark.timeout(300)  # torchrun's processes in both recipes; 60-75 s on a quiet host
def test_quick_run_prints_every_row_with_the_same_losses() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    mlp, gpt2 = done.stdout.split("\nMLP width 32 ")[1].split("\ntiny GPT-2 ")
    for table, torch_row in ((mlp, True), (gpt2, False)):
        rows = ["pipetorch, 1 process (2 workers)",
                *(f"pipetorch, 2 processes, {r}" for r in RECIPES),
                *(f"torch Schedule1F1B, {r}" for r in RECIPES if torch_row)]
        for row in rows:
            assert re.search(rf"^{re.escape(row)}{RATE}", table, re.M), table
        for recipe in RECIPES:
            vs_torch = r"/ torch Schedule1F1B\s+[\d.]+x\s+" if torch_row else ""
            assert re.search(rf"^  {recipe}\s+{vs_torch}/ 1 process\s+[\d.]+x$", table,
                             re.M), table
        gaps = re.findall(r"(?:vs 1 process|vs torch) (\S+?)(?:;|$)", table, re.M)
        assert len(gaps) == (2 if torch_row else 1), table
        assert max(map(float, gaps)) < 1e-5, table
