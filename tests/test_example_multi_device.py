"""examples/multi_device.py runs one device, data parallel and model parallel as a user runs it."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The small ResNet at width 4 on a handful of images: seconds per run.
TINY = ("--model", "small", "--width", "4", "--batch-size", "2", "--device-iterations", "1")
EPOCH = re.compile(r"Epoch (\d+)/(\d+): loss (\d+\.\d{4}), accuracy (\d+\.\d\d)%, (\d+) images in "
                   r"(\d+\.\d\d) s, (\d+\.\d) images/s")
SUMMARY = re.compile(r"Trained (\d+) images in (\d+\.\d\d) s: (\d+\.\d) images/s on "
                     r"(\d) stage\(s\) x (\d) replica\(s\)\.")


def run(*args: str) -> tuple[subprocess.CompletedProcess, int]:
    """Run the example; returns the finished process and its pid."""
    # One intra-op thread: the CI machine's few cores are shared by the stage workers.
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "examples/multi_device.py", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=110)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), proc.pid


def epochs(stdout: str) -> list[tuple[float, float, int]]:
    """(loss, accuracy, images) of every epoch line."""
    return [(float(m[3]), float(m[4]), int(m[5])) for m in EPOCH.finditer(stdout)]


def test_single_device_trains_and_prints_its_layout() -> None:
    proc, pid = run(*TINY, "--batch-size", "8", "--device-iterations", "4", "--items", "256",
                    "--epochs", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[1] == ("Batching: batch size 8 x gradient accumulation 1 x replicas 1 x device "
                        "iterations 4 = 32 images per call, 8 calls per epoch.")
    assert lines[2] == ("Device layout: 1 stage(s) x 1 replica(s) = 1 logical device(s); "
                        "stage 0 (ipu 0): conv1 .. fc + loss")
    assert lines[3] == f"Processes: all stages run in this process (pid {pid})."
    (loss1, _, images1), (loss2, accuracy2, images2) = epochs(proc.stdout)
    assert images1 == images2 == 256
    assert loss2 < loss1 and accuracy2 > 30.0  # 10 classes: chance is 10%
    summary = SUMMARY.fullmatch(lines[-1])
    assert summary, lines[-1]
    assert summary.group(1, 4, 5) == ("512", "1", "1") and float(summary[3]) > 0


@pytest.mark.slow  # two replica workers
def test_replicas_of_a_model_with_batchnorm_keep_their_own_statistics() -> None:
    proc, pid = run(*TINY, "--replicas", "2", "--norm", "batch", "--items", "16", "--epochs", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert "with batch norm" in lines[0]
    assert lines[2].startswith("Device layout: 1 stage(s) x 2 replica(s) = 2 logical device(s);")
    workers = re.fullmatch(r"Processes: stage 0 of replica 0 in pid (\d+) on cpu \(\d+ thread\(s\)\), "
                           r"stage 0 of replica 1 in pid (\d+) on cpu \(\d+ thread\(s\)\)\.", lines[3])
    assert workers, lines[3]
    assert len({pid, int(workers[1]), int(workers[2])}) == 3
    assert [images for _, _, images in epochs(proc.stdout)] == [16]
    assert SUMMARY.fullmatch(lines[-1]).group(4, 5) == ("1", "2")


@pytest.mark.slow
@pytest.mark.timeout(240)  # two runs; on a loaded CI machine each may take a minute
def test_model_and_data_parallel_run_two_stage_workers_with_single_device_numbers() -> None:
    settings = ("--replicas", "2", "--gradient-accumulation", "3", "--items", "24", "--epochs", "2")
    split, pid = run(*TINY, *settings, "--split-at", "layer4")
    assert split.returncode == 0, split.stderr[-3000:]
    lines = split.stdout.splitlines()
    assert lines[1] == ("Batching: batch size 2 x gradient accumulation 3 x replicas 2 x device "
                        "iterations 1 = 12 images per call, 2 calls per epoch.")
    assert lines[2] == ("Device layout: 2 stage(s) x 2 replica(s) = 4 logical device(s); "
                        "stage 0 (ipu 0): conv1 .. layer3; stage 1 (ipu 1): layer4 .. fc + loss")
    worker = r" in pid (\d+) on cpu \(\d+ thread\(s\)\)"
    workers = re.fullmatch(rf"Processes: stage 0 of replica 0{worker}, stage 1 of replica 0{worker}, "
                           rf"stage 0 of replica 1{worker}, stage 1 of replica 1{worker}\.", lines[3])
    assert workers, lines[3]
    assert len({pid, *(int(workers[i]) for i in range(1, 5))}) == 5
    assert SUMMARY.fullmatch(lines[-1]).group(1, 4, 5) == ("48", "2", "2")

    # The same training on one device: the pipeline must not change the numbers.
    single, _ = run(*TINY, *settings)
    assert single.returncode == 0, single.stderr[-3000:]
    assert single.stdout.splitlines()[3].startswith("Processes: stage 0 of replica 0 in pid")
    for (loss, accuracy, images), (ref_loss, ref_accuracy, ref_images) in zip(
            epochs(split.stdout), epochs(single.stdout), strict=True):
        assert loss == pytest.approx(ref_loss, abs=2e-4)
        assert images == ref_images
        assert abs(accuracy - ref_accuracy) <= 100.0 / images  # an argmax tie may flip one
