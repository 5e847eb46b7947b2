"""scripts/setup.sh picks the CUDA build of torch when nvidia-smi answers, else the CPU build.

The GPU machine has no network, so setup.sh's CUDA branch cannot run there: here a stand-in
nvidia-smi and a stand-in pip (which records what it was asked to install) check the choice.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_setup(tmp_path: Path, *, gpu: bool) -> list[str]:
    """The `pip install` argument lines setup.sh ran, with nvidia-smi working or failing."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "setup.sh", tmp_path / "scripts" / "setup.sh")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    bin_dir, venv_bin = tmp_path / "bin", tmp_path / "venv" / "bin"
    bin_dir.mkdir()
    venv_bin.mkdir(parents=True)
    (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\nexit {0 if gpu else 9}\n")
    (venv_bin / "python").write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then shift 2; echo "$*" >> "$PIP_LOG"; exit 0; fi\n'
        f'exec "{sys.executable}" "$@"\n')
    for tool in (bin_dir / "nvidia-smi", venv_bin / "python"):
        tool.chmod(0o755)
    log = tmp_path / "pip.log"
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", PIP_LOG=str(log),
               PIPETORCH_VENV=str(tmp_path / "venv"))
    proc = subprocess.run(["bash", str(tmp_path / "scripts" / "setup.sh")], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return log.read_text().splitlines()


@pytest.mark.skipif(sys.platform != "linux", reason="setup.sh's CPU branch is Linux's")
@pytest.mark.parametrize("gpu", [True, False], ids=["nvidia-smi", "no-gpu"])
def test_setup_installs_the_torch_build_for_the_machine(tmp_path, gpu):
    installs = run_setup(tmp_path, gpu=gpu)
    torch_lines = [line for line in installs if "torch" in line.split()[-1]]
    want = "torch===2.13.0" if gpu else "torch==2.13.0+cpu"
    assert torch_lines and torch_lines[0].endswith(want), installs
    assert installs[-1].endswith('-e .[demo,test,docs]'), installs
