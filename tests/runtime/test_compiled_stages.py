"""Stages run through torch.compile compute what the eager stages compute."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch.testing import assert_close

import pipetorch as poptorch
from helpers.models import MnistNetwork, WithLoss, mnist_data
from pipetorch.errors import ConfigError
from pipetorch.partition.split import split_stages
from pipetorch.partition.strategies import StageSpec
from pipetorch.parallel.worker.compiled import CompiledStage
from pipetorch.runtime.config import run_config
from pipetorch.parallel.worker.recompute import original_module

STAGES = [StageSpec(0, 0, ("B1", "B2")), StageSpec(1, 1, ("B3", "B4"))]


def run_stages(stages, x, y):
    """Forward through both stages and backward; the loss, outputs and input gradient."""
    x = x.clone().requires_grad_(True)
    (h,) = stages[0](x)
    out, loss = stages[1](h, y)
    loss.backward()
    return out.detach(), loss.detach(), x.grad


@pytest.mark.parametrize("backend", [
    pytest.param("inductor", marks=[pytest.mark.slow, pytest.mark.timeout(900)]),  # C++ builds
    "aot_eager",
])
def test_compiled_stages_equal_the_eager_stages(backend):
    torch.manual_seed(0)
    eager_model = WithLoss(MnistNetwork())
    compiled_model = copy.deepcopy(eager_model)
    x, y = mnist_data(8)
    eager = split_stages(eager_model, (x,), {"labels": y}, STAGES).modules
    # Each stage is pickled to its worker: the compiled wrapper travels as stage + backend.
    compiled = [pickle.loads(pickle.dumps(CompiledStage(m, backend)))
                for m in split_stages(compiled_model, (x,), {"labels": y}, STAGES).modules]
    assert [type(m) for m in compiled] == [CompiledStage] * 2
    assert [n for n, _ in compiled[1].named_parameters()] == \
        [n for n, _ in eager[1].named_parameters()]
    for step in range(2):
        got, want = run_stages(compiled, x, y), run_stages(eager, x, y)
        assert_close(got, want, rtol=1e-4, atol=1e-5)
    for stage, reference in zip(compiled, eager):  # the unpickled stages' own weights
        for (name, p), (_, q) in zip(reference.named_parameters(), stage.named_parameters()):
            assert q.grad is not None and p.grad is not None, name
            assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=name)
    assert isinstance(original_module(compiled[0]), torch.fx.GraphModule)


def compile_backend(options: poptorch.Options) -> str | None:
    return run_config(options).compile_backend


def test_the_switch_reads_the_option_then_the_environment(monkeypatch):
    monkeypatch.delenv("PIPETORCH_COMPILE", raising=False)
    assert compile_backend(poptorch.Options()) is None
    assert compile_backend(_with_jit(backend="aot_eager")) == "aot_eager"
    monkeypatch.setenv("PIPETORCH_COMPILE", "1")
    assert compile_backend(poptorch.Options()) == "inductor"
    monkeypatch.setenv("PIPETORCH_COMPILE", "no-such-backend")
    with pytest.raises(ConfigError, match="PIPETORCH_COMPILE='no-such-backend' names no"):
        compile_backend(poptorch.Options())


def _with_jit(**kwargs) -> poptorch.Options:
    opts = poptorch.Options()
    opts.Jit.compileStages(True, **kwargs)
    return opts


@pytest.mark.slow
def test_compiled_stages_in_workers_train_like_plain_pytorch(request, monkeypatch):
    monkeypatch.setenv("PIPETORCH_THREADS_PER_DEVICE", "1")
    torch.manual_seed(0)
    model = WithLoss(MnistNetwork())
    plain = copy.deepcopy(model)
    D, G, B = 2, 3, 4
    x, y = mnist_data(D * G * B)
    opts = _with_jit(backend="aot_eager").deviceIterations(D)
    opts.Training.gradientAccumulation(G)
    opts.outputMode(poptorch.OutputMode.All)
    opts.setExecutionStrategy(poptorch.PipelinedExecution(
        poptorch.Stage("B1", "B2").ipu(0), poptorch.Stage("B3", "B4").ipu(1)))
    wrapper = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    request.addfinalizer(wrapper.destroy)
    _, losses = wrapper(x, y)
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    want = []
    for d in range(D):
        optimizer.zero_grad()
        for g in range(G):
            i = (d * G + g) * B
            _, loss = plain(x[i:i + B], y[i:i + B])
            (loss / G).backward()
            want.append(loss.detach())
        optimizer.step()
    assert_close(losses, torch.stack(want), rtol=1e-4, atol=1e-5)
    wrapper.copyWeightsToHost()
    for (name, p), (_, q) in zip(plain.named_parameters(), model.named_parameters()):
        assert_close(q, p, rtol=1e-4, atol=1e-5, msg=name)
