"""Environment variables read by Options, and Options.Distributed's process id / count."""
from __future__ import annotations

import json
import logging
import re

import pytest

from pipetorch.enums import OutputMode
from pipetorch.errors import ConfigError
from pipetorch.options import Options

PROCESS_VARS = ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "WORLD_SIZE", "RANK",
                "MY_SIZE", "MY_RANK")
OPTION_VARS = ("POPTORCH_CACHE_DIR", "POPTORCH_DEFAULT_OPTIONS", "POPLAR_ENGINE_OPTIONS")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for var in PROCESS_VARS + OPTION_VARS:
        monkeypatch.delenv(var, raising=False)


def test_cache_dir_enables_executable_caching(monkeypatch):
    monkeypatch.setenv("POPTORCH_CACHE_DIR", "/tmp/exe_cache")
    assert Options().executable_cache_dir == "/tmp/exe_cache"


def test_default_options_are_applied_at_construction(monkeypatch):
    monkeypatch.setenv("POPTORCH_DEFAULT_OPTIONS", json.dumps({
        "deviceIterations": 3, "Training.gradientAccumulation": 2,
        "outputMode": ["OutputMode.EveryN", 5], "Precision.setPartialsType": "torch.float16",
        "setAvailableMemoryProportion": {"IPU0": 0.5}}))
    opts = Options()
    assert (opts.device_iterations, opts.Training.gradient_accumulation) == (3, 2)
    assert (opts.output_mode, opts.output_return_period) == (OutputMode.EveryN, 5)
    assert str(opts.Precision.partials_type) == "torch.float16"
    assert opts.available_memory_proportion == {"IPU0": 0.5}
    assert Options().clone().device_iterations == 3


@pytest.mark.parametrize("value, message", [
    ("{deviceIterations: 3}", "POPTORCH_DEFAULT_OPTIONS is not valid JSON"),
    ("[1, 2]", "POPTORCH_DEFAULT_OPTIONS must hold a JSON object such as"),
    ('{"deviceIteration": 3}', "POPTORCH_DEFAULT_OPTIONS: unknown option 'deviceIteration': "
                               "Options has no option 'deviceIteration'; valid: "),
    ('{"Training.foo": 3}', "POPTORCH_DEFAULT_OPTIONS: unknown option 'Training.foo': "
                            "Training has no option 'foo'; valid: "),
    ('{"Training": 3}', "POPTORCH_DEFAULT_OPTIONS: 'Training' is a group, not a setter; name "
                        "one of "),
    ('{"deviceIterations.x": 3}', "'deviceIterations.x' is not an option: 'deviceIterations' "
                                  "is a setter, not a group"),
    ('{"deviceIterations": 0}', "POPTORCH_DEFAULT_OPTIONS: deviceIterations(0,) was refused: "
                                "deviceIterations: device_iterations must be an int >= 1; got 0"),
])
def test_bad_default_options_name_the_variable(monkeypatch, value, message):
    monkeypatch.setenv("POPTORCH_DEFAULT_OPTIONS", value)
    with pytest.raises(ConfigError, match=re.escape(message)):
        Options()


def test_engine_options_request_profiling(monkeypatch):
    monkeypatch.setenv("POPLAR_ENGINE_OPTIONS", json.dumps(
        {"autoReport.all": "true", "autoReport.directory": "./reports/r50",
         "debug.allowOutOfMemory": "true"}))
    assert Options().profiling_dir == "./reports/r50"


def test_engine_options_default_directory_and_off_switch(monkeypatch):
    monkeypatch.setenv("POPLAR_ENGINE_OPTIONS", '{"autoReport.all": "true"}')
    assert Options().profiling_dir == "./"
    monkeypatch.setenv("POPLAR_ENGINE_OPTIONS", '{"autoReport.all": "false", '
                                                '"autoReport.directory": "x"}')
    assert Options().profiling_dir is None


def test_engine_options_win_over_enable_profiling(monkeypatch, caplog):
    monkeypatch.setenv("POPLAR_ENGINE_OPTIONS", '{"autoReport.all": "true", '
                                                '"autoReport.directory": "env_dir"}')
    with caplog.at_level(logging.WARNING):
        opts = Options().enableProfiling("mine")
    assert opts.profiling_dir == "env_dir"
    assert "POPLAR_ENGINE_OPTIONS (env_dir) overrides enableProfiling('mine')" in caplog.text


def test_bad_engine_options_name_the_variable(monkeypatch):
    monkeypatch.setenv("POPLAR_ENGINE_OPTIONS", "{autoReport.all: true}")
    with pytest.raises(ConfigError, match="POPLAR_ENGINE_OPTIONS is not valid JSON"):
        Options()


def test_distributed_defaults_to_a_single_process():
    assert (Options().Distributed.processId, Options().Distributed.numProcesses) == (0, 1)


def test_distributed_reads_openmpi_then_torchrun(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    opts = Options()
    assert (opts.Distributed.process_id, opts.Distributed.num_processes) == (3, 4)
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    assert (opts.Distributed.process_id, opts.Distributed.num_processes) == (1, 2)


def test_distributed_custom_variable_names(monkeypatch):
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "8")
    monkeypatch.setenv("MY_SIZE", "3")
    monkeypatch.setenv("MY_RANK", "2")
    dist = Options().Distributed.setEnvVarNames("MY_SIZE", "MY_RANK")
    assert (dist.process_id, dist.num_processes) == (2, 3)
    assert dist.toDict()["env_var_names"] == ["MY_SIZE", "MY_RANK"]


def test_configure_process_id_wins_over_environment(monkeypatch):
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "8")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "5")
    opts = Options()
    opts.Distributed.configureProcessId(1, 2).setEnvVarNames("MY_SIZE", "MY_RANK")
    assert (opts.Distributed.processId, opts.Distributed.numProcesses) == (1, 2)
    assert (Options().Distributed.disable().process_id, Options().Distributed.process_id) == (0, 5)


def test_stages_across_processes_read_the_same_data_on_every_process():
    opts = Options()
    opts.Distributed.configureProcessId(1, 2)
    assert opts.Distributed.data_share == (1, 2)  # data parallel: each its own share
    opts.Distributed.stagesAcrossProcesses(True)
    assert opts.Distributed.data_share == (0, 1)  # one pipeline: all the data, on each
    assert opts.Distributed.process_id == 1 and opts.toDict()["Distributed"][
        "stages_across_processes"] is True
    with pytest.raises(TypeError, match="stagesAcrossProcesses: enabled must be True or False"):
        opts.Distributed.stagesAcrossProcesses(1)


@pytest.mark.parametrize("size, rank, message", [
    ("2", "2", "OMPI_COMM_WORLD_RANK=2 and OMPI_COMM_WORLD_SIZE=2 need 0 <= OMPI_COMM_WORLD_RANK "
               "< OMPI_COMM_WORLD_SIZE"),
    ("two", "0", "Environment variable OMPI_COMM_WORLD_SIZE must be an integer; got 'two'"),
    ("0", "0", "need 0 <= OMPI_COMM_WORLD_RANK < OMPI_COMM_WORLD_SIZE"),
])
def test_bad_process_environment_is_explained(monkeypatch, size, rank, message):
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", size)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", rank)
    with pytest.raises(ConfigError, match=re.escape(message)):
        Options().Distributed.process_id


def test_set_env_var_names_checks_the_variables_now(monkeypatch):
    monkeypatch.setenv("MY_SIZE", "2")
    monkeypatch.setenv("MY_RANK", "-1")
    with pytest.raises(ConfigError, match="MY_RANK=-1 and MY_SIZE=2 need 0 <= MY_RANK < MY_SIZE"):
        Options().Distributed.setEnvVarNames("MY_SIZE", "MY_RANK")
