"""The type checker and the linter hold the library (issue 52): mypy, configured in
pyproject.toml (default checks, check_untyped_defs, warn_unused_ignores), reports no error on
pipetorch/, and ruff's pyflakes, bugbear and syntax rules (F, B, E9) report nothing."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *command], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.timeout(600)  # a cold cache takes a minute on 2 cores; .ci/run warms it
def test_mypy_finds_no_error_in_the_library():
    done = _run("mypy")  # pyproject.toml names the package, the settings and typings/
    assert done.returncode == 0, f"mypy:\n{done.stdout}{done.stderr}"
    assert "Success: no issues found" in done.stdout


def test_ruff_finds_nothing_in_the_library():
    done = _run("ruff", "check", "--no-cache", "pipetorch")
    assert done.returncode == 0, f"ruff:\n{done.stdout}{done.stderr}"
