"""examples/bert_squad.py and its unmodified PopTorch copy fine-tune a small BERT pipelined."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow, pytest.mark.transformers]

ROOT = Path(__file__).resolve().parent.parent
SMALL = ("--layers-per-ipu", "1", "1", "--items", "112")


def run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_the_tutorial_fine_tunes_over_two_devices() -> None:
    proc = run("examples/bert_squad.py", *SMALL, "--hidden", "32", "--heads", "2",
               "--sequence-length", "32", "--epochs", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == "BERT: 2 layers over 2 devices [1, 1] (4 stages), 112 sequences of 32, 56 per call"
    epochs = [re.match(r"Epoch (\d): loss ([\d.]+), ([\d.]+) sequences/s", line) for line in lines[2:]]
    assert [m.group(1) for m in epochs if m] == ["1", "2"], proc.stdout
    assert "lr_scheduler.step()" not in proc.stderr  # the optimiser stepped on the device


def test_the_poptorch_script_runs_through_pipetorch_run() -> None:
    proc = run("-m", "pipetorch", "run", "examples/poptorch_style/bert_squad.py", *SMALL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.fullmatch(r"Epoch 1: loss [\d.]+, [\d.]+ sequences/s", proc.stdout.strip()), proc.stdout
