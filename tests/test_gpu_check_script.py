"""scripts/gpu-check.sh on a machine without a GPU (--cpu-ok): its phases, its summary, and a
python without pytest."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu-check.sh"


def gpu_check(tmp_path: Path, *args: str, python: str = sys.executable,
              **env: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(SCRIPT), "--cpu-ok", *args, str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PIPETORCH_GPU_PYTHON": python, **env})
    return proc, json.loads((out / "summary.json").read_text())


def no_pytest_python(tmp_path: Path) -> str:
    """A python whose `import pytest` fails, as on a bare GPU machine."""
    (tmp_path / "stub").mkdir()
    (tmp_path / "stub" / "pytest.py").write_text("raise ImportError('no pytest here')\n")
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH="{tmp_path / "stub"}:$PYTHONPATH" '
                       f'exec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


@pytest.mark.slow
def test_the_gpt2_phase_reports_its_counts(tmp_path):
    proc, summary = gpu_check(tmp_path, "--only", "gpt2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    gpt2 = summary["phases"]["gpt2"]
    assert (gpt2["tests"], gpt2["skipped"], gpt2["failed"]) == (1, 1, 0)  # no CUDA here
    assert "gpt2: 0 passed, 0 failed, 1 skipped, 0 errors" in proc.stdout


def test_quick_runs_cuda_gpt2_and_the_short_benchmark_and_survives_without_pytest(tmp_path):
    proc, summary = gpu_check(tmp_path, "--quick", python=no_pytest_python(tmp_path),
                              GPU_CHECK_BENCH_TIMEOUT="1")
    assert list(summary["phases"]) == ["cuda", "gpt2", "bench"]
    assert summary["phases"]["cuda"]["exit_status"] == 3  # not run: reported, not a crash
    assert "cuda: exit status 3 (pytest not installed)" in proc.stdout
    assert "--prepare" in proc.stderr
    assert summary["phases"]["bench"]["exit_status"] == 124  # ran, stopped by its 1 s limit
    assert proc.returncode == 1 and "GPU check: FAILED" in proc.stdout


def test_an_extra_benchmark_that_is_not_there_is_named(tmp_path):
    if (ROOT / "benchmarks" / "generate.py").exists():
        pytest.skip("benchmarks/generate.py exists in this tree")
    proc, summary = gpu_check(tmp_path, "--only", "generate", python=no_pytest_python(tmp_path))
    assert summary["phases"]["generate"]["exit_status"] == 127
    assert "benchmarks/generate.py does not exist here" in proc.stdout
