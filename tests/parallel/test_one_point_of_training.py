"""Every copy of the weights the user reads or uploads holds every tensor, the tied one included,
from one point of training: the latest call's (docs/precision.md). Checked tensor by tensor against
plain PyTorch at that point, with the weights shared with the workers and kept apart."""
import copy

import pytest
import torch

import pipetorch as poptorch
from helpers.reference import train_language_model_call
from parallel_cases import (assert_same_result, assert_same_state, cleaned, one_thread_everywhere,
                            plain_call, TiedHead, tied_tokens)

D, G, B = 1, 3, 2


@pytest.fixture(autouse=True)
def _one_thread(request, monkeypatch):
    one_thread_everywhere(request, monkeypatch)


def _options(R: int):
    opts = poptorch.Options().deviceIterations(D).replicationFactor(R)
    opts.Training.gradientAccumulation(G)
    opts.setExecutionStrategy(poptorch.PipelinedExecution(poptorch.AutoStage.AutoIncrement))
    return opts.outputMode(poptorch.OutputMode.All).showCompilationProgressBar(False)


def _edit(model):
    with torch.no_grad():  # a few elements only: the tensors' other pages stay unwritten
        model.embed.weight[0].mul_(-0.5)
        model.mid.weight[1].add_(0.25)


@pytest.mark.slow
@pytest.mark.parametrize("shared", ["1", "0"], ids=["shared", "apart"])
@pytest.mark.parametrize("between", ["nothing", "read", "host-write"])
@pytest.mark.parametrize("R", [1, 2], ids=["R1", "R2"])
def test_copy_to_the_device_after_calls_uploads_one_point_of_training(request, monkeypatch,
                                                                      shared, between, R):
    # Story: with shared weights, reading after call 2 wrote the tied weight into the host's
    # private pages; the upload after call 3 then sent it from before call 3, the other
    # tensors from after it (and a host edit mixed edited and trained pages within a tensor).
    monkeypatch.setenv("PIPETORCH_SHARED_WEIGHTS", shared)
    torch.manual_seed(0)
    model = TiedHead(head_ipu=1)
    plain = copy.deepcopy(model)
    plain_optimizer = torch.optim.Adam(plain.parameters(), lr=0.01)
    wrapper = cleaned(request, poptorch.trainingModel(
        model, _options(R), optimizer=torch.optim.Adam(model.parameters(), lr=0.01)))

    def call(n):
        batch = tied_tokens(D * G * R * B, n)
        assert_same_result(wrapper(*batch),
                           plain_call(plain, plain_optimizer, batch, D=D, G=G, R=R),
                           what=f"call {n}")

    call(0)
    call(1)
    if between != "nothing":
        assert_same_state(wrapper.model, plain, what="read after call 1: ")
    if between == "host-write":
        _edit(wrapper.model)  # not uploaded: call 2 trains the device's weights, as plain does
    call(2)
    wrapper.copyWeightsToDevice()  # the host copy, brought to the latest call first
    wrapper.copyWeightsToHost()  # what the workers now hold
    assert wrapper.model.head.weight is wrapper.model.embed.weight
    assert_same_state(wrapper.model, plain, what="uploaded after call 2: ")
    call(3)  # training goes on from that point
    assert_same_state(wrapper.model, plain, what="after call 3: ")


def _assert_same_optimizer_state(got, want, *, what: str):
    got_state, want_state = got.state_dict()["state"], want.state_dict()["state"]
    assert sorted(got_state) == sorted(want_state), what
    for index, values in want_state.items():
        for key, value in values.items():
            torch.testing.assert_close(got_state[index][key], value,
                                       msg=lambda m, i=index, k=key: f"{what}{i}.{k}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("end", ["destroy", "detach"])
def test_optimiser_state_moves_to_the_host_when_read_and_back_for_the_next_call(request, end):
    # Story: reading the optimiser copied Adam's moments to the host while the workers kept
    # theirs, so optimizer.state_dict() and destroy() held them twice.
    R = 2
    torch.manual_seed(0)
    model = TiedHead(head_ipu=1)
    plain = copy.deepcopy(model)
    plain_optimizer = torch.optim.Adam(plain.parameters(), lr=0.01)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    wrapper = cleaned(request, poptorch.trainingModel(model, _options(R), optimizer=optimizer))

    def call(n):
        batch = tied_tokens(D * G * R * B, n)
        assert_same_result(wrapper(*batch),
                           plain_call(plain, plain_optimizer, batch, D=D, G=G, R=R),
                           what=f"call {n}")

    call(0)
    engine = wrapper._compiled.engine
    _assert_same_optimizer_state(optimizer, plain_optimizer, what="read after call 0: ")
    assert engine.points.state_on_host  # the host holds replica 0's state now, the workers none
    call(1)  # which the call gets back first: Adam goes on from its moments
    assert not engine.points.state_on_host
    _assert_same_optimizer_state(optimizer, plain_optimizer, what="read after call 1: ")
    wrapper.copyWeightsToDevice()  # gives the state back before the workers' snapshot
    call(2)
    if end == "detach":
        wrapper.detachFromDevice()
        _assert_same_optimizer_state(optimizer, plain_optimizer, what="detached: ")
        wrapper.attachToDevice()
        call(3)
    wrapper.destroy()
    _assert_same_optimizer_state(optimizer, plain_optimizer, what="destroyed: ")
    assert_same_state(model, plain, what="destroyed: ")


@pytest.mark.slow
@pytest.mark.transformers
@pytest.mark.parametrize("shared", ["1", "0"], ids=["shared", "apart"])
def test_a_tied_gpt2_uploads_every_tensor_from_the_latest_call(request, monkeypatch, shared):
    # The case: GPT-2 over 2 devices, read after call 2, copyWeightsToDevice after
    # call 3 uploaded call 3's values for every tensor but the tied wte (call 2's).
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("PIPETORCH_SHARED_WEIGHTS", shared)
    config = transformers.GPT2Config(vocab_size=97, n_positions=16, n_embd=32, n_layer=4,
                                     n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     use_cache=False)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    plain = copy.deepcopy(model)
    model.transformer.h[2] = poptorch.BeginBlock(model.transformer.h[2], ipu_id=1)
    opts = poptorch.Options().showCompilationProgressBar(False)
    opts.Training.gradientAccumulation(G)
    wrapper = cleaned(request, poptorch.trainingModel(
        model, opts, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)))
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    for call in range(4):
        train_language_model_call(wrapper, plain, plain_optimizer, call, G, msg=f"call {call}")
        if call == 1:
            assert_same_state(model, plain, what="read after call 2: ")
        if call == 2:
            wrapper.copyWeightsToDevice()
            wrapper.copyWeightsToHost()  # what the workers now hold, tensor by tensor
            assert model.lm_head.weight is model.transformer.wte.weight
            assert_same_state(model, plain, what="uploaded after call 3: ")
    assert_same_state(model, plain, what="after call 4: ")
