"""Options.Precision.halfFloatCasting: ops in forward mixing float16 and float32 cast, as in
PopTorch 3.x, instead of failing as plain PyTorch does."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.testing import assert_close

import pipetorch as poptorch
from pipetorch.partition.casting import HalfFloatCasting

Behaviour = poptorch.HalfFloatCastingBehavior


class Mixed(nn.Module):
    """A float16 layer between float32 values: a scale forward makes and a float32 head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 8).half()
        self.head = nn.Linear(8, 3)

    def forward(self, x, y):
        scale = torch.linspace(0.5, 1.5, 4)  # float32, made in forward
        out = self.head(torch.relu(self.fc(x * scale)))
        return out, F.cross_entropy(out.float(), y)


def _explicit(model: Mixed, x, y, dtype: torch.dtype):
    """Mixed's forward in plain PyTorch, with every cast to `dtype` written out."""
    hidden = (x * torch.linspace(0.5, 1.5, 4)).to(dtype)
    hidden = torch.relu(F.linear(hidden, model.fc.weight.to(dtype), model.fc.bias.to(dtype)))
    out = F.linear(hidden, model.head.weight.to(dtype), model.head.bias.to(dtype))
    return out, F.cross_entropy(out.float(), y)


def _data():
    gen = torch.Generator().manual_seed(1)
    return torch.randn(16, 4, generator=gen), torch.randint(0, 3, (16,), generator=gen)


def _plain_steps(dtype: torch.dtype, x, y, *, steps: int = 2):
    """Losses and weights of plain SGD steps on Mixed with explicit casts to `dtype`."""
    model = Mixed()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        _, loss = _explicit(model, x, y, dtype)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return torch.stack(losses), dict(model.named_parameters())


def _pipetorch_steps(opts, x, y, *, steps: int = 2, split: bool = False):
    model = Mixed()
    if split:
        poptorch.BeginBlock(model.head, "head", ipu_id=1)
    wrapped = poptorch.trainingModel(
        model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        losses = torch.stack([wrapped(x, y)[1].as_subclass(torch.Tensor).reshape(-1)[-1]
                              for _ in range(steps)])
        wrapped.copyWeightsToHost()
    finally:
        wrapped.destroy()
    return losses, dict(model.named_parameters())


def _assert_same(got, want):
    assert_close(got[0], want[0])
    for name, param in want[1].items():
        assert got[1][name].dtype == param.dtype, name
        assert_close(got[1][name], param.detach(), msg=name)


def test_plain_pytorch_refuses_the_mixed_forward():
    # The gap this closes: without the casts, a float32 input to the float16 layer fails.
    x, y = _data()
    with pytest.raises(RuntimeError, match="dtype"):
        Mixed()(x, y)


@pytest.mark.parametrize("behaviour", [None, Behaviour.Default, Behaviour.HalfUpcastToFloat])
def test_default_and_upcast_train_like_explicit_float_casts(behaviour):
    opts = poptorch.Options()
    if behaviour is not None:
        opts.Precision.halfFloatCasting(behaviour)
    x, y = _data()
    _assert_same(_pipetorch_steps(opts, x, y), _plain_steps(torch.float32, x, y))


@pytest.mark.parametrize("setting", ["recomputation", "compiled stage"])
def test_recomputed_and_compiled_forwards_cast_too(setting):
    # A checkpointed forward reruns inside backward, where the first forward's mode is off:
    # the rerun must enter it again, or the float16 layer refuses its float32 input.
    opts = poptorch.Options()
    if setting == "recomputation":
        opts.Training.setRecomputation(True)
    else:
        opts.Jit.compileStages(True, backend="aot_eager")
    x, y = _data()
    _assert_same(_pipetorch_steps(opts, x, y), _plain_steps(torch.float32, x, y))


def test_downcast_trains_like_explicit_half_casts():
    opts = poptorch.Options()
    opts.Precision.halfFloatCasting(Behaviour.FloatDowncastToHalf)
    x, y = _data()
    _assert_same(_pipetorch_steps(opts, x, y), _plain_steps(torch.float16, x, y))


@pytest.mark.slow
@pytest.mark.parametrize("behaviour", [Behaviour.Default, Behaviour.FloatDowncastToHalf])
def test_split_over_two_devices_casts_like_one_device(behaviour):
    # The casts are captured into the stages' graphs, so the workers make them too.
    def opts():
        o = poptorch.Options()
        o.Training.gradientAccumulation(4)
        o.Precision.halfFloatCasting(behaviour)
        return o

    x, y = _data()
    one = _pipetorch_steps(opts(), x, y)
    two = _pipetorch_steps(opts().setExecutionStrategy(poptorch.PipelinedExecution()), x, y,
                           split=True)
    _assert_same(two, one)


@pytest.mark.parametrize("behaviour", list(Behaviour))
def test_in_place_ops_keep_the_output_dtype(behaviour):
    half, full = torch.ones(3, dtype=torch.float16), torch.full((3,), 0.5)
    with HalfFloatCasting(behaviour):
        written = half.add_(full)
        grown = full.mul_(torch.full((3,), 3.0, dtype=torch.float16))
        both = torch.cat([half, full])
    assert written is half and half.dtype == torch.float16
    assert_close(half, torch.full((3,), 1.5, dtype=torch.float16))
    assert grown is full and full.dtype == torch.float32
    assert_close(full, torch.full((3,), 1.5))
    # the out-of-place cat beside them casts its list of operands
    want = torch.float16 if behaviour == Behaviour.FloatDowncastToHalf else torch.float32
    assert both.dtype == want


class Observer(nn.Module):
    """Records whether forward runs under the casting mode (in the class: the wrapper runs a
    copy of the model)."""

    seen: list[bool] = []

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2).to(dtype)

    def forward(self, x):
        stack = torch.overrides._get_current_function_mode_stack()
        Observer.seen.append(any(isinstance(m, HalfFloatCasting) for m in stack))
        return self.fc(x)


@pytest.mark.parametrize("dtype, chosen, active", [
    (torch.float32, False, False), (torch.float16, False, True), (torch.float32, True, True)])
def test_the_mode_runs_only_where_it_can_matter(dtype, chosen, active):
    # A float32 model pays nothing unless the options ask for casting.
    opts = poptorch.Options()
    if chosen:
        opts.Precision.halfFloatCasting(Behaviour.Default)
    Observer.seen.clear()
    wrapped = poptorch.inferenceModel(Observer(dtype), opts)
    wrapped(torch.randn(2, 4))  # the probe and the first call
    wrapped(torch.randn(2, 4))
    wrapped.destroy()
    assert Observer.seen == [active] * 3


def test_a_bad_argument_names_the_accepted_behaviours():
    opts = poptorch.Options()
    accepted = ("one of HalfFloatCastingBehavior.FloatDowncastToHalf, "
                "HalfFloatCastingBehavior.HalfUpcastToFloat, HalfFloatCastingBehavior.Default")
    with pytest.raises(TypeError, match=f"halfFloatCasting: half_float_casting must be {accepted}"
                                        "; got 'half'"):
        opts.Precision.halfFloatCasting("half")
    with pytest.raises(TypeError, match="got 1 \\(int\\)"):
        opts.Precision.halfFloatCasting(1)
    assert opts.Precision.half_float_casting == Behaviour.Default


def test_the_behaviour_reads_back_and_serialises():
    opts = poptorch.Options()
    assert opts.Precision.halfFloatCasting(Behaviour.FloatDowncastToHalf) is opts.Precision
    assert opts.Precision.half_float_casting == Behaviour.FloatDowncastToHalf
    assert opts.toDict()["Precision"]["half_float_casting"] == Behaviour.FloatDowncastToHalf
    assert opts.clone().Precision.half_float_casting == Behaviour.FloatDowncastToHalf
    assert [m.value for m in Behaviour] == [0, 1, 2]  # PopTorch 3.x's values
