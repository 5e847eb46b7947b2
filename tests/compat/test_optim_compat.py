"""Issue 17 group 3: PopTorch's optimiser API (variable_attrs, ipu_state, use_combined_accum,
the NoBias variants, setOptimizer), compared with plain PyTorch."""
import copy
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.testing import assert_close

import pipetorch as poptorch
from helpers.models import regression_data
from helpers.reference import assert_same_weights, plain_steps


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x, y):
        out = self.fc(x)
        return out, F.mse_loss(out, y)


def _data(seed=0, steps=3):
    return regression_data(steps, inputs=4, outputs=3, seed=seed)


# --- variable_attrs ---------------------------------------------------------------------------
def test_variable_attrs_defaults_and_marks():
    opt = poptorch.optim.SGD(Net().parameters(), lr=0.1)
    attrs = opt.variable_attrs
    assert not attrs.isConstant("lr")
    assert attrs.isConstant("momentum") and attrs.isConstant("weight_decay")
    assert not poptorch.optim.SGD(Net().parameters(), lr=0.1,
                                  momentum=0.9).variable_attrs.isConstant("momentum")
    attrs.markAsVariable("momentum")
    assert not attrs.isConstant("momentum")
    attrs.markAsConstant("momentum")
    assert attrs.isConstant("momentum")
    with pytest.raises(ValueError, match="Unknown optimizer attribute 'nope'"):
        attrs.markAsConstant("nope")
    adamw = poptorch.optim.AdamW(Net().parameters())
    assert adamw.variable_attrs.isConstant("weight_decay")  # AdamW's default 1e-2
    assert isinstance(attrs, poptorch.optim.VariableAttributes)


def test_changing_a_constant_attribute_is_refused_and_a_variable_one_trains_like_torch():
    torch.manual_seed(0)
    model = Net()
    plain = copy.deepcopy(model)
    data = _data()
    opt = poptorch.optim.SGD(model.parameters(), lr=0.1)
    wrapped = poptorch.trainingModel(model, optimizer=opt)
    wrapped(*data[0])
    with pytest.raises(ValueError, match="'momentum' of param group 0 is constant.*markAsVariable"):
        wrapped.setOptimizer(poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5))
    wrapped.destroy()

    model, data = copy.deepcopy(plain), _data(1)
    reference = copy.deepcopy(plain)
    opt = poptorch.optim.SGD(model.parameters(), lr=0.1)
    opt.variable_attrs.markAsVariable("momentum")
    wrapped = poptorch.trainingModel(model, optimizer=opt)
    wrapped(*data[0])
    wrapped.setOptimizer(poptorch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5))
    wrapped(*data[1])
    plain_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    plain_steps(reference, plain_opt, data[:1])
    plain_opt.param_groups[0].update(lr=0.05, momentum=0.5)
    plain_steps(reference, plain_opt, data[1:2])
    assert_same_weights(model, reference)


def test_unexpected_attributes_are_ignored_with_poptorchs_warning(caplog):
    model = Net()
    opt = poptorch.optim.SGD(model.parameters(), lr=0.1)
    wrapped = poptorch.trainingModel(model, optimizer=opt)
    wrapped(*_data()[0])
    opt.param_groups[0]["my_flag"] = 1
    opt.custom = "x"
    with caplog.at_level(logging.WARNING, logger="pipetorch.optim.attributes"):
        wrapped.setOptimizer(opt)
        wrapped.setOptimizer(opt)  # each message once
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["Ignoring unexpected optimizer attribute in SGD optimizer: ['custom']",
                        "Ignoring unexpected group 0 attribute in SGD optimizer: ['my_flag']"]


@pytest.mark.parametrize("relaxed", [False, True])
def test_a_group_key_added_after_compiling_is_warned_about_unless_relaxed(relaxed, caplog):
    # PopTorch's test_extra_attributes(2): `initial_lr` set on the groups after the first call
    # is an unexpected group attribute; relaxOptimizerAttributesChecks (ignored before) makes
    # both messages debug lines. The steps still equal plain PyTorch's.
    model = Net()
    reference = copy.deepcopy(model)
    data = _data(steps=2)
    opts = poptorch.Options()
    if relaxed:
        opts.relaxOptimizerAttributesChecks()
    opt = poptorch.optim.SGD(model.parameters(), lr=0.1)
    wrapped = poptorch.trainingModel(model, opts, optimizer=opt)
    wrapped(*data[0])
    opt.param_groups[0]["initial_lr"] = 0.1
    opt.step = 0
    with caplog.at_level(logging.DEBUG, logger="pipetorch.optim.attributes"):
        wrapped.setOptimizer(opt)
    levels = {r.getMessage(): r.levelno for r in caplog.records}
    want = logging.DEBUG if relaxed else logging.WARNING
    assert levels == {"Ignoring unexpected optimizer attribute in SGD optimizer: ['step']": want,
                      "Ignoring unexpected group 0 attribute in SGD optimizer: ['initial_lr']":
                      want}
    wrapped(*data[1])
    plain_steps(reference, torch.optim.SGD(reference.parameters(), lr=0.1), data)
    assert_same_weights(model, reference)


# --- setOptimizer --------------------------------------------------------------------------
def test_set_optimizer_takes_a_new_optimizer_of_the_same_class():
    torch.manual_seed(1)
    model = Net()
    reference = copy.deepcopy(model)
    data = _data(2)
    opt = poptorch.optim.Adam(model.parameters(), lr=0.01)
    wrapped = poptorch.trainingModel(model, optimizer=opt)
    wrapped(*data[0])
    new = poptorch.optim.Adam(model.parameters(), lr=0.002)
    wrapped.setOptimizer(new)
    wrapped(*data[1])
    plain_opt = torch.optim.Adam(reference.parameters(), lr=0.01)
    plain_steps(reference, plain_opt, data[:1])
    plain_opt.param_groups[0]["lr"] = 0.002
    plain_steps(reference, plain_opt, data[1:2])
    assert_same_weights(model, reference)
    # the new optimiser now holds the device's state (Adam's step count 2)
    assert float(new.state_dict()["state"][0]["step"]) == 2.0


# --- ipu_state ---------------------------------------------------------------------------------
def test_state_dict_carries_ipu_state_matching_torch_momentum():
    torch.manual_seed(2)
    model = Net()
    reference = copy.deepcopy(model)
    data = _data(3)
    opt = poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    assert opt.state_dict()["ipu_state"] is None  # nothing on a device yet
    wrapped = poptorch.trainingModel(model, optimizer=opt)
    for x, y in data:
        wrapped(x, y)
    plain_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    plain_steps(reference, plain_opt, data)
    state = opt.state_dict()["ipu_state"]
    assert sorted(state) == ["Accl___model.fc.bias", "Accl___model.fc.weight"]
    assert_close(state["Accl___model.fc.weight"],
                 plain_opt.state[reference.fc.weight]["momentum_buffer"])
    assert_close(opt.read_ipu_state()["Accl___model.fc.bias"],
                 plain_opt.state[reference.fc.bias]["momentum_buffer"])


def test_ipu_state_loaded_into_a_new_run_continues_training():
    torch.manual_seed(3)
    model = Net()
    reference = copy.deepcopy(model)
    data = _data(4, steps=4)
    opt = poptorch.optim.Adam(model.parameters(), lr=0.01)
    wrapped = poptorch.trainingModel(model, optimizer=opt)
    for x, y in data[:2]:
        wrapped(x, y)
    saved_weights, saved = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    wrapped.destroy()
    assert {"Accl1___model.fc.weight", "Accl2___model.fc.weight",
            "Step___model.fc.weight"} <= set(saved["ipu_state"])

    resumed = Net()
    resumed.load_state_dict(saved_weights)
    new_opt = poptorch.optim.Adam(resumed.parameters(), lr=0.01)
    # Only the PopTorch part: the torch part is dropped to show ipu_state alone restores it.
    new_opt.load_state_dict({**new_opt.state_dict(), "ipu_state": saved["ipu_state"]})
    wrapped = poptorch.trainingModel(resumed, optimizer=new_opt)
    for x, y in data[2:]:
        wrapped(x, y)
    plain_steps(reference, torch.optim.Adam(reference.parameters(), lr=0.01), data)
    assert_same_weights(resumed, reference)


def test_ipu_state_has_loss_scale_update_factor_with_automatic_loss_scaling():
    model = Net()
    opts = poptorch.Options()
    opts.Training.setAutomaticLossScaling(True)
    opt = poptorch.optim.SGD(model.parameters(), lr=0.1, loss_scaling=64.0)
    wrapped = poptorch.trainingModel(model, opts, optimizer=opt)
    wrapped(*_data()[0])
    state = opt.read_ipu_state()
    assert_close(state["lossScaleUpdateFactor"], torch.tensor(1.0))  # no overflow yet
    wrapped.destroy()

    # Written before compiling: the run starts from scale 64 * 4.
    model = Net()
    opt = poptorch.optim.SGD(model.parameters(), lr=0.1, loss_scaling=64.0)
    opt.write_ipu_state({"lossScaleUpdateFactor": torch.tensor(4.0)})
    wrapped = poptorch.trainingModel(model, opts, optimizer=opt)
    wrapped(*_data()[0])
    assert_close(opt.read_ipu_state()["lossScaleUpdateFactor"], torch.tensor(4.0))


def test_write_ipu_state_before_training_with_an_incomplete_state(caplog):
    torch.manual_seed(4)
    model = Net()
    reference = copy.deepcopy(model)
    data = _data(5)
    velocity = torch.full((3, 4), 0.25)
    opt = poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt.write_ipu_state({"Accl___model.fc.weight": velocity})  # the bias is left out
    wrapped = poptorch.trainingModel(model, optimizer=opt)
    with caplog.at_level(logging.WARNING, logger="pipetorch.optim.ipu_state"):
        wrapped(*data[0])
    assert "sets no state for 1 parameter(s) (model.fc.bias)" in caplog.text

    plain_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    plain_opt.state[reference.fc.weight]["momentum_buffer"] = velocity.clone()
    plain_steps(reference, plain_opt, data[:1])
    assert_same_weights(model, reference)

    # Written after compiling: the device takes it at once.
    opt.write_ipu_state({"Accl___model.fc.bias": torch.zeros(3),
                         "Accl___model.fc.weight": torch.zeros(3, 4)})
    wrapped(*data[1])
    plain_opt.state[reference.fc.weight]["momentum_buffer"].zero_()
    plain_opt.state[reference.fc.bias]["momentum_buffer"].zero_()
    plain_steps(reference, plain_opt, data[1:2])
    assert_same_weights(model, reference)
    with pytest.raises(ValueError, match="does not hold.*'Accl___model.other.weight'"):
        opt.write_ipu_state({"Accl___model.other.weight": torch.zeros(1)})


# --- use_combined_accum and the NoBias variants ------------------------------------------
def test_sgd_use_combined_accum_trains_like_torch():
    torch.manual_seed(5)
    model = Net()
    reference = copy.deepcopy(model)
    data = _data(6)
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(2)
    opt = poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, dampening=0.1,
                             weight_decay=0.01, use_combined_accum=True, velocity_scaling=8.0)
    wrapped = poptorch.trainingModel(model, opts, optimizer=opt)
    for x, y in data:
        wrapped(x, y)
    plain_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9, dampening=0.1,
                                weight_decay=0.01)
    for x, y in data:
        plain_opt.zero_grad()
        for half in (slice(0, 2), slice(2, 4)):
            (reference(x[half], y[half])[1] / 2).backward()
        plain_opt.step()
    assert_same_weights(model, reference)


@pytest.mark.parametrize("name", ["AdamWNoBias", "LAMBNoBias"])
def test_no_bias_variants_match_their_formula(name):
    torch.manual_seed(6)
    model = Net()
    start = copy.deepcopy(model)
    x, y = _data(7, steps=1)[0]
    cls = getattr(poptorch.optim, name)
    opt = cls(model.parameters(), lr=0.01, weight_decay=0.1)
    assert opt.param_groups[0]["bias_correction"] is False
    poptorch.trainingModel(model, optimizer=opt)(x, y)
    start(x, y)[1].backward()
    for (param_name, p0), p1 in zip(start.named_parameters(), model.parameters()):
        g = p0.grad
        update = (0.1 * g) / ((0.001 * g * g).sqrt() + 1e-8)  # m / (sqrt(v) + eps), no correction
        if name == "AdamWNoBias":
            want = p0.detach() * (1 - 0.01 * 0.1) - 0.01 * update
        else:
            update = update + 0.1 * p0.detach()
            trust = p0.detach().norm() / update.norm()
            want = p0.detach() - 0.01 * trust * update
        assert_close(p1.detach(), want, msg=param_name)
    with pytest.raises(ValueError, match="never corrects the bias"):
        cls(model.parameters(), bias_correction=True)
