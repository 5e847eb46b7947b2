"""benchmarks/allreduce_memory.py: the bucketed all-reduce adds about one bucket of host
memory, the one-buffer one about the gradients' size."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "allreduce_memory.py"


@pytest.mark.slow  # two interpreters, 381 MB of gradients each
def test_buckets_add_a_bucket_where_one_buffer_added_every_gradient() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                          timeout=170, cwd=SCRIPT.parent.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ratios = [float(r) for r in re.findall(r"ratio ([0-9.]+)", proc.stdout)]
    assert len(ratios) == 2, proc.stdout
    one_buffer, bucketed = ratios
    assert one_buffer > 0.9  # the whole gradients once more
    assert bucketed < 0.15   # 25 MiB of 381 MB is 0.069
