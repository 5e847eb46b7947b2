"""A 16-bit model's step holds float32 copies of one bucket of parameters at a time."""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import pipetorch as poptorch
from pipetorch.optim import swap_buckets

LAYERS, WIDTH = 16, 64


class _LiveBytes(TorchDispatchMode):
    """Bytes of the storages that ops under the mode create (not their inputs' storages, which
    in-place ops and views return) and that are alive, polled after every op; `peak` is the
    most seen at once."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {value.untyped_storage().data_ptr() for value in tree_leaves((args, kwargs))
                  if isinstance(value, torch.Tensor)}
        for value in tree_leaves(out):
            if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() not in inputs:
                storage = value.untyped_storage()
                key = storage.data_ptr()
                if key not in self.storages or self.storages[key][0].expired():
                    self.storages[key] = (StorageWeakRef(storage), storage.nbytes())
        live = {k: v for k, v in self.storages.items() if not v[0].expired()}
        self.storages = live
        self.peak = max(self.peak, sum(size for _, size in live.values()))
        return out


def _model_and_optimizer(**options: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)]).half()
    return model, poptorch.optim.AdamW(model.parameters(), lr=1e-2, **options)


def _backward(model: nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    model.zero_grad()
    model(torch.randn(4, WIDTH, generator=generator).half()).float().pow(2).mean().backward()


def _step_peak(limit: int) -> int:
    """Peak bytes a step allocates beyond what it keeps, with buckets of `limit` bytes."""
    model, optimizer = _model_and_optimizer()
    _backward(model, 0)
    optimizer.step()  # the first step creates the state, which every later step keeps
    _backward(model, 1)
    tracker = _LiveBytes()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(swap_buckets, "BUCKET_BYTES", limit)
        with tracker:
            optimizer.step()
    return tracker.peak


def test_a_float16_steps_extra_memory_is_bounded_by_a_bucket_not_the_model():
    # Issue 29: the step made float32 copies of every parameter and gradient at once
    # (+8 bytes per parameter of the stage).
    layer = swap_buckets.working_bytes(torch.empty(WIDTH, WIDTH)) + \
        swap_buckets.working_bytes(torch.empty(WIDTH))
    whole = _step_peak(10 * layer * LAYERS)  # one bucket: as before bucketing
    bucketed = _step_peak(layer)  # a layer per bucket
    # float32 parameter and gradient copies (2 layers' working bytes) plus AdamW's temporaries
    # for one tensor (about 4 layers in all with torch 2.13): a few layers, whatever the depth.
    assert bucketed <= 6 * layer, (bucketed, layer)
    assert bucketed * 4 < whole, (bucketed, whole)


@pytest.mark.parametrize("options", [{}, dict(loss_scaling=64.0, max_grad_norm=0.05)],
                         ids=["plain", "scaled-clipped"])
def test_bucketed_steps_match_one_bucket_bit_for_bit(options):
    results = []
    for limit in (1, 2**40):  # every parameter alone; everything in one bucket
        model, optimizer = _model_and_optimizer(**options)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(swap_buckets, "BUCKET_BYTES", limit)
            for seed in range(3):
                _backward(model, seed)
                if options:
                    for param in model.parameters():
                        param.grad.mul_(64.0)
                optimizer.step()
        results.append((copy.deepcopy(model.state_dict()), optimizer.state_dict()["state"]))
    (weights, state), (one_weights, one_state) = results
    for name in weights:
        assert torch.equal(weights[name], one_weights[name]), name
    for index in state:
        for key in state[index]:
            assert torch.equal(state[index][key], one_state[index][key]), (index, key)


def test_split_keeps_order_groups_and_a_large_parameter_alone():
    small, large = torch.zeros(2, dtype=torch.half), torch.zeros(10, dtype=torch.half)
    groups = [{"params": [small, small, large, small]}, {"params": [small]}]
    buckets = swap_buckets.split(groups, limit=16)  # two small parameters' float32 bytes
    assert [(b.group, [p.numel() for p in b.params]) for b in buckets] == [
        (0, [2, 2]), (0, [10]), (0, [2]), (1, [2])]


def test_step_hooks_run_once_per_step_whatever_the_buckets():
    # torch wraps a class's step() to run the instance's hooks once any plain instance of it
    # exists; the update inside step() ran them again, and would have once per bucket
    # (moving an offloaded state in and out for each).
    torch.optim.AdamW([nn.Parameter(torch.zeros(1))])  # hooks torch.optim.AdamW.step
    model, optimizer = _model_and_optimizer()
    calls = []
    optimizer.register_step_pre_hook(lambda *_: calls.append("pre"))
    optimizer.register_step_post_hook(lambda *_: calls.append("post"))
    _backward(model, 0)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(swap_buckets, "BUCKET_BYTES", 1)
        optimizer.step()
    assert calls == ["pre", "post"]
