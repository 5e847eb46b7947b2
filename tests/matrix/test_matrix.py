"""Differential matrix: models x modes x precisions x optimisers, each trained for 3 host calls
through pipetorch and through plain PyTorch on the same micro-batches; losses and outputs of
every call and the weights after every call must agree.

Its first rows are the bug that made it: a model returning its loss first (PopTorch's BERT
tutorial) trained on its last output instead, on one device and split alike.
"""
from __future__ import annotations

import pytest
import torch

import pipetorch as poptorch
from matrix_cases import (MODES, VARIANTS, B, D, ConvNet, MatrixNet, ReplicaBuffers, annotate,
                          assert_same_output, assert_same_state, make_data, plain_call, twin)
from parallel.parallel_cases import cleaned, one_thread_everywhere

CALLS = 3


def sgd(model: torch.nn.Module, torch_module: object, **extra: float) -> torch.optim.Optimizer:
    return torch_module.SGD(model.parameters(), **{"lr": 0.05, "momentum": 0.9, **extra})


def adamw_groups(model: torch.nn.Module, torch_module: object) -> torch.optim.Optimizer:
    """AdamW with parameter groups: no weight decay on biases (the BERT tutorial's groups)."""
    decayed = [p for n, p in model.named_parameters() if not n.endswith("bias")]
    others = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return torch_module.AdamW([{"params": decayed, "weight_decay": 0.01},
                               {"params": others, "weight_decay": 0.0}], lr=0.01)


def run_cell(request, model: torch.nn.Module, mode_name: str, *, optimizer: str = "sgd",
             half: bool = False) -> None:
    mode = MODES[mode_name]
    if mode.processes > 1:
        one_thread_everywhere(request, request.getfixturevalue("monkeypatch"))
    if mode.ipus is not None:
        annotate(model, list(mode.ipus))
    dtype = torch.float16 if half else torch.float32
    model = model.to(dtype)
    plain = twin(model)
    scale = 128.0 if half else 1.0
    if optimizer == "sgd":
        # fp16: plain SGD (no state whose precision could differ), PopTorch's static loss scaling
        extra = {"momentum": 0.0} if half else {}
        ours = sgd(model, poptorch.optim, **extra, **({"loss_scaling": scale} if half else {}))
        theirs = sgd(plain, torch.optim, **extra)
        schedulers = None
    else:
        ours, theirs = adamw_groups(model, poptorch.optim), adamw_groups(plain, torch.optim)
        schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)
                      for o in (ours, theirs)]
    wrapper = cleaned(request, poptorch.trainingModel(model, mode.options(), optimizer=ours))
    buffers = ReplicaBuffers(plain, mode.R)
    tolerance = {"atol": 2e-2, "rtol": 2e-2} if half else {}
    variant = VARIANTS[model.variant]
    for call in range(CALLS):
        inputs = make_data(model, D * mode.G * mode.R * B, call, dtype)
        got = wrapper(*inputs)
        want = plain_call(plain, theirs, inputs, G=mode.G, R=mode.R, loss_of=variant.loss_of,
                          buffers=buffers, loss_scale=scale)
        what = f"{model.variant} {mode_name} call {call}"
        assert_same_output(got, want, what=what, **tolerance)
        assert_same_state(wrapper.model, plain, what=what, **tolerance)
        if schedulers is not None:  # a new learning rate each call, pushed with setOptimizer
            for scheduler in schedulers:
                scheduler.step()
            wrapper.setOptimizer(ours)
    assert torch.isfinite(variant.loss_of(want)).all()


def _slow_unless_local(mode: str) -> list:
    return [] if MODES[mode].processes == 1 else [pytest.mark.slow]


def cells(variants, modes) -> list:
    return [pytest.param(v, m, id=f"{v}-{m}", marks=_slow_unless_local(m))
            for v in variants for m in modes]


# Where forward returns the loss, on one device and pipelined over two.
@pytest.mark.parametrize("variant, mode", cells(VARIANTS, ["one_device", "pipelined_2"]))
def test_loss_position(request, variant, mode):
    torch.manual_seed(0)
    run_cell(request, MatrixNet(variant), mode)


# Every mode with the tutorial's loss-first model and a dict output.
@pytest.mark.parametrize("variant, mode", cells(
    ["first", "dict"], ["sharded_2", "autoincrement_4_on_2", "replicas_2"]))
def test_modes(request, variant, mode):
    torch.manual_seed(1)
    run_cell(request, MatrixNet(variant), mode)


@pytest.mark.parametrize("variant, mode", cells(
    ["last"], ["one_device", "sharded_2", "pipelined_2", "replicas_2"]))
def test_batchnorm_buffers(request, variant, mode):
    torch.manual_seed(2)
    run_cell(request, MatrixNet(variant, batchnorm=True), mode)


@pytest.mark.parametrize("variant, mode", cells(
    ["first"], ["one_device", "sharded_2", "pipelined_2", "replicas_2"]))
def test_cnn(request, variant, mode):
    torch.manual_seed(3)
    run_cell(request, ConvNet(variant), mode)


@pytest.mark.parametrize("variant, mode", cells(["first"], ["sharded_2", "pipelined_2"]))
def test_weight_tied_across_devices(request, variant, mode):
    torch.manual_seed(4)
    run_cell(request, MatrixNet(variant, tied=True), mode)


@pytest.mark.parametrize("variant, mode", cells(["first", "dict"], ["one_device", "pipelined_2"]))
def test_half_with_loss_scaling(request, variant, mode):
    torch.manual_seed(5)
    run_cell(request, MatrixNet(variant), mode, half=True)


@pytest.mark.parametrize("variant, mode", cells(
    ["first"], ["one_device", "pipelined_2", "replicas_2"]))
def test_adamw_groups_with_a_scheduler(request, variant, mode):
    torch.manual_seed(6)
    run_cell(request, MatrixNet(variant), mode, optimizer="adamw")


# Training.pipelineSchedule("zero_bubble"): each stage's backward split into its input's
# gradient and, later, its weights'; and "auto", whichever it picks.
@pytest.mark.parametrize("variant, mode", cells(["first", "dict"], ["zero_bubble_2"])
                         + cells(["last"], ["auto_2", "zero_bubble_2_recomputed",
                                            "zero_bubble_2_replicas_2"]))
def test_zero_bubble(request, variant, mode):
    torch.manual_seed(7)
    run_cell(request, MatrixNet(variant), mode)


@pytest.mark.parametrize("model", ["cnn", "batchnorm", "tied"])
@pytest.mark.slow
def test_zero_bubble_models(request, model):
    torch.manual_seed(8)
    net = {"cnn": lambda: ConvNet("first"), "batchnorm": lambda: MatrixNet("last", batchnorm=True),
           "tied": lambda: MatrixNet("first", tied=True)}[model]()
    run_cell(request, net, "zero_bubble_2")


# Training.pipelineSchedule("interleaved"): a device runs its two stages' micro-batches in
# rounds; "auto" picks by the simulator, then again from the first call's times.
@pytest.mark.parametrize("variant, mode", cells(["first"], ["interleaved_4_on_2"])
                         + cells(["dict"], ["interleaved_zero_bubble_4_on_2", "auto_4_on_2"]))
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_interleaved(request, variant, mode, optimizer):
    torch.manual_seed(9)
    run_cell(request, MatrixNet(variant), mode, optimizer=optimizer)


def test_the_loss_moves():
    """A cell where the loss did not fall would prove little: three calls of SGD lower it."""
    torch.manual_seed(0)
    model = MatrixNet("first")
    opts = poptorch.Options().deviceIterations(2).outputMode(poptorch.OutputMode.All)
    wrapper = poptorch.trainingModel(model, opts, optimizer=poptorch.optim.SGD(
        model.parameters(), lr=0.05, momentum=0.9))
    inputs = make_data(model, 2 * 2, 0, torch.float32)
    losses = [wrapper(*inputs)[0].mean().item() for _ in range(6)]
    assert losses[-1] < losses[0] - 0.05, losses
