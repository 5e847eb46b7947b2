"""A weight tied across devices (GPT-2's lm_head reading wte's weight on another device) trains
like plain PyTorch: each device holds a copy, their gradients are summed before every step, and
every copy takes the same update; the user's model keeps one tied Parameter."""
import copy

import pytest
import torch
import torch.nn as nn

import pipetorch as poptorch
from parallel_cases import (assert_same_result, assert_same_state, cleaned, local_wrapper,
                            one_thread_everywhere, plain_call, train_and_compare, TIED_VOCAB,
                            TIED_WIDTH, TiedHead, tied_tokens)
from pipetorch.partition import blocks
from pipetorch.partition.strategies import StageSpec
from pipetorch.planning.estimate import estimate_memory
from pipetorch.schedule.plans import Batching

B = 2  # samples per micro-batch
VOCAB, WIDTH = TIED_VOCAB, TIED_WIDTH
tokens = tied_tokens


@pytest.fixture(autouse=True)
def _one_thread(request, monkeypatch):
    one_thread_everywhere(request, monkeypatch)


def tied_across(*, middle: bool = False) -> nn.Module:
    """The embedding (before the first block) on ipu 0, the head reading its weight on the last
    ipu; with `middle`, a layer on ipu 1 between them that holds no tied weight."""
    return TiedHead(mid_ipu=1, head_ipu=2) if middle else TiedHead(head_ipu=1)


def options(D, G, R=1, *, sharded=False):
    opts = poptorch.Options().deviceIterations(D).replicationFactor(R).autoRoundNumIPUs(True)
    opts.Training.gradientAccumulation(G)
    strategy = poptorch.ShardedExecution if sharded else poptorch.PipelinedExecution
    opts.setExecutionStrategy(strategy(poptorch.AutoStage.AutoIncrement))
    return opts.outputMode(poptorch.OutputMode.All).showCompilationProgressBar(False)


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def adam(model):
    return torch.optim.Adam(model.parameters(), lr=0.01)


def clipped_adamw(model):
    # max_grad_norm well under the gradients' norm: every step clips, by the global norm
    return poptorch.optim.AdamW(model.parameters(), lr=0.01, max_grad_norm=0.05)


def tied_spans(wrapper):
    """Stage -> (count, bytes) of its TIED_REDUCE spans in the last call (replica 0)."""
    spans = {}
    for trace in wrapper._compiled.engine.last_trace:
        if trace.replica == 0:
            found = [s for s in trace.spans if s.kind == "TR"]
            spans[trace.stage] = (len(found), sum(s.nbytes for s in found))
    return spans


def assert_still_tied(wrapper):
    assert wrapper.model.head.weight is wrapper.model.embed.weight


@pytest.mark.slow
@pytest.mark.parametrize("sharded, make_optimizer", [(False, adam), (True, sgd)],
                         ids=["pipelined-adam", "sharded-sgd-momentum"])
def test_a_weight_tied_across_two_devices_trains_like_plain_pytorch(request, sharded,
                                                                    make_optimizer):
    D, G = 2, 3  # pipelined over 2 stages: G >= 3
    torch.manual_seed(0)
    wrapper = train_and_compare(request, tied_across(), options(D, G, sharded=sharded), D=D, G=G,
                                make_optimizer=make_optimizer, make_data=tokens, batch=B)
    assert [p.stages for p in wrapper._compiled.engine.placements] == [(0,), (1,)]
    assert_still_tied(wrapper)
    # one sum of the tied gradient per step on each device: VOCAB x WIDTH floats and a flag
    # saying it was used, sent and received
    moved = D * 2 * (VOCAB * WIDTH + 1) * 4
    assert tied_spans(wrapper) == {0: (D, moved), 1: (D, moved)}


@pytest.mark.slow
def test_global_norm_clipping_counts_a_tied_weight_once(request):
    # Device 1's middle layer holds no tied weight, so it never joins the tied sum; the
    # clipping norm, summed over the devices, must count the embedding once, not per copy.
    D, G = 2, 5  # pipelined over 3 stages: G >= 5
    torch.manual_seed(0)
    wrapper = train_and_compare(request, tied_across(middle=True), options(D, G), D=D, G=G,
                                make_optimizer=clipped_adamw, make_data=tokens, batch=B)
    assert_still_tied(wrapper)
    spans = tied_spans(wrapper)
    assert spans[0][0] == spans[2][0] == D and spans[1] == (0, 0)


@pytest.mark.slow
def test_two_replicas_sum_the_tied_weight_over_devices_and_replicas(request):
    D, G, R = 1, 3, 2
    torch.manual_seed(0)
    wrapper = train_and_compare(request, tied_across(), options(D, G, R), D=D, G=G, R=R,
                                make_optimizer=sgd, make_data=tokens, batch=B)
    assert len(wrapper._compiled.engine.worker_pids) == 2 * R
    assert_still_tied(wrapper)
    for trace in wrapper._compiled.engine.last_trace:  # each device of each replica: TR, AR
        kinds = [s.kind for s in trace.spans if s.kind in ("TR", "AR", "STEP")]
        assert kinds == ["TR", "AR", "STEP"] * D, (trace.stage, trace.replica)


@pytest.mark.slow
def test_weights_copied_to_the_devices_reach_every_copy(request):
    # copyWeightsToDevice sends the tied weight to both devices; copyWeightsToHost writes the
    # user's one Parameter, which stays tied.
    D, G = 1, 2
    torch.manual_seed(0)
    model = tied_across()
    plain = copy.deepcopy(model)
    plain_optimizer = sgd(plain)
    wrapper = cleaned(request, poptorch.trainingModel(model, options(D, G, sharded=True),
                                                      optimizer=sgd(model)))
    for call in range(3):
        if call == 1:
            with torch.no_grad():
                for m in (wrapper.model, plain):
                    m.embed.weight.mul_(-0.5)
            wrapper.copyWeightsToDevice()
        batch = tokens(D * G * B, call)
        assert_same_result(wrapper(*batch), plain_call(plain, plain_optimizer, batch, D=D, G=G),
                           what=f"call {call}")
    wrapper.copyWeightsToHost()
    assert_still_tied(wrapper)
    assert_same_state(wrapper.model, plain)


def test_in_one_process_the_stages_share_the_one_weight_and_train_it_once(monkeypatch):
    # PIPETORCH_EXECUTION=local runs the user's model itself: one Parameter, one update.
    D, G = 2, 3
    torch.manual_seed(0)
    model = tied_across()
    plain = copy.deepcopy(model)
    plain_optimizer = adam(plain)
    first = tokens(D * G * B, 0)
    wrapper, got = local_wrapper(
        monkeypatch, lambda: poptorch.trainingModel(model, options(D, G), optimizer=adam(model)),
        first)
    try:
        assert_same_result(got, plain_call(plain, plain_optimizer, first, D=D, G=G),
                           what="call 0")
        batch = tokens(D * G * B, 1)
        assert_same_result(wrapper(*batch), plain_call(plain, plain_optimizer, batch, D=D, G=G),
                           what="call 1")
        assert_still_tied(wrapper)
        assert_same_state(wrapper.model, plain)
    finally:
        wrapper.destroy()


def test_the_memory_estimate_counts_the_tied_weight_on_each_device_its_state_on_the_first():
    torch.manual_seed(0)
    model = tied_across()
    (head,) = [user_id for user_id, _ in blocks.begin_blocks(model).values()]
    estimate = estimate_memory(
        model, (tokens(B, 0), {}), [StageSpec(0, 0, ()), StageSpec(1, 1, (head,))],
        batching=Batching(1, 3, 1), optimizer=adam(model), pipelined=True, training=True,
        offload=False, recomputation=False)
    embed = VOCAB * WIDTH * 4
    mid = (WIDTH * WIDTH + WIDTH) * 4
    assert estimate.devices[0].parameters == embed + mid
    assert estimate.devices[1].parameters == embed  # the head's copy of the embedding
    assert estimate.devices[1].gradients == embed
    # Adam's two moments of the embedding are on device 0 only, which steps it
    assert estimate.devices[0].optimiser_state > 2 * (embed + mid)
    assert estimate.devices[1].optimiser_state == 0
