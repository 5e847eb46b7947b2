"""16.16, 16.32, bf16 and 32.32 training, state dtypes and loss scaling through trainingModel."""
import copy

import pytest
import torch
from torch.testing import assert_close

import pipetorch as poptorch
from helpers.models import TinyMLP, data
from pipetorch.errors import ConfigError
from pipetorch.optim import scaling

G = 2  # micro-batches per step
B = 2  # micro-batch size


class UpcastMLP(TinyMLP):
    """16.32: float16 inputs (half the bytes host-to-device) into a float32 model."""

    def forward(self, x, labels):
        return super().forward(x.float(), labels)


def options(*, D=1, als=False):
    opts = poptorch.Options().deviceIterations(D).showCompilationProgressBar(False)
    opts.outputMode(poptorch.OutputMode.All)
    opts.Training.gradientAccumulation(G)
    opts.Training.setAutomaticLossScaling(als)
    return opts


def plain_steps(model, optimizer, x, y, *, D=1):
    """D steps by hand, each over G micro-batches, the loss times the optimiser's scale / G."""
    for d in range(D):
        optimizer.zero_grad()
        for g in range(G):
            i = d * G + g
            _, loss = model(x[i * B:(i + 1) * B], y[i * B:(i + 1) * B])
            loss.mul(scaling.loss_scale(optimizer) / G).backward()
        optimizer.step()


def assert_same_weights(model, reference, **tolerances):
    for name, param in reference.named_parameters():
        assert model.get_parameter(name).dtype == param.dtype, name
        assert_close(model.get_parameter(name), param, msg=name, **tolerances)


PRECISIONS = {  # name: (model class, model dtype, input dtype)
    "32.32": (TinyMLP, torch.float32, torch.float32),
    "16.16": (TinyMLP, torch.float16, torch.float16),
    "16.32": (UpcastMLP, torch.float32, torch.float16),
    "bf16": (TinyMLP, torch.bfloat16, torch.bfloat16),
}


@pytest.mark.parametrize("optimizer", ["SGD", "Adam"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_precision_matches_plain_pytorch(precision, optimizer):
    cls, model_dtype, input_dtype = PRECISIONS[precision]
    torch.manual_seed(0)
    model = cls().to(model_dtype)
    reference = copy.deepcopy(model)
    # float16 cannot hold Adam's default eps (1e-8 rounds to 0: 0/0 in plain torch too).
    kwargs = {"SGD": dict(lr=0.05, momentum=0.9), "Adam": dict(lr=0.01, eps=1e-3)}[optimizer]
    make = getattr(poptorch.optim, optimizer)
    ref_opt = make(reference.parameters(), **kwargs)
    wrapped = poptorch.trainingModel(model, options(D=2),
                                     optimizer=make(model.parameters(), **kwargs))
    for call in range(3):
        x, y = data(2 * G * B, seed=call)
        out, loss = wrapped(x.to(input_dtype), y)
        plain_steps(reference, ref_opt, x.to(input_dtype), y, D=2)
    assert out.dtype == model_dtype and loss.dtype == model_dtype
    assert torch.isfinite(loss).all()
    assert_same_weights(model, reference)
    wrapped.destroy()


def test_half_model_keeps_state_in_the_accum_types():
    torch.manual_seed(0)
    model = TinyMLP().half()
    reference = copy.deepcopy(model)
    kwargs = dict(lr=0.01, loss_scaling=256, accum_type=torch.float32,
                  first_order_momentum_accum_type=torch.float16,
                  second_order_momentum_accum_type=torch.float32)
    ref_opt = poptorch.optim.AdamW(reference.parameters(), **kwargs)
    optimizer = poptorch.optim.AdamW(model.parameters(), **kwargs)
    wrapped = poptorch.trainingModel(model, options(), optimizer=optimizer)
    for call in range(3):
        x, y = data(G * B, seed=call)
        wrapped(x.half(), y)
        plain_steps(reference, ref_opt, x.half(), y)
    assert_same_weights(model, reference)
    optimizer.state_dict()  # reading the optimiser brings the device's state to the host
    for opt in (wrapped._compiled.engine.optimizer, optimizer):  # device and host copies
        assert len(opt.state) == 4
        for state in opt.state.values():
            assert state["exp_avg"].dtype == torch.float16
            assert state["exp_avg_sq"].dtype == torch.float32
    for name, state_tensor in ref_opt.state_dict()["state"][0].items():
        assert_close(optimizer.state_dict()["state"][0][name], state_tensor, msg=name)
    wrapped.destroy()


def test_static_loss_scaling_half_matches_plain_loop():
    torch.manual_seed(0)
    model = TinyMLP().half()
    reference = copy.deepcopy(model)
    ref_opt = poptorch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9, loss_scaling=512)
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, loss_scaling=512)
    wrapped = poptorch.trainingModel(model, options(D=2), optimizer=optimizer)
    x, y = data(2 * G * B)
    wrapped(x.half(), y)
    plain_steps(reference, ref_opt, x.half(), y, D=2)
    assert_same_weights(model, reference)
    assert scaling.loss_scale(optimizer) == 512 and not scaling.is_automatic(optimizer)
    wrapped.destroy()


def overflowing(x, step):
    """Inputs whose first micro-batch of step `step` overflows float16 (inf/NaN gradients)."""
    x = x.clone()
    x[step * G * B] = 60000.0
    return x


def als_pair(*, D):
    """A half model wrapped with automatic loss scaling, and a plain copy whose own
    optimiser scales automatically the same way."""
    torch.manual_seed(0)
    model = TinyMLP().half()
    reference = copy.deepcopy(model)
    ref_opt = poptorch.optim.SGD(reference.parameters(), lr=0.2, loss_scaling=1024)
    scaling.enable_automatic_loss_scaling(ref_opt)
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.2, loss_scaling=1024)
    wrapped = poptorch.trainingModel(model, options(D=D, als=True), optimizer=optimizer)
    return model, optimizer, wrapped, reference, ref_opt


def learnable(n, seed):
    x, _ = data(n, seed=seed)
    return x, (x[:, 0] > 0).long()


def test_automatic_loss_scaling_skips_an_overflowing_step_and_converges():
    model, optimizer, wrapped, reference, ref_opt = als_pair(D=1)
    x, y = learnable(G * B, seed=0)
    _, first = wrapped(x.half(), y)
    plain_steps(reference, ref_opt, x.half(), y)
    device_opt = wrapped._compiled.engine.optimizer
    assert scaling.skipped_steps(device_opt) == 0 and scaling.loss_scale(device_opt) == 1024

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _, losses = wrapped(overflowing(x, 0).half(), y)
    plain_steps(reference, ref_opt, overflowing(x, 0).half(), y)
    assert losses[0] > 1000  # finite, but its gradients times the scale overflow float16
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]), name
    assert scaling.skipped_steps(device_opt) == 1 and scaling.loss_scale(device_opt) == 512
    assert scaling.scaling_state(ref_opt) == scaling.scaling_state(device_opt)
    wrapped.copyWeightsToHost()  # the user's optimiser follows the device's, like its state
    assert scaling.scaling_state(optimizer) == {"scale": 512.0, "growth_interval": 2000,
                                                "clean_steps": 0, "skipped_steps": 1,
                                                "used": 1024.0}  # the skipped step's scale
    for call in range(1, 40):
        x, y = learnable(G * B, seed=call % 8)
        _, last = wrapped(x.half(), y)
        plain_steps(reference, ref_opt, x.half(), y)
    assert_same_weights(model, reference)
    assert scaling.skipped_steps(device_opt) == 1
    assert last.float().mean() < 0.5 * first.float().mean(), (first, last)
    wrapped.destroy()


def test_the_scale_is_read_at_every_step_of_a_call():
    model, optimizer, wrapped, reference, ref_opt = als_pair(D=3)
    x, y = learnable(3 * G * B, seed=1)
    wrapped(overflowing(x, 1).half(), y)  # step 1 of 3 skipped: step 2 runs at scale 512
    plain_steps(reference, ref_opt, overflowing(x, 1).half(), y, D=3)
    device_opt = wrapped._compiled.engine.optimizer
    assert scaling.scaling_state(device_opt) == {"scale": 512.0, "growth_interval": 2000,
                                                 "clean_steps": 1, "skipped_steps": 1,
                                                 "used": 512.0}  # the call's last step
    assert_same_weights(model, reference)
    wrapped.destroy()


def test_automatic_loss_scaling_needs_a_pipetorch_optimiser():
    model = TinyMLP()
    wrapped = poptorch.trainingModel(model, options(als=True),
                                     optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = data(G * B)
    with pytest.raises(ConfigError, match=r"setAutomaticLossScaling\(True\) needs a "
                       r"poptorch.optim optimiser.*torch.optim.sgd.SGD.*poptorch.optim.SGD"):
        wrapped(x, y)


def test_a_new_wrapper_continues_from_the_scale_the_optimiser_carries():
    model, optimizer, wrapped, *_ = als_pair(D=1)
    x, y = learnable(G * B, seed=0)
    wrapped(overflowing(x, 0).half(), y)
    wrapped.destroy()  # flushes the weights and the scale to the user's optimiser
    assert scaling.loss_scale(optimizer) == 512
    again = poptorch.trainingModel(model, options(als=True), optimizer=optimizer)
    again(x.half(), y)
    assert scaling.scaling_state(again._compiled.engine.optimizer)["scale"] == 512
    again.destroy()
    without = poptorch.trainingModel(model, options(als=False), optimizer=optimizer)
    without(x.half(), y)
    assert not scaling.is_automatic(without._compiled.engine.optimizer)
    without.destroy()
