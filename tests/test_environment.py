"""The PIPETORCH_* variables: defaults, parsing, the errors bad values raise, and the docs table."""
from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from pipetorch import environment
from pipetorch.environment import Environment
from pipetorch.errors import ConfigError

MACHINES = Path(__file__).resolve().parents[1] / "docs" / "machines.md"
NAMES = [f.name for f in fields(Environment)]


@pytest.fixture
def unset(monkeypatch):
    for name in NAMES:
        monkeypatch.delenv(environment.variable(name), raising=False)
    return monkeypatch


def test_unset_variables_give_the_fields_defaults(unset):
    assert environment.read() == Environment()
    assert Environment().timeout == 600.0 and Environment().snapshots == "auto"


@pytest.mark.parametrize("name, raw, value", [
    ("device", " cpu ", torch.device("cpu")),
    ("num_devices", "3", 3),
    ("threads_per_device", "2", 2),
    ("execution", "LOCAL", "local"),
    ("timeout", "2.5", 2.5),
    ("transport", "gloo", "gloo"),
    ("snapshots", "0", "0"),
    ("snapshots", "1", "1"),
    ("shared_weights", "0", "0"),
    ("worker_pool", "early", "early"),
    ("compile", "1", "inductor"),
    ("compile", "0", None),
    ("registry", "/tmp/workers", "/tmp/workers"),
    ("registry", "", None),
    ("max_devices", "128", 128),
    ("worker_nice", "0", 0),
    ("worker_nice", "19", 19),
])
def test_a_set_variable_is_parsed_to_its_fields_type(unset, name, raw, value):
    unset.setenv(environment.variable(name), raw)
    assert environment.get(name) == value
    assert getattr(environment.read(), name) == value


@pytest.mark.parametrize("name, raw, allowed", [
    ("device", "tpu:0", "is not a torch device: use 'cpu' or 'cuda"),
    ("num_devices", "0", "must be a positive whole number"),
    ("threads_per_device", "two", "must be a positive whole number"),
    ("execution", "threads", r"must be auto \(.*\), local \(.*\) or processes \("),
    ("timeout", "-1", "must be a positive number of seconds"),
    ("timeout", "", "must be a positive number of seconds"),
    ("transport", "ucx", r"must be shm \(.*\) or gloo \("),
    ("snapshots", "off", r"must be auto \(.*\), 1 \(.*\) or 0 \("),
    ("shared_weights", "yes", r"must be 1 \(.*\) or 0 \("),
    ("worker_pool", "2", r"must be 1 \(.*\), early \(.*\) or 0 \("),
    ("compile", "no-such-backend", r"names no torch.compile backend; use 1 \(inductor\), 0"),
    ("max_devices", "many", "must be a positive whole number"),
    ("worker_nice", "20", "must be a whole number from 0"),
    ("worker_nice", "-5", "must be a whole number from 0"),
])
def test_a_bad_value_names_the_variable_the_value_and_what_is_allowed(unset, name, raw,
                                                                      allowed):
    unset.setenv(environment.variable(name), raw)
    with pytest.raises(ConfigError, match=f"{environment.variable(name)}={raw!r} {allowed}"):
        environment.get(name)


def test_each_get_reads_the_variable_as_it_is_now_and_only_that_one(unset):
    unset.setenv("PIPETORCH_TIMEOUT", "5")
    assert environment.get("timeout") == 5.0
    unset.setenv("PIPETORCH_TIMEOUT", "7")
    assert environment.get("timeout") == 7.0
    unset.setenv("PIPETORCH_TRANSPORT", "carrier-pigeon")  # bad, but not the one asked for
    assert environment.get("timeout") == 7.0
    with pytest.raises(ConfigError, match="PIPETORCH_TRANSPORT"):
        environment.read()


def test_the_docs_table_lists_every_variable_as_declared():
    # The table used to be written by hand: PIPETORCH_REGISTRY and _MAX_DEVICES were missing.
    rows = {line.split(" | ")[0].strip("| `"): line for line in MACHINES.read_text().splitlines()
            if re.match(r"^\| `PIPETORCH_", line)}
    declared = {environment.variable(f.name):
                f"| `{environment.variable(f.name)}` | {f.metadata['meaning']} | "
                f"{f.metadata['shown']} |" for f in fields(Environment)}
    assert rows == declared
