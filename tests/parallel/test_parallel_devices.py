"""One worker per logical device: every stage on an ipu_id runs in that device's worker.

AutoIncrement gives each block its own stage; blocks on the same ipu share its worker (the
BERT tutorial's layers_per_ipu). Consecutive stages hand over in memory; ipus 0, 1, 0 run
stages 0 and 2 interleaved on device 0. Every run equals the plain-PyTorch loop.
"""
import copy
import functools
import os
import signal

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.testing import assert_close

import pipetorch as poptorch
from fault_cases import records_of, registry, wait_gone  # noqa: F401 - registry: a fixture
import parallel_cases as cases
from helpers.reference import expected_outputs, plain_train_call
from parallel_cases import (SkipNet, assert_in_processes, assert_same_result, assert_same_state,
                            cleaned, one_thread_everywhere)
from pipetorch.errors import DeviceError

pytestmark = pytest.mark.slow

B = 2


@pytest.fixture(autouse=True)
def _one_thread(request, monkeypatch):
    one_thread_everywhere(request, monkeypatch)


class Chain(nn.Module):
    """One BeginBlock per layer on `ipus`; the first layer's output skips to the head, so it
    is relayed through every stage between (and crosses devices both ways)."""

    def __init__(self, ipus):
        super().__init__()
        sizes = [6] + [8] * (len(ipus) - 1)
        self.layers = nn.ModuleList(nn.Linear(a, 8) for a in sizes)
        self.head = nn.Linear(8, 3)
        for n, ipu in enumerate(ipus):
            self.layers[n] = poptorch.BeginBlock(self.layers[n], ipu_id=ipu)

    def forward(self, x, labels):
        first = h = torch.tanh(self.layers[0](x))
        for layer in self.layers[1:]:
            h = torch.tanh(layer(h))
        out = self.head(h + first)
        return out, F.cross_entropy(out, labels)


def data(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def options(D, G, R=1, *, strategy=None):
    opts = poptorch.Options().deviceIterations(D).replicationFactor(R)
    opts.Training.gradientAccumulation(G)
    opts.setExecutionStrategy(strategy or poptorch.PipelinedExecution(
        poptorch.AutoStage.AutoIncrement))
    return opts.outputMode(poptorch.OutputMode.All).showCompilationProgressBar(False)


def sgd(model, lr=0.05):
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


train_and_compare = functools.partial(cases.train_and_compare, make_optimizer=sgd,
                                      make_data=data, batch=B)


def stages_per_worker(wrapper):
    return [p.stages for p in wrapper._compiled.engine.placements]


def test_auto_increment_six_blocks_on_two_ipus_start_two_workers(request, registry):
    D, G = 2, 11  # 6 stages: G >= 2 * 6 - 1
    torch.manual_seed(0)
    wrapper = train_and_compare(request, Chain([0, 0, 0, 1, 1, 1]), options(D, G), D=D, G=G)
    assert [s.ipu_id for s in wrapper._compiled.stages] == [0, 0, 0, 1, 1, 1]
    assert_in_processes(wrapper, 2)
    assert stages_per_worker(wrapper) == [(0, 1, 2), (3, 4, 5)]
    records = sorted(records_of(os.getpid()), key=lambda r: r["ipu"])  # `pipetorch devices`
    assert [(r["ipu"], r["stages"]) for r in records] == [(0, [0, 1, 2]), (1, [3, 4, 5])]
    assert sorted(r["pid"] for r in records) == sorted(wrapper._compiled.engine.worker_pids)
    # The report still shows each stage; hand-overs within a device move no bytes.
    traces = wrapper._compiled.engine.last_trace
    assert [t.stage for t in traces] == list(range(6))
    for trace in traces:
        assert [s.micro_batch for s in trace.spans if s.kind == "F"] == list(range(D * G))
    moved = {t.stage: sum(s.nbytes for s in t.spans if s.kind in ("S>F", "S<B")) for t in traces}
    assert moved[0] == moved[1] == moved[4] == moved[5] == 0
    assert moved[2] > 0 and moved[3] > 0  # stage 2 -> 3 crosses from device 0 to device 1


@pytest.mark.parametrize("layout", ["auto-increment-pipelined", "stages-sharded"])
def test_blocks_on_ipus_0_1_0_run_interleaved_on_two_workers(request, layout):
    torch.manual_seed(0)
    if layout == "auto-increment-pipelined":
        D, G = 2, 5
        model, opts = Chain([0, 1, 0]), options(D, G)
    else:  # explicit Stages; B starts with an in-place ReLU on what A hands it over a device
        D, G = 2, 3
        model = SkipNet()
        opts = options(D, G, strategy=poptorch.ShardedExecution(
            poptorch.Stage("A").ipu(0), poptorch.Stage("B").ipu(1), poptorch.Stage("C").ipu(0)))
    wrapper = train_and_compare(request, model, opts, D=D, G=G)
    assert_in_processes(wrapper, 2)
    assert stages_per_worker(wrapper) == [(0, 2), (1,)]
    spans = {t.stage: t.spans for t in wrapper._compiled.engine.last_trace}
    assert sorted(spans) == [0, 1, 2]
    # interleaved: device 0 runs stage 2's forward of micro-batch 0 before stage 0's last one
    first_of_2 = next(s.start for s in spans[2] if s.kind == "F")
    last_of_0 = [s.start for s in spans[0] if s.kind == "F"][G - 1]
    assert first_of_2 < last_of_0

    # Inference on the same layout equals the trained model.
    trained = copy.deepcopy(wrapper.model).eval()
    infer = cleaned(request, poptorch.inferenceModel(copy.deepcopy(trained), options(3, 1,
                    strategy=opts.execution_strategy)))
    x, labels = data(3 * B, seed=9)
    got = infer(x, labels)
    with torch.no_grad():  # one loss per micro-batch (OutputMode.All)
        rows = [trained(x[m * B:(m + 1) * B], labels[m * B:(m + 1) * B]) for m in range(3)]
    expected = torch.cat([o for o, _ in rows]), torch.stack([loss for _, loss in rows])
    assert_same_result(got, expected, what="inference")
    assert stages_per_worker(infer) == [(0, 2), (1,)]


def test_a_weight_tied_between_two_stages_of_one_device_trains_once(request):
    # The worker of device 0 holds one copy: both stages' gradients sum into it, one update.
    D, G = 2, 5
    torch.manual_seed(0)
    model = cases.TiedHead(mid_ipu=1, head_ipu=0)
    wrapper = train_and_compare(request, model, options(D, G), D=D, G=G,
                                make_data=cases.tied_tokens)
    assert stages_per_worker(wrapper) == [(0, 2), (1,)]
    assert wrapper.model.head.weight is wrapper.model.embed.weight


def test_two_replicas_with_two_stages_per_device(request):
    D, G, R = 2, 7, 2
    torch.manual_seed(0)
    wrapper = train_and_compare(request, Chain([0, 0, 1, 1]), options(D, G, R), D=D, G=G, R=R)
    assert_in_processes(wrapper, 2 * R)
    assert stages_per_worker(wrapper) == [(0, 1), (2, 3), (0, 1), (2, 3)]
    traces = wrapper._compiled.engine.last_trace
    assert [(t.stage, t.replica) for t in traces] == [(s, r) for r in range(R) for s in range(4)]
    for trace in traces:  # one all-reduce per device and step, on the device's first stage
        expected = D if trace.stage in (0, 2) else 0
        assert sum(s.kind == "AR" for s in trace.spans) == expected, trace.stage


def test_training_state_with_stages_0_and_2_on_one_worker(request, registry):
    """Adam state, gradient clipping over all devices, setOptimizer, weight uploads, detach and
    attach, and a worker killed between calls: the device holding two stages keeps both."""
    D, G = 2, 5
    torch.manual_seed(0)
    model = Chain([0, 1, 0])
    plain = copy.deepcopy(model)

    def adamw(m, lr=0.01):
        return poptorch.optim.AdamW(m.parameters(), lr=lr, max_grad_norm=0.05)

    optimizer, plain_optimizer = adamw(model), adamw(plain)
    wrapper = poptorch.trainingModel(model, options(D, G), optimizer=optimizer)
    try:
        def call(seed):
            batch = data(D * G * B, seed)
            got = wrapper(*batch)
            rows = plain_train_call(plain, plain_optimizer, *batch, D=D, G=G, R=1)
            assert_same_result(got, expected_outputs(rows, "All", steps=D * G, R=1),
                               what=f"call {seed}")

        call(0)
        wrapper.copyWeightsToHost()
        state, want = optimizer.state_dict()["state"], plain_optimizer.state_dict()["state"]
        assert sorted(state) == sorted(want) and len(state) == len(list(model.parameters()))
        for index, values in want.items():
            for key, value in values.items():
                assert_close(state[index][key], value, msg=f"param {index} {key}")
        replacement, plain_replacement = adamw(model, lr=0.002), adamw(plain, lr=0.002)
        plain_replacement.load_state_dict(plain_optimizer.state_dict())
        plain_replacement.param_groups[0]["lr"] = 0.002
        wrapper.setOptimizer(replacement)
        plain_optimizer = plain_replacement
        call(1)
        wrapper.detachFromDevice()
        with torch.no_grad():  # a host edit of stage 2's weights reaches the new workers
            for m in (model, plain):
                m.layers[2].weight.mul_(0.5)
        wrapper.attachToDevice()
        call(2)
        assert_same_state(model, plain, what="after attach: ")
        pids = list(wrapper._compiled.engine.worker_pids)
        os.kill(pids[0], signal.SIGKILL)
        assert wait_gone([pids[0]]) == []
        # named with its stages, whether the host's send or its wait notices first
        with pytest.raises(DeviceError, match=rf"[Tt]he worker running stages 0 and 2 on cpu "
                                              rf"\(pid {pids[0]}\) (cannot be reached|died)"):
            wrapper(*data(D * G * B, 3))
    finally:
        wrapper.destroy()
    assert wait_gone(pids) == [] and records_of(os.getpid()) == []
    # The model keeps the weights of the last completed call, saved by both workers.
    assert_same_state(model, plain, what="after the loss: ")
