"""Options.inputSignatures("several"): one wrapper runs calls of several sequence lengths on
one set of weights and optimiser state, as plain PyTorch does; PopTorch's error by default."""
from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch.testing import assert_close

import pipetorch as poptorch
from helpers.models import TokenTagger, token_batch
from helpers.reference import assert_same_weights
from pipetorch.errors import InputMismatchError
from pipetorch.parallel.host.engine import ProcessEngine
from pipetorch.parallel.host.local import LocalEngine
from pipetorch.parallel.worker.skeletons import bind, skeleton, tensors_of
from pipetorch.runtime.artefact import saved_inputs

LENGTHS = (16, 24, 16, 32, 24)
B = 2


def options(devices: int, *, several: bool = True, G: int = 1, D: int = 1) -> poptorch.Options:
    opts = poptorch.Options().deviceIterations(D).showCompilationProgressBar(False)
    opts.Training.gradientAccumulation(G)
    return opts.inputSignatures("several") if several else opts


def plain_call(model, optimizer, ids, labels, *, G: int) -> torch.Tensor:
    """One step over G micro-batches of B (the mean of their losses); the last one's loss."""
    optimizer.zero_grad()
    for g in range(G):
        loss = model(ids[g * B:(g + 1) * B], labels[g * B:(g + 1) * B])[1]
        (loss / G).backward()
    optimizer.step()
    return loss.detach()


def train_lengths(request, devices: int, G: int, caplog) -> None:
    torch.manual_seed(0)
    net = TokenTagger(devices)
    plain = copy.deepcopy(net)
    # Adam: one optimiser state per signature would move the weights differently
    plain_opt = torch.optim.Adam(plain.parameters(), lr=0.01)
    optimizer = poptorch.optim.Adam(net.parameters(), lr=0.01)
    model = poptorch.trainingModel(net, options(devices, G=G), optimizer=optimizer)
    request.addfinalizer(model.destroy)
    with caplog.at_level(logging.WARNING, logger="pipetorch.runtime.executor"):
        for call, length in enumerate(LENGTHS):
            ids, labels = token_batch(G * B, length, seed=call)
            _, loss = model(ids, labels)
            want = plain_call(plain, plain_opt, ids, labels, G=G)
            assert_close(loss.as_subclass(torch.Tensor), want, msg=f"call {call} ({length})")
    added = [r.getMessage() for r in caplog.records if "Input signature" in r.getMessage()]
    assert len(added) == 2, added  # lengths 24 and 32, once each
    n = G * B
    assert f"[{n}, 16] to [{n}, 24]" in added[0] and f"[{n}, 16] to [{n}, 32]" in added[1]
    assert_same_weights(net, plain)
    # the optimiser's state is one too (reading the user's optimiser brings the device's)
    got, want = optimizer.state_dict()["state"], plain_opt.state_dict()["state"]
    assert list(got) == list(want)
    for index, state in want.items():
        assert float(got[index]["step"]) == len(LENGTHS)
        for key in ("exp_avg", "exp_avg_sq"):
            assert_close(got[index][key], state[key], msg=f"param {index} {key}")
    return model


def test_training_over_lengths_on_one_device_equals_plain_pytorch(request, caplog):
    model = train_lengths(request, 1, 1, caplog)
    engine = model._compiled.engine
    assert isinstance(engine, LocalEngine) and len(engine._signatures) == 3


@pytest.mark.slow
def test_training_over_lengths_pipelined_on_two_devices_equals_plain_pytorch(request, caplog):
    model = train_lengths(request, 2, 4, caplog)
    engine = model._compiled.engine
    assert isinstance(engine, ProcessEngine) and len(engine.worker_pids) == 2
    assert len(engine.signatures.all) == 3
    # every signature's stages hold the user's parameters themselves: no copy per signature
    users = {id(p) for p in model._user_model.parameters()}
    for staged, _, _ in engine.signatures.all:
        assert {id(p) for m in staged.modules for p in m.parameters()} == users


def test_a_new_signature_is_refused_by_default_as_in_poptorch(request):
    model = poptorch.trainingModel(TokenTagger(1), options(1, several=False))
    request.addfinalizer(model.destroy)
    model(*token_batch(B, 16))
    with pytest.raises(InputMismatchError, match=r"Shape mismatch for ids.*inputSignatures"):
        model(*token_batch(B, 24))
    model(*token_batch(B, 16))  # the first signature still runs


@pytest.mark.slow
def test_a_new_signature_is_refused_by_default_with_workers(request):
    model = poptorch.inferenceModel(TokenTagger(2), options(2, several=False, D=2))
    request.addfinalizer(model.destroy)
    model(token_batch(2 * B, 16)[0])
    with pytest.raises(InputMismatchError, match="Shape mismatch for ids"):
        model(token_batch(2 * B, 24)[0])


@pytest.mark.parametrize("devices", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_inference_over_lengths_equals_plain_pytorch(request, devices):
    torch.manual_seed(0)
    net = TokenTagger(devices)
    D = devices  # pipelined inference: D >= stages
    model = poptorch.inferenceModel(net, options(devices, D=D))
    request.addfinalizer(model.destroy)
    net.eval()
    for call, length in enumerate(LENGTHS):
        ids, _ = token_batch(D * B, length, seed=call)
        with torch.no_grad():
            want = net(ids)
        assert_close(model(ids), want, msg=f"call {call} ({length})")
    engine = model._compiled.engine
    held = engine.signatures.all if isinstance(engine, ProcessEngine) else engine._signatures
    assert len(held) == 3


@pytest.mark.slow
def test_signatures_come_back_after_detach_and_attach(request):
    """attachToDevice starts new workers: they get every signature's stages again."""
    torch.manual_seed(0)
    net = TokenTagger(2)
    plain = copy.deepcopy(net)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    model = poptorch.trainingModel(net, options(2, G=4),
                                   optimizer=poptorch.optim.SGD(net.parameters(), lr=0.1))
    request.addfinalizer(model.destroy)
    for call, length in enumerate((16, 24, None, 16, 24)):
        if length is None:
            model.detachFromDevice()
            model.attachToDevice()
            continue
        ids, labels = token_batch(4 * B, length, seed=call)
        _, loss = model(ids, labels)
        assert_close(loss.as_subclass(torch.Tensor),
                     plain_call(plain, plain_opt, ids, labels, G=4), msg=f"call {call}")
    assert_same_weights(net, plain)


def test_compile_adds_a_signature_without_running(request):
    net = TokenTagger(1)
    model = poptorch.inferenceModel(net, options(1))
    request.addfinalizer(model.destroy)
    model.compile(token_batch(B, 16)[0])
    model.compile(token_batch(B, 24)[0])
    assert len(model._inputs.signatures) == 2
    net.eval()
    ids = token_batch(B, 24, seed=3)[0]
    with torch.no_grad():
        assert_close(model(ids), net(ids))
    assert len(model._inputs.signatures) == 2  # the call found the compiled signature


def test_the_option_is_validated_when_set():
    assert poptorch.Options().input_signatures == "one"
    assert poptorch.Options().inputSignatures("several").input_signatures == "several"
    with pytest.raises(ValueError, match="inputSignatures.*'one'.*'several'.*'many'"):
        poptorch.Options().inputSignatures("many")
    with pytest.raises(TypeError, match="inputSignatures"):
        poptorch.Options().inputSignatures(True)


def test_a_skeleton_holds_no_weights_and_binds_to_the_held_ones():
    held = TokenTagger(1)
    bare = skeleton(held)
    assert all(p.device.type == "meta" for p in bare.parameters())
    bound = bind(bare, tensors_of(held))
    assert [id(p) for p in bound.parameters()] == [id(p) for p in held.parameters()]


def test_save_after_another_signature_writes_the_first_one(request, tmp_path):
    # The saved graph is the first call's; its signature (not the last call's) goes with it.
    torch.manual_seed(0)
    net = TokenTagger(1)
    model = poptorch.inferenceModel(net, options(1))
    request.addfinalizer(model.destroy)
    first, other = token_batch(B, 16)[0], token_batch(B, 24)[0]
    model(first)
    model(other)
    model.save(str(tmp_path / "model.pex"))
    args, _ = saved_inputs(tmp_path / "model.pex")
    assert args[0].shape == first.shape
    loaded = poptorch.load(str(tmp_path / "model.pex"))
    request.addfinalizer(loaded.destroy)
    net.eval()
    with torch.no_grad():
        assert_close(loaded(first), net(first))


def test_a_new_signature_over_the_memory_budget_is_refused_and_the_others_still_run(request):
    from pipetorch.errors import OutOfMemoryError

    opts = options(1).setMemoryBudget(200_000)  # sequences of 16 fit, of 4096 do not
    model = poptorch.trainingModel(TokenTagger(1), opts)
    request.addfinalizer(model.destroy)
    model(*token_batch(B, 16))
    with pytest.raises(OutOfMemoryError):
        model(*token_batch(B, 4096))
    model(*token_batch(B, 16))
    model(*token_batch(B, 24))
    assert len(model._inputs.signatures) == 2


@pytest.mark.slow
def test_replicas_train_over_lengths_as_plain_pytorch(request):
    """Two replicas (a worker each): every worker gets each signature, the all-reduce too."""
    torch.manual_seed(0)
    net = TokenTagger(1)
    plain = copy.deepcopy(net)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    opts = options(1).replicationFactor(2)
    model = poptorch.trainingModel(net, opts, optimizer=poptorch.optim.SGD(
        net.parameters(), lr=0.1, momentum=0.9))
    request.addfinalizer(model.destroy)
    for call, length in enumerate(LENGTHS):
        ids, labels = token_batch(2 * B, length, seed=call)
        loss = model(ids, labels)[1].as_subclass(torch.Tensor)
        want = plain_call(plain, plain_opt, ids, labels, G=2)  # replica 1's micro-batch last
        assert_close(loss[1], want, msg=f"call {call} ({length})")
    assert len(model._compiled.engine.worker_pids) == 2
    assert_same_weights(net, plain)


class LengthPlaced(torch.nn.Module):
    """`mid` runs on device 0 for long sequences and on device 1 for short ones."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(20, 8)
        self.mid, self.head = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)

    def forward(self, ids):
        with poptorch.Block("a", ipu_id=0):
            h = self.embed(ids)
            if ids.shape[1] > 20:
                h = self.mid(h)
        with poptorch.Block("b", ipu_id=1):
            if ids.shape[1] <= 20:
                h = self.mid(h)
            return self.head(h)


@pytest.mark.slow
def test_a_signature_that_moves_weights_to_another_device_is_refused(request):
    from pipetorch.errors import CompileError

    model = poptorch.inferenceModel(LengthPlaced(), options(2, D=2))
    request.addfinalizer(model.destroy)
    short = token_batch(2 * B, 16)[0]
    want = model(short)
    with pytest.raises(CompileError, match=r"splits the model differently.*mid\.weight"):
        model(token_batch(2 * B, 24)[0])
    assert_close(model(short), want)  # the first signature still runs


def test_synthetic_data_follows_the_signature_of_the_call(request):
    opts = options(1).enableSyntheticData(True)
    model = poptorch.inferenceModel(TokenTagger(1), opts)
    request.addfinalizer(model.destroy)
    for length in (16, 24, 16):
        assert model(token_batch(B, length)[0]).shape == (B, length, 20)
