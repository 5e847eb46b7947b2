"""examples/mixed_precision.py runs PopTorch's float16 recipe and its float32 twin on digits."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ACCURACY = re.compile(r"(16\.16|32\.32): test accuracy (\d+\.\d\d)% on 360 images")

pytest.importorskip("sklearn")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "examples/mixed_precision.py", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=170)


def test_both_precisions_train_and_the_gap_is_reported():
    # One epoch of a narrow CNN: far above chance (10%) in both precisions already.
    proc = run("--width", "8", "--epochs", "1", "--lr", "4e-3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0] == ("Digits: 8x8 images, 10 classes; batch 16 x device iterations 4, "
                        "1 epochs, AdamW lr 0.004.")
    losses = [float(m[1]) for m in re.finditer(r"epoch 1/1 loss (\d+\.\d{4})", proc.stdout)]
    assert len(losses) == 2 and all(loss < 2.3 for loss in losses), losses  # ln(10) = 2.30
    accuracies = dict((m[1], float(m[2])) for m in ACCURACY.finditer(proc.stdout))
    assert set(accuracies) == {"16.16", "32.32"} and min(accuracies.values()) > 50.0
    gap = float(re.fullmatch(r"Accuracy gap \(32\.32 minus 16\.16\): ([+-]\d+\.\d\d) points",
                             lines[-1])[1])
    assert gap == pytest.approx(accuracies["32.32"] - accuracies["16.16"], abs=0.011)
    assert abs(gap) <= 5.0  # one epoch; before issue 22 float16 ended at chance, 60+ below


def test_one_precision_alone_and_a_bad_choice():
    proc = run("--width", "4", "--epochs", "1", "--precision", "32.32")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [m[1] for m in ACCURACY.finditer(proc.stdout)] == ["32.32"]
    assert "gap" not in proc.stdout
    proc = run("--precision", "16.32")
    assert proc.returncode == 2 and "invalid choice: '16.32'" in proc.stderr
