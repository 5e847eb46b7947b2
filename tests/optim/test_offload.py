"""Optimiser state offloaded to host memory: same numbers, pickles, and set by the options."""
import copy
import pickle

import pytest
import torch
import torch.nn as nn

import pipetorch as poptorch
from helpers.models import TinyMLP, data
from pipetorch.optim import scaling
from pipetorch.optim.offload import is_offloaded, offload_state

STEPS = 4


def pair(make):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    other = copy.deepcopy(model)
    return model, make(model.parameters()), other, make(other.parameters())


def train(model, optimizer, steps=STEPS, *, seed=0):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(5, 4, generator=generator), torch.randn(5, 2, generator=generator)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


def assert_equal_weights(model, other):
    for (name, a), (_, b) in zip(model.named_parameters(), other.named_parameters()):
        assert torch.equal(a, b), name


def state_tensors(optimizer):
    return [v for s in optimizer.state.values() for v in s.values()
            if isinstance(v, torch.Tensor) and v.dim()]


MAKERS = {
    "torch.Adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "poptorch.AdamW-fp16-state": lambda p: poptorch.optim.AdamW(
        p, lr=0.01, first_order_momentum_accum_type=torch.float16, loss_scaling=16),
    "torch.SGD-momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
}


@pytest.mark.parametrize("maker", MAKERS)
def test_offloaded_state_gives_identical_weights(maker):
    model, optimizer, other, on_device = pair(MAKERS[maker])
    offload_state(optimizer)
    offload_state(optimizer)  # idempotent: one pair of hooks
    assert is_offloaded(optimizer) and not is_offloaded(on_device)
    assert len(optimizer._optimizer_step_pre_hooks) == 1
    assert len(optimizer._optimizer_step_post_hooks) == 1
    train(model, optimizer)
    train(other, on_device)
    assert_equal_weights(model, other)
    for a, b in zip(state_tensors(optimizer), state_tensors(on_device)):
        assert a.dtype == b.dtype and a.device.type == "cpu" and torch.equal(a, b)


def test_each_step_streams_the_state_in_and_out():
    model, optimizer, *_ = pair(MAKERS["torch.Adam"])
    offload_state(optimizer)
    train(model, optimizer, 1)
    held = state_tensors(optimizer)  # references keep the tensors (and their ids) alive
    inside = []
    optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: inside.extend(state_tensors(opt)))
    train(model, optimizer, 1)
    after = state_tensors(optimizer)
    # A copy each way even on a CPU device: the update never touches the host copy.
    assert len(held) == len(inside) == len(after) == 8  # 4 parameters x 2 moments
    for a, b, c in zip(held, inside, after):
        assert a is not b and b is not c and a.data_ptr() != b.data_ptr() != c.data_ptr()


def test_an_offloaded_optimiser_pickles_and_stays_offloaded():
    model, optimizer, other, on_device = pair(MAKERS["poptorch.AdamW-fp16-state"])
    scaling.enable_automatic_loss_scaling(optimizer)
    scaling.enable_automatic_loss_scaling(on_device)
    offload_state(optimizer)
    train(model, optimizer, 2)
    train(other, on_device, 2)
    # As a stage worker gets it: model and optimiser in one pickle, parameters shared.
    model, optimizer = pickle.loads(pickle.dumps((model, optimizer)))
    assert is_offloaded(optimizer) and type(optimizer).__name__ == "AdamW"
    assert isinstance(optimizer, poptorch.optim.AdamW)
    assert scaling.is_automatic(optimizer)
    assert optimizer.param_groups[0]["params"][0] is model[0].weight
    train(model, optimizer, 2, seed=1)
    train(other, on_device, 2, seed=1)
    assert_equal_weights(model, other)
    copied = copy.deepcopy(optimizer)
    assert is_offloaded(copied) and copied.state is not optimizer.state


def test_the_options_offload_the_device_optimiser():
    torch.manual_seed(0)
    model = TinyMLP()
    other = copy.deepcopy(model)
    opts = poptorch.Options().deviceIterations(2).showCompilationProgressBar(False)
    opts.TensorLocations.setOptimizerLocation(
        poptorch.TensorLocationSettings().useOnChipStorage(False))
    offloaded = poptorch.trainingModel(
        model, opts, optimizer=poptorch.optim.Adam(model.parameters(), lr=0.01))
    plain_opts = poptorch.Options().deviceIterations(2).showCompilationProgressBar(False)
    on_chip = poptorch.trainingModel(
        other, plain_opts, optimizer=poptorch.optim.Adam(other.parameters(), lr=0.01))
    for call in range(3):
        x, y = data(4, seed=call)
        offloaded(x, y)
        on_chip(x, y)
        if call == 1:  # new hyper-parameters reach an offloaded device optimiser
            offloaded.setOptimizer(poptorch.optim.Adam(model.parameters(), lr=0.02))
            on_chip.setOptimizer(poptorch.optim.Adam(other.parameters(), lr=0.02))
    assert is_offloaded(offloaded._compiled.engine.optimizer)
    assert not is_offloaded(on_chip._compiled.engine.optimizer)
    assert_equal_weights(model, other)
    offloaded.destroy()
    on_chip.destroy()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_state_waits_in_pinned_host_memory():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).cuda()
    other = copy.deepcopy(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    on_device = torch.optim.Adam(other.parameters(), lr=0.01)
    offload_state(optimizer)
    inside = []
    optimizer.register_step_pre_hook(  # runs after the offload's own pre-hook
        lambda opt, args, kwargs: inside.append({t.device.type for t in state_tensors(opt)}))
    generator = torch.Generator().manual_seed(0)
    between = []
    for _ in range(STEPS):
        x, y = torch.randn(5, 4, generator=generator), torch.randn(5, 2, generator=generator)
        for m, o in ((model, optimizer), (other, on_device)):
            o.zero_grad()
            nn.functional.mse_loss(m(x.cuda()), y.cuda()).backward()
            o.step()
        between.append({t.device.type for t in state_tensors(optimizer)})
        assert all(t.is_pinned() for t in state_tensors(optimizer))
    assert between == [{"cpu"}] * STEPS
    assert inside == [set()] + [{"cuda"}] * (STEPS - 1)  # no state before the first step
    assert_equal_weights(model, other)


def test_unpickling_an_offloaded_optimiser_neither_pins_nor_asks_cuda(monkeypatch):
    # Issue 29: a stage worker unpickled its offloaded optimiser before set_device, and the
    # unpickling pinned the state: a CUDA context on cuda:0 in every worker.
    model, optimizer, *_ = pair(MAKERS["torch.Adam"])
    offload_state(optimizer)
    train(model, optimizer, 1)
    pickled = pickle.dumps(optimizer)
    calls = []
    real_empty_like = torch.empty_like

    def empty_like(*args, pin_memory=False, **kwargs):  # a CPU-only torch cannot pin
        calls.append(f"empty_like(pin_memory={pin_memory})")
        return real_empty_like(*args, **kwargs)

    def is_available():
        calls.append("cuda.is_available")
        return True

    monkeypatch.setattr(torch, "empty_like", empty_like)
    monkeypatch.setattr(torch.cuda, "is_available", is_available)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a: calls.append("pin_memory"))
    copy = pickle.loads(pickled)
    assert is_offloaded(copy) and calls == []
    params = [p for group in copy.param_groups for p in group["params"]]
    for param in params:
        param.grad = torch.ones_like(param)
    copy.step()  # the first step's post-hook pins, once CUDA is the worker's
    assert "empty_like(pin_memory=True)" in calls
