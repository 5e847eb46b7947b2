"""Replicas in their own worker processes: gradients all-reduced, the numbers of plain PyTorch."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.testing import assert_close

import pipetorch as poptorch
from parallel_cases import (
    assert_in_processes, assert_same_result, assert_same_state, cleaned, mnist_case,
    one_thread_everywhere, options, plain_call, twin,
)

B, CALLS = 2, 2


@pytest.fixture(autouse=True)
def _one_thread(request, monkeypatch):
    one_thread_everywhere(request, monkeypatch)


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def train_like_plain(wrapper, plain, plain_optimizer, case, *, D, G, R, mode) -> None:
    """CALLS training calls of `wrapper` and of the plain loop on the same batches, each
    call's result compared."""
    for call in range(CALLS):
        batch = case.data(D * G * R * B, seed=call)
        expected = plain_call(plain, plain_optimizer, batch, D=D, G=G, R=R, mode=mode)
        assert_same_result(wrapper(*batch), expected, what=f"call {call}")


@pytest.mark.slow
# R=2 x 2 stages pipelined: tests/parallel/test_parallel_weights.py (also against the local engine)
@pytest.mark.parametrize("count, sharded, D, G, mode", [
    pytest.param(1, False, 2, 2, "All", id="R2-1-device"),
    pytest.param(2, True, 1, 2, "Sum", id="R2x2-sharded"),
])
def test_replicas_match_plain_pytorch(request, count, sharded, D, G, mode):
    R = 2
    case = mnist_case(2)
    if count == 1:  # one device per replica
        case.stages = (poptorch.Stage("B1", "B2", "B3", "B4").ipu(0),)
    plain = twin(case.model)
    opts = options(case, sharded=sharded, D=D, G=G, R=R, mode=mode)
    wrapper = cleaned(request, poptorch.trainingModel(case.model, opts, optimizer=sgd(case.model)))
    plain_optimizer = sgd(plain)
    train_like_plain(wrapper, plain, plain_optimizer, case, D=D, G=G, R=R, mode=mode)
    assert_in_processes(wrapper, count * R)
    engine = wrapper._compiled.engine
    reduces = [(t.stage, t.replica, s) for t in engine.last_trace for s in t.spans if s.kind == "AR"]
    assert sorted((stage, replica) for stage, replica, _ in reduces) == sorted(
        (s, r) for s in range(count) for r in range(R) for _ in range(D))
    assert all(span.nbytes > 0 for _, _, span in reduces)
    assert_same_state(wrapper.model, plain)


class Wide(nn.Module):
    """An MLP whose first weight (784 x 16384 fp32, 51 MB) is over a 25 MiB bucket."""

    def __init__(self):
        super().__init__()
        self.hidden, self.out = nn.Linear(784, 16384), nn.Linear(16384, 10)

    def forward(self, x, labels):
        logits = self.out(F.relu(self.hidden(x.flatten(1))))
        return logits, F.cross_entropy(logits, labels)


@pytest.mark.slow
def test_replicas_whose_gradients_span_several_buckets_match_plain_pytorch(request, monkeypatch):
    # the all-reduce joined each dtype's gradients into one buffer (1x extra memory); in
    # buckets of 25 MiB the first weight is sliced across two and must sum the same
    monkeypatch.setenv("PIPETORCH_OVERLAP", "1")
    torch.manual_seed(0)
    R, D, G = 2, 1, 2
    case = mnist_case(2)
    case.model, case.stages = Wide(), ()
    plain = twin(case.model)
    opts = options(case, sharded=False, D=D, G=G, R=R)
    wrapper = cleaned(request, poptorch.trainingModel(case.model, opts, optimizer=sgd(case.model)))
    plain_optimizer = sgd(plain)
    train_like_plain(wrapper, plain, plain_optimizer, case, D=D, G=G, R=R, mode="All")
    reduced = [s.nbytes for t in wrapper._compiled.engine.last_trace for s in t.spans
               if s.kind == "AR"]
    gradients = sum(p.numel() * p.element_size() for p in plain.parameters())
    assert reduced == [2 * gradients] * R  # sent and received, every byte once
    assert_same_state(wrapper.model, plain)
    # each bucket's all-reduce started inside the step's last backward (parallel/worker/overlap.py)
    for trace in wrapper._compiled.engine.last_trace:
        last_backward = [s for s in trace.spans if s.kind == "B"][-1]
        assert last_backward.micro_batch == D * G - 1
        assert len(trace.early_reduces) == 2  # 52 MB of gradients in 25 MiB buckets
        for span in trace.early_reduces:
            assert last_backward.start < span.start < last_backward.end, (span, last_backward)
            assert span.micro_batch == D * G - 1 and span.nbytes > 0
    # PIPETORCH_OVERLAP is read at each call: the same workers now sum at the step
    monkeypatch.setenv("PIPETORCH_OVERLAP", "0")
    batch = case.data(D * G * R * B, seed=CALLS)
    assert_same_result(wrapper(*batch), plain_call(plain, plain_optimizer, batch, D=D, G=G, R=R,
                                                   mode="All"), what="a call without overlap")
    assert not any(trace.early_reduces for trace in wrapper._compiled.engine.last_trace)
    assert_same_state(wrapper.model, plain)


@pytest.mark.slow
def test_inference_replicas_split_the_batch(request):
    case = mnist_case(2)
    plain = twin(case.model).eval()
    D, R = 3, 2
    wrapper = cleaned(request, poptorch.inferenceModel(case.model, options(case, sharded=False,
                                                                          D=D, R=R)))
    inputs, _ = case.data(D * R * B, seed=4)
    got = wrapper(inputs)
    with torch.no_grad():
        assert_close(got, plain(inputs))
    assert_in_processes(wrapper, 2 * R)


class Dropper(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x, labels):
        with poptorch.Block("A", ipu_id=0):
            h = F.dropout(torch.relu(self.a(x)), p=0.5, training=self.training)
        with poptorch.Block("B", ipu_id=1):
            out = self.b(h)
            return out, F.cross_entropy(out, labels)


@pytest.mark.slow
def test_random_seed_repeats_a_run_bit_for_bit(request):
    """Dropout in a worker: two runs with randomSeed give identical losses."""
    g = torch.Generator().manual_seed(1)
    x, labels = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
    losses = []
    for _ in range(2):
        torch.manual_seed(0)
        model = Dropper()
        opts = poptorch.Options().deviceIterations(2).randomSeed(42)
        opts.Training.gradientAccumulation(4)
        opts.outputMode(poptorch.OutputMode.All).showCompilationProgressBar(False)
        wrapper = cleaned(request, poptorch.trainingModel(model, opts, optimizer=sgd(model)))
        losses.append(torch.cat([wrapper(x, labels)[1] for _ in range(2)]))
        wrapper.destroy()
    assert torch.equal(losses[0], losses[1]), losses
    assert len(set(losses[0].tolist())) > 1


def test_two_replicas_equal_one_replica_with_the_batch_doubled():
    """[D][G][R][B] with R=2 holds the same rows as [D][G][2B]: a mean over them is the same."""
    g = torch.Generator().manual_seed(3)
    D, G = 2, 2
    x, labels = torch.randn(D * G * 2 * B, 6, generator=g), torch.randint(0, 3, (D * G * 2 * B,),
                                                                           generator=g)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(6, 3)

        def forward(self, x, labels):
            out = self.a(x)
            return out, F.cross_entropy(out, labels)

    trained = []
    for R in (1, 2):
        torch.manual_seed(0)
        model = Net()
        opts = poptorch.Options().deviceIterations(D).replicationFactor(R)
        opts.Training.gradientAccumulation(G)
        opts.showCompilationProgressBar(False)
        wrapper = poptorch.trainingModel(model, opts, optimizer=sgd(model))
        wrapper(x, labels)
        wrapper(x, labels)
        wrapper.destroy()
        trained.append(model)
    assert_same_state(trained[1], trained[0])


@pytest.mark.slow
@pytest.mark.parametrize("schedule, count, ipus, G", [
    pytest.param("zero_bubble", 2, (0, 1), 4, id="zero-bubble"),
    pytest.param("interleaved", 4, (0, 1, 0, 1), 8, id="interleaved"),
])
def test_replicas_with_early_all_reduce_match_plain_pytorch(request, monkeypatch, schedule,
                                                            count, ipus, G):
    # the early all-reduce starts a stage's buckets at the end of its last W (zero-bubble),
    # and for two stages per device in one order on every replica (interleaved)
    monkeypatch.setenv("PIPETORCH_OVERLAP", "1")
    R, D = 2, 2
    case = mnist_case(count)
    case.stages = tuple(stage.ipu(ipu) for stage, ipu in zip(case.stages, ipus))
    plain = twin(case.model)
    opts = options(case, sharded=False, D=D, G=G, R=R)
    opts.Training.pipelineSchedule(schedule)
    wrapper = cleaned(request, poptorch.trainingModel(case.model, opts, optimizer=sgd(case.model)))
    plain_optimizer = sgd(plain)
    train_like_plain(wrapper, plain, plain_optimizer, case, D=D, G=G, R=R, mode="All")
    assert_same_state(wrapper.model, plain)
    traces = wrapper._compiled.engine.last_trace
    assert {(t.stage, t.replica) for t in traces} == {(s, r) for s in range(count)
                                                      for r in range(R)}
    early = {}  # (replica, device) -> buckets started before the step's AR, over the call
    for trace in traces:
        key = (trace.replica, ipus[trace.stage])
        early[key] = early.get(key, 0) + len(trace.early_reduces)
        assert all(span.micro_batch is not None for span in trace.early_reduces)
    assert len(early) == R * 2 and min(early.values()) >= D, early
