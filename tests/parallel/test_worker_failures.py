"""A worker that fails, at start-up too, names its cause to the user: its exception's type and
message, or the signal that ended it, and the out-of-memory killer only with its evidence."""
from __future__ import annotations

import importlib
import os
import re
import signal
import sys

import pytest
import torch
from safetensors.torch import save_file

import pipetorch as poptorch
from pipetorch.errors import DeviceError
from pipetorch.parallel.comm import exits
from fault_cases import wait_gone

# Issue 37: any start-up exception in a worker (a class it could not unpickle, a weights file
# gone) reached the user as "died ... (exit code 1). Running out of memory or a kill signal are
# the usual causes", its real error only on the worker's stderr.


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)

    def forward(self, x, y):
        out = self.b(torch.tanh(self.a(x)))
        return out, torch.nn.functional.mse_loss(out, y)


def split(model: Net) -> Net:
    model.b = poptorch.BeginBlock(model.b, ipu_id=1)
    return model


def options() -> poptorch.Options:
    opts = poptorch.Options().showCompilationProgressBar(False)
    opts.Training.gradientAccumulation(4)
    return opts


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)


@pytest.mark.slow
def test_a_class_the_workers_cannot_import_is_named_with_its_error(tmp_path, monkeypatch,
                                                                   caplog):
    # an optimiser class from a module on the host's import path only (its file then removed)
    (tmp_path / "host_only_optim.py").write_text(
        "import torch\nclass HostOnlySGD(torch.optim.SGD):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("host_only_optim")
    monkeypatch.setitem(sys.modules, "host_only_optim", module)
    os.remove(tmp_path / "host_only_optim.py")
    model = split(Net())
    wrapper = poptorch.trainingModel(model, options(),
                                     optimizer=module.HostOnlySGD(model.parameters(), lr=0.1))
    try:
        with pytest.raises(DeviceError) as info:
            wrapper(*data())
        head = str(info.value).splitlines()[0]
        assert "ModuleNotFoundError: No module named 'host_only_optim'" in head, head
        assert head.startswith("Stage 0 on cpu (pid ") or head.startswith("Stage 1 on cpu"), head
        assert "memory" not in str(info.value) and "signal" not in str(info.value)
        # no call ran: nothing to restore, and no warning that a call's state was not saved
        assert "was not saved" not in caplog.text
    finally:
        wrapper.destroy()


@pytest.mark.slow
def test_a_weights_file_deleted_before_the_first_call_is_named(tmp_path):
    torch.manual_seed(0)
    path = tmp_path / "w.safetensors"
    save_file(Net().state_dict(), str(path))
    with poptorch.empty_weights():
        model = split(Net())
    poptorch.map_weights(model, path)
    wrapper = poptorch.inferenceModel(model, poptorch.Options().deviceIterations(2).showCompilationProgressBar(False))
    os.remove(path)
    try:
        with pytest.raises(DeviceError) as info:
            wrapper(*data())
        head = str(info.value).splitlines()[0]
        assert "FileNotFoundError" in head and str(path) in head, head
        assert "memory" not in str(info.value)
    finally:
        wrapper.destroy()


@pytest.mark.slow
@pytest.mark.parametrize("sent", [signal.SIGTERM, signal.SIGKILL])
def test_a_worker_ended_by_a_signal_is_named_and_not_blamed_on_memory(sent):
    torch.manual_seed(0)
    wrapper = poptorch.inferenceModel(split(Net()),
                                      poptorch.Options().deviceIterations(2).showCompilationProgressBar(False))
    try:
        x, y = data()
        wrapper(x, y)
        pid = wrapper._compiled.engine.worker_pids[1]
        before = exits.oom_kills()
        os.kill(pid, sent)
        assert wait_gone([pid]) == []
        with pytest.raises(DeviceError) as info:
            wrapper(x, y)
        message = str(info.value)
        # (found sending the call, or waiting for its reply)
        assert re.search(rf"\(pid {pid}\) died (during an inference call )?\(exit code "
                         rf"-{int(sent)}, killed by {sent.name}\)\. ", message), message
        if sent == signal.SIGTERM:
            assert "Another process or a user sent it SIGTERM" in message, message
        elif before is not None and exits.oom_kills() == before:  # no OOM kill meanwhile
            assert "No out-of-memory kill happened since it started" in message, message
    finally:
        wrapper.destroy()


def test_exit_statuses_in_words():
    assert exits.status(1) == "exit code 1"
    assert exits.status(-9) == "exit code -9, killed by SIGKILL"
    one = exits.cause(1, 0, 0)
    assert "standard error" in one and "memory" not in one and "signal" not in one
    assert exits.cause(-9, 3, 4).startswith("The kernel's out-of-memory killer ended it (its "
                                            "count of kills rose from 3 to 4")
    assert exits.cause(-9, 3, 3).startswith("No out-of-memory kill happened")
    assert "does not report" in exits.cause(-9, None, None) or exits.oom_kills() is not None
    assert exits.cause(-15, 3, 4) == "Another process or a user sent it SIGTERM"
    assert exits.cause(-11, 0, 0).startswith("It crashed (SIGSEGV)")
