"""Issue 54: the DEBUG lines PopTorch's tests (and scripts) read back: the options its core
receives, whether the stages pipeline and where each op runs, the asynchronous loader's
worker pid; printed with lower-case level names, POPTORCH_LOG_LEVEL honoured on import."""
import logging
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import pipetorch as poptorch
from pipetorch import log_level


@pytest.fixture(autouse=True)
def _fresh_repeat_counts(monkeypatch):
    monkeypatch.setattr(log_level._repeat_filter, "_last", None)


def _messages(caplog):
    return [r.getMessage() for r in caplog.records]


def test_validate_options_logs_each_popart_option_as_poptorchs_core(caplog):
    # PopTorch's test_set_popart_options reads these lines after _validateOptions
    opts = poptorch.Options()
    opts._Popart.set("dotChecks", ["FINAL", "ALL"])
    opts._Popart.set("engineOptions", {"debug.allowOutOfMemory": "true"})
    opts._Popart.set("enableOutlining", True)
    with caplog.at_level(logging.DEBUG, logger="pipetorch.options"):
        poptorch.poptorch_core._validateOptions(opts.toDict())
    lines = _messages(caplog)
    assert "poptorch.Options added FINAL to dotChecks" in lines
    assert "poptorch.Options set engineOptions[debug.allowOutOfMemory] to true" in lines
    assert "poptorch.Options set enableOutlining to value true" in lines


def test_compiling_logs_the_options_the_model_runs_with(caplog):
    # an options file's settings were invisible: PopTorch logs them as its core reads them
    opts = poptorch.Options().deviceIterations(2).enableSyntheticData(True)
    opts.setExecutionStrategy(poptorch.ShardedExecution())
    wrapped = poptorch.inferenceModel(nn.Linear(3, 3), opts)
    with caplog.at_level(logging.DEBUG, logger="pipetorch"):
        wrapped.compile(torch.ones(2, 3))
    lines = _messages(caplog)
    for line in ("device_iterations to value 2", "replication_factor to value 1",
                 "execution_mode to value 1", "syntheticDataMode to value 2"):
        assert f"poptorch.Options set {line}" in lines
    wrapped.destroy()


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.l0, self.l1, self.l2 = nn.ReLU(), nn.ReLU(), nn.ReLU()

    def forward(self, x):
        return self.l2(self.l1(self.l0(x)) * 2) * 3


def _placement(caplog, model, x):
    wrapped = poptorch.inferenceModel(model, poptorch.Options().deviceIterations(2))
    with caplog.at_level(logging.DEBUG, logger="pipetorch.partition.lowering"):
        wrapped.compile(x)
    wrapped.destroy()
    return [m for m in _messages(caplog) if "mode(" in m or "enablePipelining" in m]


def test_each_op_is_logged_with_its_scope_device_and_stage_on_one_device(caplog):
    # PopTorch's pipelining tests read " l1/Relu:0 " ... " mode(Pipelined), ipu(0), stage(0)"
    lines = _placement(caplog, Scaled(), torch.randn(2, 4))
    assert lines[0] == "Popart option enablePipelining set to value 0"
    assert [line.split(" : ")[0] for line in lines[1:]] == [
        "Lowered op l0/Relu:0", "Lowered op l1/Relu:0", "Lowered op Mul:0",
        "Lowered op l2/Relu:0", "Lowered op Mul:0/1"]
    assert all(line.endswith(" mode(Pipelined), ipu(0), stage(0)") for line in lines[1:])


def test_blocks_on_two_devices_pipeline_and_place_their_ops(caplog):
    # the ops before the first BeginBlock run on device 0, the block's on its ipu_id
    model = Scaled()
    poptorch.BeginBlock(model.l1, ipu_id=1)
    lines = _placement(caplog, model, torch.randn(2, 4))
    assert lines[0] == "Popart option enablePipelining set to value 1"
    assert "Lowered op l0/Relu:0 : mode(Pipelined), ipu(0), stage(0)" in lines
    assert "Lowered op l2/Relu:0 : mode(Pipelined), ipu(1), stage(1)" in lines


def test_log_lines_name_the_level_in_lower_case_and_the_environment_sets_it():
    # PopTorch prints "[debug]"; POPTORCH_LOG_LEVEL was read only once setLogLevel was imported
    script = ("import logging, pipetorch\n"
              "logging.getLogger('pipetorch.x').debug('seen')\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120, env={**os.environ, "POPTORCH_LOG_LEVEL": "DEBUG"})
    assert result.returncode == 0, result.stderr
    assert "[pipetorch.x] [debug] seen" in result.stderr


class Ones(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, index):
        return torch.ones(2)


def test_the_asynchronous_loader_logs_its_worker_pid_in_poptorchs_words(caplog):
    # PopTorch's KeyboardInterrupt test finds the worker to signal from this line
    with caplog.at_level(logging.DEBUG, logger="pipetorch.data"):
        loader = poptorch.DataLoader(poptorch.Options(), Ones(), batch_size=2,
                                     mode=poptorch.DataLoaderMode.Async)
        assert len(list(loader)) == 4
    pid = loader._accessor.pid
    assert any(m.startswith(f"AsynchronousDataAccessor worker process: {pid}")
               for m in _messages(caplog))
    loader.terminate()
