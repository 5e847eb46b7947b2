"""The unmodified PopTorch-style examples (`import poptorch`) run through `pipetorch run`."""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STYLE = ROOT / "examples" / "poptorch_style"
SCRIPTS = ("mnist_pipeline.py", "resnet_optimisation.py", "multi_device.py", "data_loading.py",
           "bert_squad.py")


def pipetorch_run(script: str, *args: str) -> subprocess.CompletedProcess:
    # One intra-op thread: stage workers and loader processes share the CI machine's cores.
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "pipetorch", "run",
                           f"examples/poptorch_style/{script}", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_scripts_are_poptorch_code(script: str) -> None:
    source = (STYLE / script).read_text()
    imports = [line for line in source.splitlines() if line.startswith(("import ", "from "))]
    assert "import poptorch" in imports
    assert not [line for line in imports if "pipetorch" in line]


@pytest.mark.slow  # replicas run in worker processes
def test_one_device_and_data_parallel_runs() -> None:
    proc = pipetorch_run("multi_device.py", "--items", "64", "--device-iterations", "2",
                         "--replicas", "2", "--batch-size", "4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].endswith(": 1 IPU x 2 replica(s), 16 images per step")
    losses = [float(m[1]) for m in re.finditer(r"Epoch \d: loss (\d+\.\d{4}), \d+\.\d images/s",
                                               proc.stdout)]
    assert len(losses) == 2 and losses[1] < losses[0]


@pytest.mark.slow
def test_resnet_pipelined_over_two_ipus_with_fp16_uint8_inputs_into_fp32() -> None:
    proc = pipetorch_run("resnet_optimisation.py", "--batch-size", "2", "--width", "4",
                         "--precision", "16.32", "--eight-bit-io", "--dataset-size", "12",
                         "--epochs", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("Namespace(batch_size=2, precision='16.32'")
    epochs = [re.fullmatch(r"\[Epoch (\d\d)\] loss: (\S+), acc: (\d+\.\d)", line)
              for line in lines[1:]]
    assert [m[1] for m in epochs] == ["01", "02"], lines
    assert all(math.isfinite(float(m[2])) for m in epochs)
