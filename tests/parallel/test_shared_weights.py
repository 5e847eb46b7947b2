"""CPU workers train the host copy's weights in place (weights.shared): the weights are
in memory once, and every PopTorch rule of the host copy holds as with copies."""
import copy
import os
import signal
import threading

import pytest
import torch
import torch.nn as nn
from torch.testing import assert_close

import pipetorch as poptorch
from fault_cases import registry  # noqa: F401 - the fixture
from fault_cases import (LONG_D, LONG_DEPTH, HeavyNet, heavy_data, options, shm_entries,
                         wait_busy, wait_gone)
from pipetorch.errors import DeviceError
from pipetorch.weights import mapped
from pipetorch.weights.shared import SharedWeights


def _regions(model: nn.Module) -> list:
    return [mapped.region_of(p.untyped_storage()) for p in model.parameters()]


# -- the file and its regions, in this process ------------------------------------------------
def test_write_moves_each_storage_once_and_keeps_the_tensor_objects():
    torch.manual_seed(0)
    layer = nn.Linear(300, 7)
    tied = nn.ModuleList([layer, layer])
    before = {n: p.detach().clone() for n, p in layer.named_parameters()}
    params = list(tied.parameters()) + [layer.weight]  # twice: one region
    objects = [id(p) for p in layer.parameters()]
    shared = SharedWeights.write(params)
    assert shared is not None
    try:
        assert [id(p) for p in layer.parameters()] == objects
        for name, param in layer.named_parameters():
            assert_close(param, before[name])
            region = mapped.region_of(param.untyped_storage())
            assert region is not None and region.live and region.offset % 4096 == 0
        assert len(shared.pointers) == 2
        assert os.path.getsize(shared.path) == 12288 + 4096  # 8400 and 28 bytes, aligned
    finally:
        shared.close()
    assert not os.path.exists(shared.path)  # the descriptor is closed ...
    assert_close(layer.weight, before["weight"])  # ... and the mapping keeps the memory


def test_a_host_edit_is_private_and_refresh_shows_the_file_again():
    weight = nn.Parameter(torch.arange(2048, dtype=torch.float32))
    shared = SharedWeights.write([weight])
    try:
        region = mapped.region_of(weight.untyped_storage())
        worker = mapped.map_region(region, shared=True).view(torch.float32)  # as a worker maps
        assert mapped.travels_as(weight.untyped_storage()) is None  # the host's own: its bytes
        assert mapped.travels_as(weight.untyped_storage(), {weight.data_ptr()}) == (
            "shared", region)
        worker.add_(1.0)  # a worker's step writes the file ...
        assert_close(weight.detach(), torch.arange(2048, dtype=torch.float32) + 1)  # ... seen
        with torch.no_grad():
            weight.mul_(0.0)  # an edit on the host copies the page: the worker never sees it
        assert worker[5] == 6.0 and weight[5] == 0.0
        arrived = torch.empty(0).set_(mapped.load("mapped", region))
        assert mapped.same_bytes(weight, arrived)
        mapped.refresh(weight)  # a copy to the host: the file's bytes again, none moved
        assert_close(weight.detach(), worker)
    finally:
        shared.close()


def test_a_weights_file_tensor_edited_on_the_host_travels_as_its_bytes(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    path = str(tmp_path / "w.safetensors")
    safetensors.save_file({"w": torch.ones(4096)}, path)
    tensor = mapped.SafetensorsFile(path).tensor("w")
    assert mapped.travels_as(tensor.untyped_storage()) is not None  # the file holds its bytes
    tensor[0] = 5.0
    assert mapped.travels_as(tensor.untyped_storage()) is None  # it no longer does


# -- training ---------------------------------------------------------------------------------
class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = poptorch.BeginBlock(nn.Linear(32, 32), ipu_id=0)
        self.b = poptorch.BeginBlock(nn.Linear(32, 32), ipu_id=1)

    def forward(self, x, y):
        out = self.b(torch.relu(self.a(x)))
        return out, nn.functional.mse_loss(out, y)


def _train(monkeypatch, request, setting: str, calls: int = 3, dtype=torch.float32):
    monkeypatch.setenv("PIPETORCH_SHARED_WEIGHTS", setting)
    torch.manual_seed(0)
    model = Net().to(dtype)
    optimizer = (torch.optim.Adam(model.parameters(), lr=0.01) if dtype == torch.float32 else
                 poptorch.optim.AdamW(model.parameters(), lr=0.01, loss_scaling=64.0))
    wrapper = poptorch.trainingModel(model, options(G=4), optimizer=optimizer)
    request.addfinalizer(wrapper.destroy)
    data = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(calls):
        x, y = torch.randn(8, 32, generator=data), torch.randn(8, 32, generator=data)
        losses.append(wrapper(x.to(dtype), y.to(dtype))[1])
    return model, wrapper, optimizer, losses


@pytest.mark.slow
def test_a_half_model_on_shared_weights_equals_separate_copies_and_stays_finite(monkeypatch,
                                                                               request):
    # a 16-bit step swaps weights to float32 bucket by bucket: the swap must come back into
    # the shared pages, and the float32 moments must not drift
    model, _, optimizer, losses = _train(monkeypatch, request, "1", calls=4,
                                         dtype=torch.float16)
    apart, _, apart_optimizer, apart_losses = _train(monkeypatch, request, "0", calls=4,
                                                     dtype=torch.float16)
    assert all(r is not None and r.live for r in _regions(model))
    assert all(mapped.unmodified(p.untyped_storage()) for p in model.parameters())
    assert_close(losses, apart_losses, rtol=0, atol=0)
    torch.manual_seed(0)
    start = Net().to(torch.float16)
    assert not torch.equal(model.a.weight, start.a.weight)  # four real steps moved it
    for mine, theirs in zip(model.parameters(), apart.parameters()):
        assert mine.dtype == torch.float16 and torch.isfinite(mine).all()
        assert_close(mine, theirs, rtol=0, atol=0)
    for key, state in optimizer.state_dict()["state"].items():
        for name, value in state.items():
            if isinstance(value, torch.Tensor):
                assert torch.isfinite(value).all(), (key, name)
                assert_close(value, apart_optimizer.state_dict()["state"][key][name],
                             rtol=0, atol=0)


@pytest.mark.slow
def test_training_on_shared_weights_equals_separate_copies(monkeypatch, request):
    before = shm_entries()
    model, wrapper, optimizer, losses = _train(monkeypatch, request, "1")
    assert all(r is not None and r.live for r in _regions(model))
    # the copy to the host moved no bytes: the host's pages are the file's, none its own
    assert all(mapped.unmodified(p.untyped_storage()) for p in model.parameters())
    assert not [e for e in shm_entries() - before if "weights" in e]  # a memfd: no name
    apart, _, apart_optimizer, apart_losses = _train(monkeypatch, request, "0")
    assert all(r is None for r in _regions(apart))
    assert_close(losses, apart_losses, rtol=0, atol=0)
    for mine, theirs in zip(model.parameters(), apart.parameters()):
        assert_close(mine, theirs, rtol=0, atol=0)
    state, apart_state = optimizer.state_dict()["state"], apart_optimizer.state_dict()["state"]
    for key in state:
        assert_close(state[key]["exp_avg_sq"], apart_state[key]["exp_avg_sq"], rtol=0, atol=0)
    # a host edit stays on the host until copyWeightsToDevice ...
    x, y = torch.ones(8, 32), torch.zeros(8, 32)

    def host_loss():
        with torch.no_grad():
            return nn.functional.mse_loss(model.b(torch.relu(model.a(x))), y)

    device_weights = host_loss()
    with torch.no_grad():
        model.a.weight.fill_(0.0)
    losses = wrapper(x, y)[1]  # one per micro-batch, all before the call's own step
    assert_close(losses, device_weights.expand_as(losses))
    assert model.a.weight.abs().sum() > 0  # the call's weights replaced the edit
    with torch.no_grad():
        model.a.weight.fill_(0.0)
    edited = host_loss()
    wrapper.copyWeightsToDevice()  # ... which sends it
    losses = wrapper(x, y)[1]
    assert_close(losses, edited.expand_as(losses))


@pytest.mark.slow
def test_a_worker_killed_in_the_first_call_leaves_the_weights_of_the_start(registry):
    torch.manual_seed(0)
    model = HeavyNet(depth=LONG_DEPTH)
    start = copy.deepcopy(model.state_dict())
    wrapper = poptorch.trainingModel(model, options(D=LONG_D, G=4),
                                     optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        x, y = heavy_data(LONG_D * 4 * 32)  # 100 optimiser steps in one call
        wrapper.compile(x, y)
        host_copy = wrapper._compiled.engine.model  # Block scopes: a copy, known when compiled
        assert all(r is not None and r.live for r in _regions(host_copy))
        pids = list(wrapper._compiled.engine.worker_pids)
        failed = []

        def call():
            try:
                wrapper(x, y)
            except DeviceError as exc:
                failed.append(exc)

        thread = threading.Thread(target=call)
        thread.start()
        wait_busy(pids[1])
        os.kill(pids[1], signal.SIGKILL)
        thread.join(30.0)
        assert failed and not thread.is_alive()
        assert wait_gone(pids) == []
        for name, value in model.state_dict().items():
            assert_close(value, start[name], rtol=0, atol=0, msg=name)
    finally:
        wrapper.destroy()
