"""Replicated tensor sharding of optimiser state over replicas: the numbers of plain PyTorch."""
import glob
import math
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.testing import assert_close

import pipetorch as poptorch
from parallel_cases import assert_same_result, cleaned, one_thread_everywhere, plain_call
from pipetorch.weights import snapshot
from pipetorch.parallel.worker.sharded_step import runs, slice_of

R, G, B, CALLS = 2, 4, 2, 3
MIN_ELEMENTS = 100  # a's weight and bias and b's weight are sliced; b's bias (5) is whole


@pytest.fixture(autouse=True)
def _one_thread(request, monkeypatch):
    one_thread_everywhere(request, monkeypatch)


class Net(nn.Module):
    """Two stages; odd sizes, so the last replica's slices end in padding."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(63, 201), nn.Linear(201, 5)

    def forward(self, x, labels):
        with poptorch.Block("A", ipu_id=0):
            h = torch.tanh(self.a(x))
        with poptorch.Block("B", ipu_id=1):
            out = self.b(h)
            return out, F.cross_entropy(out, labels)


def data(call):
    g = torch.Generator().manual_seed(call)
    return torch.randn(R * G * B, 63, generator=g), torch.randint(0, 5, (R * G * B,), generator=g)


def options(*, sharded, replicas=R, offload=False, anchor=False, automatic=False):
    """R x G micro-batches per step: G * R // replicas accumulated on each replica."""
    opts = poptorch.Options().replicationFactor(replicas).showCompilationProgressBar(False)
    opts.Training.gradientAccumulation(G * R // replicas)
    opts.outputMode(poptorch.OutputMode.All)
    location = poptorch.TensorLocationSettings().useReplicatedTensorSharding(sharded)
    location.minElementsForReplicatedTensorSharding(MIN_ELEMENTS)
    if offload:
        location.useOnChipStorage(False)
    opts.TensorLocations.setOptimizerLocation(location)
    if anchor:
        opts.anchorTensor("grad", "Gradient___a.weight")
    if automatic:
        opts.Training.setAutomaticLossScaling(True)
    return opts


def model_pair():
    torch.manual_seed(0)
    model = Net()
    plain = Net()
    plain.load_state_dict(model.state_dict())
    return model, plain


def train(request, make, *, sharded=True, offload=False, plain_make=None, calls=CALLS,
          anchor=False, automatic=False):
    """`calls` calls of a 2-stage x 2-replica wrapper and of plain PyTorch (`plain_make`, or
    `make` itself) on the same batches, each call's losses compared; the two models after."""
    model, plain = model_pair()
    optimizer = make(model.parameters())
    wrapper = cleaned(request, poptorch.trainingModel(
        model, options(sharded=sharded, offload=offload, anchor=anchor, automatic=automatic),
        optimizer=optimizer))
    plain_optimizer = (plain_make or make)(plain.parameters())
    for call in range(calls):
        batch = data(call)
        want = plain_call(plain, plain_optimizer, batch, D=1, G=G, R=R)
        assert_same_result(wrapper(*batch), want, what=f"call {call}")
    for name, param in plain.named_parameters():
        assert_close(model.get_parameter(name), param, msg=lambda m, name=name: f"{name}: {m}")
    return wrapper, model, optimizer, plain, plain_optimizer


def adamw(params):
    return poptorch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


@pytest.mark.slow
def test_adamw_with_weight_decay_matches_the_unsharded_run_and_plain_pytorch(
        request, monkeypatch):
    monkeypatch.setenv("PIPETORCH_SNAPSHOTS", "1")
    wrapper, model, optimizer, plain, plain_optimizer = train(
        request, adamw, plain_make=lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
        anchor=True)
    # the anchored gradient is whole: each replica summed only its slice
    assert_close(wrapper.getAnchoredTensor("grad"), plain.a.weight.grad)
    _, unsharded, _, _, _ = train(request, adamw, sharded=False)
    for name, param in unsharded.named_parameters():
        assert_close(model.get_parameter(name), param)
    # each replica's snapshot holds its slices only: half of a's moments, the padding dropped
    folder = wrapper._compiled.engine.workers.folder
    part = glob.glob(os.path.join(folder, "stage0-*.r1.pt"))
    assert part, os.listdir(folder)
    _, (weights, states, attributes) = torch.load(part[0], weights_only=False)
    assert not weights and attributes["sliced"] == ["a.weight", "a.bias"]
    assert states["a.weight"]["exp_avg"].numel() == 201 * 63 - math.ceil(201 * 63 / 2)
    # the host sees whole moments, equal to plain PyTorch's
    state = optimizer.state_dict()
    want = plain_optimizer.state_dict()["state"]
    for index, moments in want.items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert state["state"][index][key].shape == moments[key].shape
            assert_close(state["state"][index][key], moments[key])
    assert state["ipu_state"]["Accl1___model.a.weight"].shape == (201, 63)
    assert_close(state["ipu_state"]["Accl2___model.a.weight"], want[0]["exp_avg_sq"])


@pytest.mark.slow
@pytest.mark.parametrize("make, plain_make", [
    pytest.param(lambda p: poptorch.optim.SGD(p, lr=0.05, momentum=0.9),
                 lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), id="SGD-momentum"),
    pytest.param(lambda p: poptorch.optim.Adam(p, lr=0.01),
                 lambda p: torch.optim.Adam(p, lr=0.01), id="Adam"),
    pytest.param(lambda p: poptorch.optim.RMSprop(p, lr=1e-4, momentum=0.5, centered=True),
                 lambda p: torch.optim.RMSprop(p, lr=1e-4, momentum=0.5, centered=True),
                 id="RMSprop-centered"),
    pytest.param(lambda p: poptorch.optim.LAMB(p, lr=0.01, weight_decay=0.1), None, id="LAMB"),
])
def test_each_optimiser_matches_plain_pytorch(request, make, plain_make):
    # LAMB has no torch twin: the plain loop steps pipetorch's LAMB (tested against its
    # formula in tests/optim) on whole weights, so per-weight norms summed over slices count
    train(request, make, plain_make=plain_make)


@pytest.mark.slow
def test_clipping_takes_the_global_norm_over_the_slices(request):
    def clipped(params):  # plain PyTorch's clip_grad_norm_ before each step
        params = list(params)
        optimizer = torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)
        step = optimizer.step

        def clip_then_step(*args, **kwargs):
            norm = torch.nn.utils.clip_grad_norm_(params, 0.05)
            assert norm > 0.05  # the clipping acts
            return step(*args, **kwargs)

        optimizer.step = clip_then_step
        return optimizer

    train(request, lambda p: poptorch.optim.AdamW(p, lr=0.01, weight_decay=0.1,
                                                   max_grad_norm=0.05), plain_make=clipped)


@pytest.mark.slow
@pytest.mark.parametrize("automatic", [False, True], ids=["static-offloaded", "automatic"])
def test_loss_scaling_matches_plain_pytorch(request, automatic):
    # static: with the slices' state offloaded to host memory too; automatic: the overflow
    # count summed over every worker's slices, the gradients un-scaled by the dynamic scale
    train(request, lambda p: poptorch.optim.AdamW(p, lr=0.01, loss_scaling=128.0),
          plain_make=lambda p: torch.optim.AdamW(p, lr=0.01), offload=not automatic,
          automatic=automatic)


@pytest.mark.slow
def test_a_checkpoint_resumes_into_another_replica_count(request):
    # sharded over 2 replicas -> 1 replica (whole state) -> sharded again: every move reads
    # whole moments from optimizer.state_dict() and loads them into the next wrapper
    model, plain = model_pair()
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=0.01)
    checkpoint = None
    for call, (sharded, replicas) in enumerate([(True, 2), (False, 1), (True, 2)]):
        optimizer = poptorch.optim.AdamW(model.parameters(), lr=0.01)
        if checkpoint is not None:
            optimizer.load_state_dict(checkpoint)
        wrapper = poptorch.trainingModel(model, options(sharded=sharded, replicas=replicas),
                                         optimizer=optimizer)
        x, labels = data(call)
        want = plain_call(plain, plain_optimizer, (x, labels), D=1, G=G * R // replicas,
                          R=replicas)
        assert_same_result(wrapper(x, labels), want, what=f"call {call}")
        checkpoint = optimizer.state_dict()
        wrapper.destroy()
    for name, param in plain.named_parameters():
        assert_close(model.get_parameter(name), param)
    for index, moments in plain_optimizer.state_dict()["state"].items():
        assert_close(checkpoint["state"][index]["exp_avg"], moments["exp_avg"])


def test_a_slice_is_a_padded_chunk_and_buckets_cover_every_chunk_once():
    weight = nn.Parameter(torch.arange(7.0))
    parts = [slice_of(weight, rank, 3) for rank in range(3)]
    assert [(s.chunk, s.start, s.stop) for s in parts] == [(3, 0, 3), (3, 3, 6), (3, 6, 7)]
    assert parts[2].view.tolist() == [6.0]  # the padding (elements 7 and 8) is not stored
    parts[1].view.add_(1.0)  # a view: stepping the slice steps the weight
    assert weight[3].item() == 4.0
    big = nn.Parameter(torch.zeros(1000))
    buckets = runs([parts[0], slice_of(big, 0, 3)], 3, limit=3 * 4 * 100)  # 100 per replica
    assert all(sum(r.hi - r.lo for r in bucket) <= 100 for bucket in buckets)
    covered = [(id(r.slice.param), i) for bucket in buckets for r in bucket
               for i in range(r.lo, r.hi)]
    assert sorted(covered) == sorted([(id(weight), i) for i in range(3)]
                                     + [(id(big), i) for i in range(334)])


def test_snapshot_parts_join_into_whole_moments(tmp_path):
    # each replica writes its own slices; the host's restore reads whole tensors
    moment = torch.arange(7.0).view(7, 1)
    for part, (start, stop) in enumerate([(0, 4), (4, 7)]):
        states = {"w": {"exp_avg": moment.view(-1)[start:stop].clone(), "step": 3.0}}
        weights = {"w": torch.zeros(7, 1)} if part == 0 else {}
        snapshot.write(str(tmp_path), 0, 5, (weights, states, {
            "scaling": {}, "slices": 2, "sliced": ["w"]}), part)
    weights, states, attributes = snapshot.read(str(tmp_path), 0, 5)
    assert_close(states["w"]["exp_avg"], moment)
    assert states["w"]["step"] == 3.0 and attributes == {"scaling": {}}
    os.remove(snapshot.path(str(tmp_path), 0, 5, 1))
    assert snapshot.read(str(tmp_path), 0, 5) is None  # a missing part: no restore point


@pytest.mark.slow
def test_two_torchrun_processes_shard_over_their_own_replicas(tmp_path):
    # each process's 2 replicas share the state out (PopTorch's default); the slices are
    # summed over the processes: 4 replicas' numbers, as plain PyTorch computes them
    import torchrun_sharded_job as job
    from helpers.reference import plain_train_call
    from helpers.torchrun import two_nodes

    results = two_nodes(job.__file__, tmp_path)
    data = job.dataset(2 * job.R)
    share, call = len(data) // 2, job.D * job.G * job.R * job.B
    torch.manual_seed(0)
    plain = job.Net()
    optimizer = torch.optim.AdamW(plain.parameters(), lr=0.01, weight_decay=0.1)
    for c in range(job.CALLS):
        # a process's call: [D][G][its 2 replicas][B]; one step sees both processes' replicas
        rows = [torch.arange(p * share + c * call, p * share + (c + 1) * call)
                .view(job.D * job.G, job.R * job.B) for p in range(2)]
        order = torch.cat(rows, dim=1).reshape(-1)
        got = plain_train_call(plain, optimizer, data.tensors[0][order], data.tensors[1][order],
                               D=job.D, G=job.G, R=2 * job.R)
        for p, result in enumerate(results):
            want = torch.stack([loss for _, r, _, loss in got if r // job.R == p])
            assert_close(result["losses"][c], want)
    moments = optimizer.state_dict()["state"]
    for result in results:
        for name, value in plain.state_dict().items():
            assert_close(result["state"][name], value, msg=name)
        for index, value in result["moments"].items():
            assert_close(value, moments[index]["exp_avg"])


@pytest.mark.slow
def test_set_optimizer_reaches_the_slices(request):
    # the slices step through a copy of the worker's optimiser: new hyper-parameters must
    # reach it
    model, plain = model_pair()
    wrapper = cleaned(request, poptorch.trainingModel(
        model, options(sharded=True), optimizer=poptorch.optim.SGD(model.parameters(), lr=0.05,
                                                                    momentum=0.9)))
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.05, momentum=0.9)
    for call, lr in enumerate([0.05, 0.2]):
        wrapper.setOptimizer(poptorch.optim.SGD(model.parameters(), lr=lr, momentum=0.9))
        for group in plain_optimizer.param_groups:
            group["lr"] = lr
        batch = data(call)
        assert_same_result(wrapper(*batch), plain_call(plain, plain_optimizer, batch, D=1, G=G,
                                                       R=R), what=f"call {call}")
    for name, param in plain.named_parameters():
        assert_close(model.get_parameter(name), param)


@pytest.mark.slow
def test_a_killed_replica_returns_the_model_to_its_joined_snapshot(request, monkeypatch):
    # each replica writes only its slices after a call: the restore joins them into whole
    # moments, equal to plain PyTorch's after the last completed call
    import signal

    from pipetorch.errors import DeviceError

    monkeypatch.setenv("PIPETORCH_SNAPSHOTS", "1")
    model, plain = model_pair()
    optimizer = adamw(model.parameters())
    wrapper = cleaned(request, poptorch.trainingModel(model, options(sharded=True),
                                                      optimizer=optimizer))
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=0.01, weight_decay=0.1)
    for call in range(2):
        batch = data(call)
        assert_same_result(wrapper(*batch), plain_call(plain, plain_optimizer, batch, D=1, G=G,
                                                       R=R), what=f"call {call}")
    os.kill(wrapper._compiled.engine.worker_pids[2], signal.SIGKILL)  # replica 1, stage 0
    with pytest.raises(DeviceError):
        wrapper(*data(2))
    for name, param in plain.named_parameters():
        assert_close(model.get_parameter(name), param)
    moments = plain_optimizer.state_dict()["state"]
    state = optimizer.state_dict()["state"]
    for index, values in moments.items():
        assert_close(state[index]["exp_avg_sq"], values["exp_avg_sq"])
