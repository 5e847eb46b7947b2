"""Issue 32 B: cache and profiling folders that cannot be made are refused when set.

POPTORCH_CACHE_DIR / enableExecutableCaching(path) under /proc (or with control characters)
used to be accepted and fail at the first call with a raw "[Errno 2]"; a profiling folder
under /sys was only warned about at destroy(), losing the report. Root passes every
permission-bit check, so the folder is really created (and removed again) to know.
"""
from __future__ import annotations

import os
import re
import sys

import pytest
import torch

import pipetorch as poptorch
from helpers.models import TinyMLP
from pipetorch.errors import ConfigError

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="/proc and /sys are Linux's")
UNDER_PROC = "/proc/pipetorch-cache"
UNDER_SYS = "/sys/pipetorch-reports"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for var in ("POPTORCH_CACHE_DIR", "POPLAR_ENGINE_OPTIONS", "POPTORCH_DEFAULT_OPTIONS"):
        monkeypatch.delenv(var, raising=False)


@linux_only
@pytest.mark.parametrize("setter, arg, path, parent, holds", [
    ("enableExecutableCaching", "path", UNDER_PROC, "/proc", "the executable cache"),
    ("enableProfiling", "profile_dir", UNDER_SYS, "/sys", "the profiling reports"),
])
def test_a_folder_that_cannot_be_made_is_refused_by_the_setter(setter, arg, path, parent,
                                                               holds):
    with pytest.raises(ValueError) as info:
        getattr(poptorch.Options(), setter)(path)
    message = str(info.value)
    assert message.startswith(f"{setter}: {arg} {path!r} cannot be created under {parent!r} (")
    assert message.endswith(f"Pass a directory for {holds} (it is created if missing) that "
                            "this process can write to")
    assert not os.path.exists(path)


@linux_only
def test_an_existing_folder_nothing_can_be_written_to_is_refused():
    with pytest.raises(ValueError, match="enableExecutableCaching: path '/proc' is a directory "
                                         "this process cannot write to"):
        poptorch.Options().enableExecutableCaching("/proc")


@pytest.mark.parametrize("name", ["cache\n", "ca\x1bche", "cache\x00"])
def test_a_name_with_control_characters_is_refused(tmp_path, name):
    path = str(tmp_path / name)
    with pytest.raises(ValueError, match=re.escape(
            f"enableExecutableCaching: path {path!r} contains the control character")):
        poptorch.Options().enableExecutableCaching(path)
    assert os.listdir(tmp_path) == []


@linux_only
@pytest.mark.parametrize("value", [UNDER_PROC, "/tmp/pipetorch-cache\n"])
def test_the_cache_variable_is_refused_when_options_are_made(monkeypatch, value):
    monkeypatch.setenv("POPTORCH_CACHE_DIR", value)
    with pytest.raises(ConfigError, match=re.escape(
            f"Environment variable POPTORCH_CACHE_DIR={value!r} ") + ".*set it to a directory "
            "for the executable cache"):
        poptorch.Options()


@linux_only
def test_the_report_directory_variable_is_refused_when_options_are_made(monkeypatch):
    monkeypatch.setenv("POPLAR_ENGINE_OPTIONS",
                       f'{{"autoReport.all": "true", "autoReport.directory": "{UNDER_SYS}"}}')
    with pytest.raises(ConfigError, match=f'POPLAR_ENGINE_OPTIONS: "autoReport.directory" '
                                          f"{UNDER_SYS!r} cannot be created under '/sys'"):
        poptorch.Options()


def test_a_checked_folder_is_not_left_behind(tmp_path):
    new = tmp_path / "a" / "b"
    poptorch.Options().enableExecutableCaching(str(new)).enableProfiling(str(tmp_path / "r"))
    assert os.listdir(tmp_path) == []


def test_a_report_folder_that_became_impossible_fails_at_compile_not_at_destroy(tmp_path):
    reports = tmp_path / "reports"
    opts = poptorch.Options().enableProfiling(str(reports))
    reports.write_text("now a file")  # after the setter's check
    model = poptorch.inferenceModel(TinyMLP(), opts)
    with pytest.raises(ConfigError, match=f"profiling report directory "
                                          f"{str(reports / 'inference')!r} cannot be created"):
        model(torch.zeros(2, 6))
