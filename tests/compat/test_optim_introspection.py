"""Issue 22: the optimiser introspection PopTorch scripts use (state_dict's ipu_state and
ipu_param, poptorch.optim.Optimizer, variable_attrs, warnings about Python code PopTorch
would not run, automatic loss scaling's option names), compared with PopTorch's documented
behaviour and, where numbers are involved, with plain PyTorch."""
import copy
import logging

import pytest
import torch
from torch.optim.lr_scheduler import ExponentialLR
from torch.testing import assert_close

import pipetorch as poptorch
from helpers.models import Regressor, regression_data
from helpers.reference import assert_same_weights, plain_steps
from pipetorch.optim import scaling

ALS_KEY = "automaticLossScalingSettings.enabled"


def _data(steps=3, seed=1):
    return regression_data(steps, inputs=3, outputs=2, seed=seed)


POPTORCH = [poptorch.optim.SGD, poptorch.optim.Adam, poptorch.optim.AdamW,
            poptorch.optim.RMSprop, poptorch.optim.LAMB]


# --- state_dict: ipu_state and ipu_param -------------------------------------------------
@pytest.mark.parametrize("cls", POPTORCH, ids=lambda c: c.__name__)
def test_state_dict_holds_ipu_state_and_ipu_param_once_compiled(cls):
    # PopTorch's test_read_ipu_state: both None before compiling, filled by compile().
    lr, wd, ls = 0.05, 0.025, 0.75
    model = Regressor()
    optimizer = cls(model.parameters(), lr=lr, weight_decay=wd, loss_scaling=ls)
    wrapped = poptorch.trainingModel(model, optimizer=optimizer)
    state = optimizer.state_dict()
    assert state["ipu_state"] is None and state["ipu_param"] is None
    wrapped.compile(*_data(1)[0])
    s0 = optimizer.state_dict()
    assert all(isinstance(k, str) and isinstance(v, torch.Tensor)
               for part in ("ipu_state", "ipu_param") for k, v in s0[part].items())
    params = s0["ipu_param"]
    assert_close(params["lossScaling_FLOAT"], torch.tensor(ls))
    if cls is poptorch.optim.SGD:
        # PopART's SGD0: lr (1 - dampening) / loss_scaling and 1 - lr (1 - dampening) wd
        assert_close(params["scaledLearningRate0___specific___model.lin.bias"],
                     torch.tensor(lr / ls))
        assert_close(params["weightDecayScaleFactor0___specific___model.lin.weight"],
                     torch.tensor(1 - lr * wd))
        assert s0["ipu_state"] == {}  # no momentum: SGD keeps no state
        return
    assert_close(params["learningRate___specific___model.lin.bias"], torch.tensor(lr))
    assert_close(params["weightDecay___specific___model.lin.weight"], torch.tensor(wd))
    assert {"Accl1___model.lin.weight", "Accl1___model.lin.bias"} <= set(s0["ipu_state"])
    wrapped(*_data(1)[0])
    s1 = optimizer.state_dict()
    assert not all(torch.equal(s0["ipu_state"][k], s1["ipu_state"][k]) for k in s0["ipu_state"])


def test_the_compiled_state_is_the_one_torch_starts_from():
    # Reading the state before the first step and writing it back changes no number.
    model, reference = Regressor(), Regressor()
    data = _data()
    optimizer = poptorch.optim.Adam(model.parameters(), lr=0.01)
    wrapped = poptorch.trainingModel(model, optimizer=optimizer)
    wrapped.compile(*data[0])
    s0 = optimizer.state_dict()
    assert_close(s0["ipu_state"]["Accl2___model.lin.weight"], torch.zeros(2, 3), rtol=0, atol=0)
    assert_close(s0["ipu_state"]["Step___model.lin.weight"], torch.tensor(0.0), rtol=0, atol=0)
    optimizer.load_state_dict(s0)
    for x, y in data:
        wrapped(x, y)
    plain_steps(reference, torch.optim.Adam(reference.parameters(), lr=0.01), data)
    assert_same_weights(model, reference)


def test_written_ipu_state_and_ipu_param_read_back_and_drive_the_next_step():
    # PopTorch's test_write_ipu_state: random values written, read back, then used.
    model, reference = Regressor(), Regressor()
    data = _data(2)
    optimizer = poptorch.optim.Adam(model.parameters(), lr=0.01)
    wrapped = poptorch.trainingModel(model, optimizer=optimizer)
    wrapped.compile(*data[0])
    s0 = optimizer.state_dict()
    gen = torch.Generator().manual_seed(7)
    for key in s0["ipu_state"]:
        if key.startswith("Accl"):
            s0["ipu_state"][key] = torch.rand(s0["ipu_state"][key].shape, generator=gen)
    for key in s0["ipu_param"]:
        if key.startswith("learningRate"):
            s0["ipu_param"][key] = torch.tensor(0.03)
    optimizer.load_state_dict(s0)
    s1 = optimizer.state_dict()
    for part in ("ipu_state", "ipu_param"):
        for key, value in s0[part].items():
            assert_close(s1[part][key], value, rtol=0, atol=0, msg=key)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.03)

    plain = torch.optim.Adam(reference.parameters(), lr=0.03)
    for name, param in reference.named_parameters():
        plain.state[param] = {"step": torch.tensor(0.0),
                              "exp_avg": s0["ipu_state"][f"Accl1___model.{name}"].clone(),
                              "exp_avg_sq": s0["ipu_state"][f"Accl2___model.{name}"].clone()}
    for x, y in data:
        wrapped(x, y)
    plain_steps(reference, plain, data)
    assert_same_weights(model, reference)
    assert_close(optimizer.state_dict()["ipu_param"]["learningRate___specific___model.lin.bias"],
                 torch.tensor(0.03))


def test_a_checkpoint_restores_the_learning_rate_and_the_state(tmp_path):
    # PopTorch's test_write_ipu_state_from_checkpoint, here rewinding a running model's
    # optimiser to the checkpoint, against plain PyTorch doing the same.
    model, reference = Regressor(), Regressor()
    data = _data(4)
    optimizer = poptorch.optim.Adam(model.parameters(), lr=1.0)
    scheduler = ExponentialLR(optimizer, 0.5)
    wrapped = poptorch.trainingModel(model, optimizer=optimizer)
    wrapped(*data[0])
    scheduler.step()  # lr 1.0 -> 0.5
    wrapped.setOptimizer(optimizer)
    s1 = optimizer.state_dict()
    torch.save({"optimizer_state_dict": s1}, tmp_path / "checkpoint.pt")
    wrapped(*data[1])  # the device's state moves on past the checkpoint

    checkpoint = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    optimizer = poptorch.optim.Adam(model.parameters(), lr=0.1)
    optimizer.load_state_dict(checkpoint["optimizer_state_dict"])
    s2 = optimizer.state_dict()  # not compiled with it yet: what was loaded, as in PopTorch
    for part in ("ipu_state", "ipu_param"):
        for key, value in s1[part].items():
            assert_close(s2[part][key], value, rtol=0, atol=0, msg=key)
    wrapped.setOptimizer(optimizer)
    for x, y in data[2:]:
        wrapped(x, y)
    s3 = optimizer.state_dict()
    assert s3["param_groups"][0]["lr"] == 0.5
    assert_close(s3["ipu_param"]["learningRate___specific___model.lin.bias"], torch.tensor(0.5))
    assert_close(s3["ipu_state"]["Step___model.lin.bias"], torch.tensor(3.0))

    plain = torch.optim.Adam(reference.parameters(), lr=1.0)
    plain_steps(reference, plain, data[:1])
    plain.param_groups[0]["lr"] = 0.5
    saved = copy.deepcopy(plain.state_dict())
    plain_steps(reference, plain, data[1:2])
    plain.load_state_dict(saved)
    plain_steps(reference, plain, data[2:])
    assert_same_weights(model, reference)


def test_ipu_param_names_must_be_the_optimisers():
    # (a parameter's own value is kept since issue 40: tests/compat/test_per_param_optim.py)
    model = Regressor()
    optimizer = poptorch.optim.RMSprop(model.parameters(), lr=0.01)
    wrapped = poptorch.trainingModel(model, optimizer=optimizer)
    wrapped.compile(*_data(1)[0])
    with pytest.raises(ValueError,
                       match="does not hold: 'beta1___specific___model.lin.bias'.*alpha"):
        optimizer.load_state_dict({**optimizer.state_dict(), "ipu_param": {
            "beta1___specific___model.lin.bias": torch.tensor(0.5)}})


def test_a_loaded_ipu_param_keeps_the_groups_exact_values():
    # ipu_param holds float32 scalars: loading a checkpoint turned lr 0.01 into
    # 0.009999999776, and a resumed run no longer repeated the saved one's losses.
    model = Regressor()
    optimizer = poptorch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.9))
    wrapped = poptorch.trainingModel(model, optimizer=optimizer)
    wrapped(*_data(1)[0])
    saved = optimizer.state_dict()
    wrapped.destroy()
    restored = poptorch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.9))
    restored.load_state_dict(saved)
    poptorch.trainingModel(model, optimizer=restored).compile(*_data(1)[0])
    assert restored.param_groups[0]["lr"] == 0.01
    assert restored.param_groups[0]["betas"] == (0.8, 0.9)


# --- poptorch.optim.Optimizer ------------------------------------------------------------
class PopTorchStyleAdamW(poptorch.optim.Optimizer, torch.optim.AdamW):
    """Written as PopTorch writes its optimisers (seed 002 shows its AdamW)."""

    def __init__(self, params, lr=1e-3, loss_scaling=None):
        poptorch.optim.Optimizer.__init__(self)
        torch.optim.AdamW.__init__(self, params, lr)
        self.loss_scaling = loss_scaling


def test_poptorch_optim_optimizer_is_the_base_and_subclasses_in_its_style_train():
    assert all(issubclass(cls, poptorch.optim.Optimizer) for cls in POPTORCH)
    assert not isinstance(torch.optim.SGD(Regressor().parameters(), lr=0.1), poptorch.optim.Optimizer)
    model, reference = Regressor(), Regressor()
    data = _data()
    optimizer = PopTorchStyleAdamW(model.parameters(), lr=0.01, loss_scaling=64.0)
    assert optimizer.loss_scaling == 64.0 and optimizer.max_grad_norm == float("inf")
    wrapped = poptorch.trainingModel(model, optimizer=optimizer)
    for x, y in data:
        wrapped(x, y)
    plain_steps(reference, torch.optim.AdamW(reference.parameters(), lr=0.01), data)
    assert_same_weights(model, reference)
    state = optimizer.state_dict()
    assert "Accl1___model.lin.weight" in state["ipu_state"]
    assert_close(state["ipu_param"]["lossScaling_FLOAT"], torch.tensor(64.0))


# --- variable_attrs ------------------------------------------------------------------------
@pytest.mark.parametrize("cls, args", [
    (poptorch.optim.SGD, dict(momentum=0.0, dampening=0.0, weight_decay=0.0)),
    (poptorch.optim.Adam, dict(betas=(0.9, 0.999), eps=1e-08, weight_decay=0.0)),
    (poptorch.optim.AdamW, dict(betas=(0.9, 0.999), eps=1e-08, weight_decay=0.01)),
    (poptorch.optim.RMSprop, dict(momentum=0.0, eps=1e-08, weight_decay=0.0)),
], ids=lambda value: getattr(value, "__name__", ""))
def test_arguments_passed_explicitly_are_variable(cls, args):
    # PopTorch's test_variable_default: its default values, passed explicitly, are variable;
    # left out, they are constant (and so they are for torch's own optimiser).
    given = cls(Regressor().parameters(), lr=1.0, **args).variable_attrs
    left_out = cls(Regressor().parameters(), lr=1.0).variable_attrs
    torch_opt = getattr(torch.optim, cls.__name__)(Regressor().parameters(), lr=1.0, **args)
    for name in args:
        assert not given.isConstant(name), name
        assert left_out.isConstant(name), name
        assert poptorch.optim.VariableAttributes([], [name]).isConstant(name)
    assert not given.isConstant("lr") and not left_out.isConstant("lr")
    assert torch_opt.param_groups[0]["lr"] == 1.0  # torch's optimiser has no variable_attrs


def test_loss_scaling_passed_explicitly_may_change_through_set_optimizer():
    # PopTorch's test_optimizer_const: loss_scaling=1.0 given, then 2.0 via setOptimizer.
    model, reference = Regressor(), Regressor()
    data = _data()
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.1, loss_scaling=1.0)
    wrapped = poptorch.trainingModel(model, optimizer=optimizer)
    wrapped(*data[0])
    optimizer.loss_scaling = 2.0
    wrapped.setOptimizer(optimizer)
    for x, y in data[1:]:
        wrapped(x, y)
    plain_steps(reference, torch.optim.SGD(reference.parameters(), lr=0.1), data)
    assert_same_weights(model, reference)
    # Left at its default it is compiled in, as in PopTorch, unless marked variable.
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.1)
    wrapped.destroy()
    wrapped = poptorch.trainingModel(model, optimizer=optimizer)
    wrapped(*data[0])
    optimizer.loss_scaling = 2.0
    with pytest.raises(ValueError, match="'loss_scaling' of param group 0 is constant"):
        wrapped.setOptimizer(optimizer)


def test_poptorchs_private_names_mark_everything_variable():
    # PopTorch's own tests do this to make every attribute variable.
    optimizer = poptorch.optim.SGD(Regressor().parameters(), lr=0.1)
    attrs = optimizer.variable_attrs
    assert attrs.isConstant("momentum")
    attrs._variable_attributes = copy.deepcopy(attrs._allowed_attributes)
    assert not any(attrs.isConstant(name) for name in attrs._allowed_attributes)


# --- Python code PopTorch would not run -------------------------------------------------
class LoggingSGD(poptorch.optim.SGD):
    def step(self, closure=None):
        self.calls = getattr(self, "calls", 0) + 1
        return super().step(closure)


class ZeroingAdam(poptorch.optim.Adam):
    def zero_grad(self, set_to_none=True):
        super().zero_grad(set_to_none)


def _train_once(optimizer, model):
    wrapped = poptorch.trainingModel(model, optimizer=optimizer)
    wrapped(*_data(1)[0])
    wrapped.destroy()


def test_overridden_step_and_zero_grad_are_named_in_a_warning_once(caplog):
    logger = "pipetorch.runtime.optimizer"
    with caplog.at_level(logging.WARNING, logger=logger):
        model = Regressor()
        _train_once(LoggingSGD(model.parameters(), lr=0.1), model)
        _train_once(LoggingSGD(model.parameters(), lr=0.1), model)  # once per message
        _train_once(ZeroingAdam(model.parameters(), lr=0.1), model)
        _train_once(poptorch.optim.SGD(model.parameters(), lr=0.1), model)  # nothing to say
    messages = [r.getMessage() for r in caplog.records if r.name == logger]
    assert len(messages) == 2, messages
    assert messages[0].startswith("LoggingSGD.step() overrides SGD.step(): PopTorch never "
                                  "runs an optimiser's Python step()")
    assert messages[1].startswith("ZeroingAdam.zero_grad() overrides Adam.zero_grad()")


def test_step_hooks_and_other_optimiser_types_are_named_in_a_warning(caplog):
    logger = "pipetorch.runtime.optimizer"
    model = Regressor()
    hooked = poptorch.optim.Adam(model.parameters(), lr=0.1)
    hooked.register_step_post_hook(lambda *args: None)
    with caplog.at_level(logging.WARNING, logger=logger):
        _train_once(hooked, model)
        _train_once(torch.optim.Adagrad(model.parameters(), lr=0.1), model)
    messages = [r.getMessage() for r in caplog.records if r.name == logger]
    assert messages == [
        "Adam has 1 step hook(s) (register_step_pre_hook / register_step_post_hook) that "
        "PopTorch would not run; pipetorch runs them at every optimiser step",
        "Adagrad is not one of PopTorch's optimisers (SGD, Adam, AdamW, RMSprop, LAMB, from "
        "torch.optim or poptorch.optim): PopTorch refuses it; pipetorch runs its step() as "
        "written"]


# --- automatic loss scaling under PopTorch's names -------------------------------------
def test_automatic_loss_scaling_reads_back_under_poptorchs_popart_option():
    opts = poptorch.Options()
    assert ALS_KEY not in opts._Popart.options and not opts.Training.auto_loss_scaling
    opts.Training.setAutomaticLossScaling(True)
    assert opts._Popart.options[ALS_KEY] is True
    assert opts.clone()._Popart.options[ALS_KEY] is True
    opts.Training.setAutomaticLossScaling(False)
    assert opts._Popart.options[ALS_KEY] is False and not opts.Training.auto_loss_scaling
    with pytest.raises(TypeError, match="enabled must be True or False"):
        opts._Popart.set(ALS_KEY, 1)


def test_the_popart_option_turns_automatic_loss_scaling_on():
    # PopTorch's setAutomaticLossScaling only sets this PopART option: setting it directly
    # is the same, and the optimiser then reports lossScaleUpdateFactor.
    model, reference = Regressor(), Regressor()
    data = _data()
    opts = poptorch.Options()
    opts._Popart.set(ALS_KEY, True)
    assert opts.Training.auto_loss_scaling
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.1, loss_scaling=8.0)
    wrapped = poptorch.trainingModel(model, opts, optimizer=optimizer)
    for x, y in data:
        wrapped(x, y)
    assert_close(optimizer.state_dict()["ipu_state"]["lossScaleUpdateFactor"], torch.tensor(1.0))
    assert scaling.is_automatic(optimizer) and scaling.loss_scale(optimizer) == 8.0
    plain_steps(reference, torch.optim.SGD(reference.parameters(), lr=0.1), data)
    assert_same_weights(model, reference)


def test_names_are_poptorchs_under_model_and_writes_take_either_spelling():
    # PopTorch's IR holds the user's model as `model`: its test_read_ipu_state reads
    # "learningRate___specific___model.lin.bias"; pipetorch named it "...___lin.bias" before.
    model, reference = Regressor(), Regressor()
    data = _data(3)
    optimizer = poptorch.optim.Adam(model.parameters(), lr=0.01)
    wrapped = poptorch.trainingModel(model, optimizer=optimizer)
    wrapped.compile(*data[0])
    s0 = optimizer.state_dict()
    names = [n for n, _ in model.named_parameters()]
    assert {f"Accl1___model.{n}" for n in names} <= set(s0["ipu_state"])
    assert {f"learningRate___specific___model.{n}" for n in names} <= set(s0["ipu_param"])
    # the old spelling, without `model.`, sets the same values
    optimizer.load_state_dict({**s0, "ipu_param": {f"learningRate___specific___{n}":
                                                   torch.tensor(0.05) for n in names}})
    assert_close(optimizer.state_dict()["ipu_param"]["learningRate___specific___model.lin.bias"],
                 torch.tensor(0.05))
    for x, y in data:
        wrapped(x, y)
    plain_steps(reference, torch.optim.Adam(reference.parameters(), lr=0.05), data)
    assert_same_weights(model, reference)
