"""Options refused when set, in the user's terms: cache and profiling paths that cannot hold
files (setters and environment variables), and setters called after the options froze."""
from __future__ import annotations

import os

import pytest
import torch

import pipetorch as poptorch
from error_cases import Regressor, no_worker_started
from pipetorch.errors import ConfigError


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for var in ("POPTORCH_CACHE_DIR", "POPLAR_ENGINE_OPTIONS", "POPTORCH_DEFAULT_OPTIONS"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "cache.bin"
    path.write_text("not a directory")
    return str(path)


# Issue 23: enableExecutableCaching("cache.bin") on a file was accepted, and the first call
# died with "[Errno 17] File exists: 'cache.bin'", naming neither the option nor the path's role.
@pytest.mark.parametrize("setter, arg, holds", [
    ("enableExecutableCaching", "path", "the executable cache"),
    ("enableProfiling", "profile_dir", "the profiling reports"),
])
def test_a_file_given_as_directory_is_refused_by_the_setter(a_file, setter, arg, holds):
    opts = poptorch.Options()
    with pytest.raises(ValueError) as info:
        getattr(opts, setter)(a_file)
    assert str(info.value) == (
        f"{setter}: {arg} {a_file!r} is a file, not a directory. Pass a directory for {holds} "
        "(it is created if missing) that this process can write to")


@pytest.mark.parametrize("setter", ["enableExecutableCaching", "enableProfiling"])
def test_a_directory_under_a_file_cannot_be_created(a_file, setter):
    inside = os.path.join(a_file, "sub", "dir")
    with pytest.raises(ValueError, match=f"{setter}: .* {inside!r} cannot be created: "
                                         f"{a_file!r} is a file, not a directory"):
        getattr(poptorch.Options(), setter)(inside)


def test_an_unwritable_parent_is_named(tmp_path, monkeypatch):
    # (running as root, permissions cannot be taken away: creating the directory is stubbed
    # to fail as it would for another user; tests/compat/test_paths_compat.py uses /proc)
    locked = str(tmp_path)
    real = os.makedirs

    def makedirs(path, *args, **kwargs):
        if os.path.dirname(path) == locked:
            raise PermissionError(13, "Permission denied", path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "makedirs", makedirs)
    with pytest.raises(ValueError, match=f"cannot be created under {locked!r} "
                                         r"\(Permission denied\)"):
        poptorch.Options().enableProfiling(os.path.join(locked, "reports"))


def test_creatable_and_existing_directories_are_accepted_and_not_created(tmp_path):
    new = tmp_path / "a" / "b"
    opts = poptorch.Options().enableExecutableCaching(str(new)).enableProfiling(str(tmp_path))
    assert (opts.executable_cache_dir, opts.profiling_dir) == (str(new), str(tmp_path))
    assert not new.exists()  # setting an option writes nothing
    assert poptorch.Options().enableExecutableCaching(None).executable_cache_dir is None


def test_cache_variable_naming_a_file_is_refused_at_construction(a_file, monkeypatch):
    monkeypatch.setenv("POPTORCH_CACHE_DIR", a_file)
    with pytest.raises(ConfigError) as info:
        poptorch.Options()
    assert str(info.value) == (
        f"Environment variable POPTORCH_CACHE_DIR={a_file!r} is a file, not a directory: set "
        "it to a directory for the executable cache (created if missing) that this process "
        "can write to, or unset it")


def test_cache_variable_naming_an_impossible_path(a_file, monkeypatch):
    impossible = os.path.join(a_file, "cache")
    monkeypatch.setenv("POPTORCH_CACHE_DIR", impossible)
    with pytest.raises(ConfigError, match=f"POPTORCH_CACHE_DIR={impossible!r} cannot be created: "
                                          f"{a_file!r} is a file"):
        poptorch.Options()


def test_engine_options_report_directory_naming_a_file(a_file, monkeypatch):
    monkeypatch.setenv("POPLAR_ENGINE_OPTIONS",
                       f'{{"autoReport.all": "true", "autoReport.directory": "{a_file}"}}')
    with pytest.raises(ConfigError) as info:
        poptorch.Options()
    assert str(info.value) == (
        f'Environment variable POPLAR_ENGINE_OPTIONS: "autoReport.directory" {a_file!r} is a '
        "file, not a directory: name a directory for the profiling reports (created if "
        'missing) that this process can write to, or drop "autoReport.all"')


def test_default_options_variable_names_itself_and_the_path(a_file, monkeypatch):
    monkeypatch.setenv("POPTORCH_DEFAULT_OPTIONS", f'{{"enableExecutableCaching": "{a_file}"}}')
    with pytest.raises(ConfigError, match="POPTORCH_DEFAULT_OPTIONS: enableExecutableCaching"
                                          ".* is a file, not a directory"):
        poptorch.Options()


# Issue 23: "Can't modify frozen Options" named neither the setter nor what froze them.
@pytest.mark.parametrize("freeze, by", [
    (lambda o: poptorch.trainingModel(Regressor(), o), "poptorch.trainingModel"),
    (lambda o: poptorch.inferenceModel(Regressor(), o), "poptorch.inferenceModel"),
    (lambda o: poptorch.DataLoader(o, torch.utils.data.TensorDataset(torch.zeros(4, 4))),
     "poptorch.DataLoader"),
])
def test_changing_options_after_wrapping_names_the_setter_and_the_fix(freeze, by):
    opts = poptorch.Options()
    with no_worker_started():
        keep = freeze(opts)
        with pytest.raises(AttributeError) as info:
            opts.Training.gradientAccumulation(4)
    assert str(info.value) == (
        "Can't modify frozen Options: Training.gradientAccumulation(4) came after these "
        f"options were given to {by}, which keeps the values it was built with. Set every "
        "option before wrapping the model or building the DataLoader, or change a copy: "
        "`opts = opts.clone()`, call the setter on it and wrap (or build the DataLoader) "
        "again with the copy")
    copy = opts.clone().deviceIterations(2)  # the fix works
    assert copy.device_iterations == 2 and opts.device_iterations == 1
    del keep
