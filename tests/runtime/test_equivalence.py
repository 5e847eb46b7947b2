"""The single-device executor equals a hand-written PyTorch loop for every D, G, R and mode."""
import copy

import pytest
import torch
from torch.testing import assert_close

import pipetorch as poptorch
from helpers.models import TinyMLP, data
from helpers.reference import expected_outputs, plain_train_call

MODES = ["All", "EveryN", "Final", "Sum", "Default"]


@pytest.fixture(autouse=True)
def _replicas_in_this_process(monkeypatch):
    """The whole D x G x R x mode grid runs its replicas in this process (LocalEngine): two
    worker start-ups per case would cost minutes. tests/parallel/test_parallel_replicas.py
    checks the same numbers with each replica in its own worker process."""
    monkeypatch.setenv("PIPETORCH_EXECUTION", "local")


def make_options(D, G, R, mode, *, mean=True):
    opts = poptorch.Options().deviceIterations(D).replicationFactor(R)
    opts.Training.gradientAccumulation(G)
    if mode == "EveryN":
        opts.outputMode(poptorch.OutputMode.EveryN, output_return_period=2 if D * G % 2 == 0 else 1)
    else:
        opts.outputMode(getattr(poptorch.OutputMode, mode))
    opts.Training.accumulationAndReplicationReductionType(
        poptorch.ReductionType.Mean if mean else poptorch.ReductionType.Sum)
    return opts.showCompilationProgressBar(False)


@pytest.mark.parametrize("mean", [True, False], ids=["Mean", "Sum"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("R", [1, 2])
@pytest.mark.parametrize("G", [1, 4])
@pytest.mark.parametrize("D", [1, 3])
def test_training_matches_plain_pytorch(D, G, R, mode, mean):
    torch.manual_seed(0)
    model = TinyMLP()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    opts = make_options(D, G, R, mode, mean=mean)
    period = opts.output_return_period
    wrapped = poptorch.trainingModel(
        model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    B = 2
    for call in range(3):
        x, y = data(D * G * R * B, seed=call)
        out, loss = wrapped(x, y)
        rows = plain_train_call(reference, ref_opt, x, y, D=D, G=G, R=R, mean=mean)
        want = "Final" if mode == "Default" else mode
        exp_out, exp_loss = expected_outputs(rows, want, steps=D * G, R=R, period=period)
        assert out.shape == exp_out.shape and loss.shape == exp_loss.shape
        assert_close(out, exp_out)
        assert_close(loss, exp_loss)
    for name, param in reference.named_parameters():
        assert_close(model.get_parameter(name), param, msg=name)


@pytest.mark.parametrize("mode", ["All", "Final", "Sum", "EveryN"])
@pytest.mark.parametrize("R", [1, 2])
@pytest.mark.parametrize("D", [1, 4])
def test_inference_matches_plain_pytorch(D, R, mode):
    torch.manual_seed(1)
    model = TinyMLP()
    opts = poptorch.Options().deviceIterations(D).replicationFactor(R)
    if mode == "EveryN":
        opts.outputMode(poptorch.OutputMode.EveryN, output_return_period=2 if D % 2 == 0 else 1)
    else:
        opts.outputMode(getattr(poptorch.OutputMode, mode))
    wrapped = poptorch.inferenceModel(model, opts)
    x, _ = data(D * R * 3)
    out = wrapped(x)
    with torch.no_grad():
        plain = model(x)
    per_mb = plain.split(3)
    rows = [(i // R, i % R, o, torch.zeros(())) for i, o in enumerate(per_mb)]
    exp, _ = expected_outputs(rows, mode, steps=D, R=R, period=opts.output_return_period)
    assert out.shape == exp.shape
    assert_close(out, exp)


def test_output_shapes_follow_the_table():
    # B=2, D=3, G=4, R=2: one call holds 48 samples.
    torch.manual_seed(0)
    shapes = {}
    for mode, period in [("All", None), ("EveryN", 3), ("Final", None), ("Sum", None)]:
        opts = poptorch.Options().deviceIterations(3).replicationFactor(2)
        opts.Training.gradientAccumulation(4)
        opts.outputMode(getattr(poptorch.OutputMode, mode), **({"output_return_period": period} if period else {}))
        out, loss = poptorch.trainingModel(TinyMLP(), opts)(*data(48))
        shapes[mode] = (tuple(out.shape), tuple(loss.shape))
    assert shapes == {"All": ((48, 3), (24,)), "EveryN": ((16, 3), (8,)),
                      "Final": ((4, 3), (2,)), "Sum": ((4, 3), (2,))}


def test_single_micro_batch_loss_is_zero_dim():
    out, loss = poptorch.trainingModel(TinyMLP())(*data(2))
    assert loss.dim() == 0 and out.shape == (2, 3)
