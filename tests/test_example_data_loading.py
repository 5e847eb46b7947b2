"""Seed 001's data-loading experiment: the pipetorch example and the unmodified PopTorch script."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# 28x28 images (the tutorial's MNIST-sized model): 256 items make 8 steps of 8 x 4.
SMALL = ("--items", "256", "--image-size", "28", "--batch-size", "8", "--device-iterations", "4")
NUMBER = r"(\d+\.\d\d)"


def run(*command: str) -> subprocess.CompletedProcess:
    # One intra-op thread: the Async loader's process shares the CI machine's few cores.
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, *command], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=110)


def value(line: str, pattern: str) -> float:
    match = re.fullmatch(pattern, line)
    assert match, f"{line!r} does not match {pattern!r}"
    return float(match.group(1))


@pytest.mark.slow
def test_loader_and_model_throughput_on_real_data() -> None:
    proc = run("examples/data_loading.py", *SMALL, "--num-workers", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == ("Random dataset: 256 images 1x28x28; Async loader with 1 worker(s); real "
                        "data for the model.")
    assert lines[1] == ("Evaluating: 8 steps of 32 items (batch size 8 x device iterations 4 x "
                        "replicas 1)")
    assert value(lines[2], rf"DataLoader throughput: {NUMBER} items/s") > 0
    assert value(lines[3], rf"DataLoader execution time: {NUMBER} s") >= 0
    assert value(lines[4], rf"IPU throughput: {NUMBER} items/s") > 0
    assert value(lines[5], rf"DataLoader with training execution time: {NUMBER} s") > 0
    assert len(lines) == 6


@pytest.mark.slow
def test_synthetic_data_with_replicas() -> None:
    proc = run("examples/data_loading.py", *SMALL, "--num-workers", "0", "--synthetic-data",
               "--replicas", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].endswith("synthetic data for the model.")
    assert lines[1] == ("Evaluating: 4 steps of 64 items (batch size 8 x device iterations 4 x "
                        "replicas 2)")
    assert value(lines[2], rf"DataLoader throughput: {NUMBER} items/s") > 0
    assert value(lines[4], rf"IPU throughput: {NUMBER} items/s") > 0
    assert lines[5].startswith("Synthetic data training execution time: ")


def test_too_small_images_are_refused_with_the_smallest_size() -> None:
    proc = run("examples/data_loading.py", "--items", "16", "--image-size", "11")
    assert proc.returncode == 1
    assert ("ValueError: --image-size 11 is too small for the model's convolutions and pooling; "
            "use 12 or more") in proc.stderr


@pytest.mark.slow
def test_the_poptorch_script_runs_unchanged_through_pipetorch_run() -> None:
    script = ROOT / "examples" / "poptorch_style" / "data_loading.py"
    source = script.read_text()
    assert "import poptorch\n" in source and "import pipetorch" not in source
    proc = run("-m", "pipetorch", "run", str(script.relative_to(ROOT)), *SMALL,
               "--num-workers", "1", "--replicas", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == "Evaluating: 4 steps of 64 items"
    assert value(lines[1], rf"DataLoader throughput: {NUMBER} items/s") > 0
    assert value(lines[2], rf"Dataloader execution time: {NUMBER} s") >= 0
    assert value(lines[3], rf"IPU throughput: {NUMBER} items/s") > 0
    assert value(lines[4], rf"Dataloader with IPU training execution time: {NUMBER} s") > 0


@pytest.mark.slow
# A wrapper left to the garbage collector was kept alive by its model until interpreter exit,
# where flushing its weights aborted Python (c10 assert in THPStorage_dealloc, exit code 134).
def test_the_poptorch_script_with_synthetic_data_exits_cleanly() -> None:
    proc = run("-m", "pipetorch", "run", "examples/poptorch_style/data_loading.py", *SMALL,
               "--num-workers", "0", "--synthetic-data")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == "Evaluating: 8 steps of 32 items"
    assert value(lines[3], rf"IPU throughput: {NUMBER} items/s") > 0
