"""Recomputation inside pipeline stages: stage_module, the Training switch, saved bytes."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pipetorch as poptorch
from pipetorch.errors import CompileError
from pipetorch.options.groups import _PopartOptions, _TrainingOptions
from pipetorch.partition.inplace import inplace_inputs
from pipetorch.partition.split import split_stages
from pipetorch.partition.strategies import StageSpec
from pipetorch.parallel.worker.recompute import original_module, stage_module

from helpers.activations import saved_activation_bytes

WIDTH, BATCH = 8, 4
STAGES = [StageSpec(0, 0, ("B1",)), StageSpec(1, 1, ("B2",))]


class TwoBlocks(nn.Module):
    """Dropout and a checkpoint in B1; BatchNorm, a buffer read directly and a checkpoint in B2."""

    def __init__(self, *, inplace_start: bool = False) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = (nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.drop = nn.Dropout(0.3)
        self.norm = nn.BatchNorm1d(WIDTH)
        self.head = nn.Linear(WIDTH, 1)
        self.register_buffer("offset", torch.linspace(-1, 1, WIDTH))
        self.inplace_start = inplace_start

    def forward(self, x):
        with poptorch.Block("B1"):
            h = self.drop(torch.relu(self.fc1(x)))
            h = poptorch.recomputationCheckpoint(h)
            h = torch.tanh(self.fc2(h))
        with poptorch.Block("B2"):
            if self.inplace_start:  # the stage modifies the value it receives
                h = F.relu(h, inplace=True)
            h = torch.relu(self.norm(self.fc3(h) + self.offset))
            h = poptorch.recomputationCheckpoint(h)
            return self.head(h).pow(2).mean()


def _stages(model: nn.Module) -> list[nn.Module]:
    x = torch.randn(BATCH, WIDTH)
    return split_stages(model, (x,), {}, STAGES).modules


def _pipeline(stages: list[nn.Module], inputs: list[torch.Tensor]):
    """Both stages over two micro-batches, forwards ahead of backwards as 1F1B interleaves
    them; stage 1 gets stage 0's output as a fresh leaf, cloned when it changes it in place."""
    torch.manual_seed(0)
    clone = inplace_inputs(original_module(stages[1]))
    first, received, losses, passed = [], [], [], []
    for x in inputs:
        (h,) = stages[0](x)
        first.append(h)
        leaf = h.detach().requires_grad_(True)
        received.append(leaf)
        arg = leaf.clone() if 0 in clone else leaf
        (loss,) = stages[1](arg)
        losses.append(loss)
        passed.append(arg.detach().clone())
    for h, leaf, loss in zip(first, received, losses):
        loss.backward()
        h.backward(leaf.grad)
    return losses, passed, [x.grad for x in inputs], [leaf.grad for leaf in received]


def _assert_stages_match(wrap, *, inplace_start: bool = False) -> list[nn.Module]:
    torch.manual_seed(0)
    plain = TwoBlocks(inplace_start=inplace_start)
    model = copy.deepcopy(plain)
    plain_stages, stages = _stages(plain), [wrap(m) for m in _stages(model)]
    inputs = [torch.randn(BATCH, WIDTH) for _ in range(2)]
    expected = _pipeline(plain_stages, [x.clone().requires_grad_(True) for x in inputs])
    got = _pipeline(stages, [x.clone().requires_grad_(True) for x in inputs])
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    for (name, p), (_, q) in zip(plain.named_parameters(), model.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0, msg=name)
    for (name, b), (_, c) in zip(plain.named_buffers(), model.named_buffers()):
        assert torch.equal(c, b), name
    assert model.norm.num_batches_tracked.item() == 2  # once per forward, not per rerun
    return stages


def test_checkpoint_calls_recompute_inside_each_stage():
    stages = _assert_stages_match(lambda m: stage_module(m, checkpoint=False))
    assert [type(s).__name__ for s in stages] == ["_RecomputedModule"] * 2
    assert all(s.segmented for s in stages)


def test_whole_stage_checkpointing_matches_plain():
    stages = _assert_stages_match(lambda m: stage_module(m, checkpoint=True))
    assert [type(s).__name__ for s in stages] == ["_CheckpointedStage"] * 2


def test_stage_modifying_its_input_in_place_under_checkpointing():
    # The executor clones such an input and reads it back after forward; the rerun in
    # backward must start from the value as it was received, not as the stage left it.
    _assert_stages_match(lambda m: stage_module(m, checkpoint=True), inplace_start=True)
    _assert_stages_match(lambda m: stage_module(m, checkpoint=False), inplace_start=True)


def test_no_checkpoint_calls_and_switch_off_is_the_module_itself():
    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(WIDTH, WIDTH)

        def forward(self, x):
            with poptorch.Block("B1"):
                h = self.fc(x)
            with poptorch.Block("B2"):
                return h.sum()

    for stage in _stages(Plain()):
        assert stage_module(stage, checkpoint=False) is stage
    module = nn.Linear(2, 2)
    assert stage_module(module, checkpoint=False) is module
    assert original_module(module) is module


def _names(module: nn.Module) -> list[list[str]]:
    return [[n for n, _ in module.named_parameters()], [n for n, _ in module.named_buffers()],
            list(module.state_dict())]


def _state(module: nn.Module) -> list[int]:
    return [id(t) for t in [*module.parameters(), *module.buffers()]]


@pytest.mark.parametrize("checkpoint", [False, True])
def test_names_shared_weights_and_pickling(checkpoint):
    torch.manual_seed(0)
    plain = _stages(TwoBlocks())[1]  # fc3, norm, head and the stage's own buffer `offset`
    assert "offset" in dict(plain.named_buffers(recurse=False))
    wrapped = stage_module(copy.deepcopy(plain), checkpoint=checkpoint)
    assert _names(wrapped) == _names(plain)
    assert _state(wrapped) == _state(original_module(wrapped))

    copied = pickle.loads(pickle.dumps(wrapped))
    assert type(copied) is type(wrapped) and _names(copied) == _names(plain)
    assert _state(copied) == _state(original_module(copied))
    # The runtime loads weights by name, in place, then moves the stage to its device.
    fresh = {name: torch.randn_like(t) if t.is_floating_point() else t
             for name, t in [*plain.named_parameters(), *plain.named_buffers()]}
    with torch.no_grad():
        for module in (copied, plain):
            for name, t in [*module.named_parameters(), *module.named_buffers()]:
                t.copy_(fresh[name])
    copied.double()  # replaces every buffer object, the stage's own `offset` included
    assert original_module(copied).offset is copied.offset
    x = torch.randn(BATCH, WIDTH, dtype=torch.float64)
    torch.testing.assert_close(copied(x), plain.double()(x), rtol=0, atol=0)
    torch.testing.assert_close(dict(copied.named_buffers()), dict(plain.named_buffers()),
                               rtol=0, atol=0)
    copied.eval()
    assert not original_module(copied).training and not copied.norm.training


class ThreeLinear(nn.Module):
    """4 -> 8 -> 8 -> 2 with ReLUs and a checkpoint after the second ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x):
        h = poptorch.recomputationCheckpoint(torch.relu(self.b(torch.relu(self.a(x)))))
        return self.c(h)


def test_saved_activation_bytes_by_hand():
    torch.manual_seed(0)
    model, x = ThreeLinear(), torch.randn(3, 4)
    f32 = 4
    # Plain: x (3x4) for a's weight gradient, the two ReLU outputs (3x8 each; b and c read
    # the same storages). Parameters are never counted.
    assert saved_activation_bytes(model, (x,)) == (3 * 4 + 2 * 3 * 8) * f32 == 240
    # Checkpoint calls: the first segment keeps only its input x, c keeps its input.
    recomputed = stage_module(copy.deepcopy(model), checkpoint=False)
    assert saved_activation_bytes(recomputed, (x,)) == (3 * 4 + 3 * 8) * f32 == 144
    # The whole forward checkpointed: only x.
    checkpointed = stage_module(copy.deepcopy(model), checkpoint=True)
    assert saved_activation_bytes(checkpointed, (x,)) == 3 * 4 * f32 == 48
    torch.testing.assert_close(checkpointed(x), model(x), rtol=0, atol=0)


def test_saved_activation_bytes_leaves_modes_buffers_and_rng_alone():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5))
    model.eval()
    model[1].train()
    stats = copy.deepcopy(model[1].state_dict())
    x = torch.randn(3, 4)
    rng = torch.random.get_rng_state()
    # Train mode: x, the Linear output (BatchNorm's input), BatchNorm's batch mean and
    # inverse std (8 each), and Dropout's scaled mask (float32 in the CPU kernel); not the
    # BatchNorm weight nor its running statistics.
    trained = saved_activation_bytes(model, (x,), training=True)
    assert trained == (3 * 4 + 3 * 8 + 2 * 8 + 3 * 8) * 4
    assert [m.training for m in model.modules()] == [False, False, True, False]
    assert all(torch.equal(v, stats[k]) for k, v in model[1].state_dict().items())
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert saved_activation_bytes(model, (x,), training=False) < trained


def test_untraceable_module_with_calls_is_a_compile_error():
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(2, 2)

        def forward(self, x):
            h = poptorch.recomputationCheckpoint(self.fc(x))
            return h.sum() if h.sum() > 0 else -h.sum()

    with pytest.raises(CompileError, match="recomputationCheckpoint needs Branchy.forward"):
        stage_module(Branchy(), checkpoint=False)
    # Whole-module checkpointing needs no trace.
    model = Branchy()
    x = torch.randn(3, 2, requires_grad=True)
    stage_module(model, checkpoint=True)(x).backward()
    assert x.grad is not None and model.fc.weight.grad is not None


def test_unseen_in_place_change_of_an_input_is_refused():
    class Scales(nn.Module):  # not an fx graph: its in-place change can't be seen in advance
        def forward(self, x):
            return x.mul_(2).sum()

    with pytest.raises(CompileError, match=r"Scales.forward modified its input 0 in place"):
        stage_module(Scales(), checkpoint=True)(torch.randn(3) + torch.zeros(3))


# --- the switch ---------------------------------------------------------------------------

def test_training_recomputation_switch():
    training = _TrainingOptions()
    assert training.recomputation is False
    assert training.setRecomputation(True) is training and training.recomputation is True
    assert training.toDict()["recomputation"] is True
    with pytest.raises(TypeError, match="setRecomputation: enabled must be True or False"):
        training.setRecomputation(1)
    assert poptorch.Options().Training.setRecomputation(True).recomputation is True


def test_popart_auto_recomputation_spelling_sets_the_switch():
    training = _TrainingOptions()
    popart = _PopartOptions(training=training)
    popart.set("autoRecomputation", 3)  # RecomputationType.Pipeline
    assert training.recomputation is True and popart.options == {"autoRecomputation": 3}
    popart.set("autoRecomputation", 0)
    assert training.recomputation is False
    for bad in (5, "3", True):
        with pytest.raises(ValueError, match=r"autoRecomputation must be an int of "
                                             r"popart.RecomputationType, one of 0 \(None\)"):
            popart.set("autoRecomputation", bad)
    assert training.recomputation is False
    copied = copy.deepcopy([training, popart])
    copied[1].set("autoRecomputation", 4)
    assert copied[0].recomputation is True and training.recomputation is False
