"""benchmarks/memory.py: the whole-tree sampler, and --quick --mapped runs end to end."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.scripts import load_benchmark
from pipetorch.parallel.comm.resident import rss

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "memory.py"
tree_memory = load_benchmark("tree_memory")
TreeSampler, descendants = tree_memory.TreeSampler, tree_memory.descendants


def test_the_sampler_sees_a_child_and_keeps_each_phase_peak():
    child = subprocess.Popen([sys.executable, "-c",
                              "import time; x = bytearray(200 << 20); time.sleep(30)"])
    try:
        with TreeSampler(interval=0.05) as sampler:
            sampler.phase("before")
            deadline = time.monotonic() + 20
            while (rss(child.pid) or 0) < (200 << 20) and time.monotonic() < deadline:
                time.sleep(0.05)
            sampler.phase("child")
            time.sleep(0.2)
    finally:
        child.kill()
        child.wait()
    peaks = sampler.peaks
    assert child.pid not in descendants(os.getpid())
    assert peaks.processes["child"][child.pid] >= 200 << 20
    assert peaks.tree["child"] >= peaks.root["child"] + (200 << 20)
    assert 0 < peaks.tree_pss["child"] <= peaks.tree["child"]


@pytest.mark.slow
@pytest.mark.transformers
@pytest.mark.timeout(900)  # three fresh interpreters each training a model, on a shared host
def test_quick_run_prints_every_setting_with_ratios(tmp_path):
    """--apart's row is the pipetorch row run with PIPETORCH_SHARED_WEIGHTS=0 (the setting's
    own memory is tested in tests/parallel/test_memory_ratios.py): not run here, one fresh
    interpreter fewer."""
    env = dict(os.environ, MEMORY_BENCHMARK_FOLDER=str(tmp_path))
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--mapped"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {m.group(1): m for m in re.finditer(
        r"^\| (plain|pipetorch|mapped) \| ([\d.]+) GB \(([\d.]+)x\) \|", done.stdout, re.M)}
    assert set(rows) == {"plain", "pipetorch", "mapped"}, done.stdout
    assert float(rows["plain"].group(3)) == 1.0
    assert "Phase by phase (mapped" in done.stdout and "host copy" in done.stdout
