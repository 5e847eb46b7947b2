"""Issue 32, group 2: writing an optimiser's state (`load_state_dict` with an "ipu_state" that
is incomplete, written before compiling, or a CPU-trained optimiser's), reading it when
detached, offline or cached, LR schedulers and setOptimizer with frozen options, as
PopTorch's optimizer tests use them; every training run is compared with plain PyTorch."""
import copy
import logging

import pytest
import torch
import torch.nn as nn
from torch.optim.lr_scheduler import ExponentialLR
from torch.testing import assert_close

import pipetorch as poptorch
from pipetorch import log_level
from helpers.models import Regressor, regression_data
from helpers.reference import assert_same_weights, plain_steps

LOG = "pipetorch.runtime.executor"
# PopTorch's tensor-name prefixes -> torch's state keys, per family (plain torch references)
KEYS = {
    "SGD": {"Accl": "momentum_buffer"},
    "Adam": {"Accl1": "exp_avg", "Accl2": "exp_avg_sq", "Step": "step"},
    "AdamW": {"Accl1": "exp_avg", "Accl2": "exp_avg_sq", "Step": "step"},
    "RMSprop": {"Accl1": "square_avg", "Accl2": "momentum_buffer", "Step": "step"},
}
FAMILIES = [  # (pipetorch optimiser, plain torch optimiser, arguments)
    (poptorch.optim.SGD, torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    (poptorch.optim.Adam, torch.optim.Adam, {"lr": 0.01}),
    (poptorch.optim.AdamW, torch.optim.AdamW, {"lr": 0.01}),
    (poptorch.optim.RMSprop, torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5}),
]


@pytest.fixture(autouse=True)
def _fresh_repeat_counts(monkeypatch):
    # maxRepeatLogs mutes a message repeated back to back: count from 0 in each test
    monkeypatch.setattr(log_level._repeat_filter, "_last", None)


def _data(steps=3, seed=1):
    return regression_data(steps, inputs=3, outputs=2, seed=seed)


def _torch_state(ipu_state, model, family):
    """The plain torch optimiser state that PopTorch's named state stands for."""
    state = {}
    for key, value in ipu_state.items():
        prefix, _, name = key.partition("___")
        param = model.get_parameter(name.removeprefix("model."))  # PopTorch's IR root
        state.setdefault(param, {})[KEYS[family][prefix]] = value.clone()
    return state


def _with_state(optimizer, state):
    for param, slot in state.items():
        optimizer.state[param] = {k: v.clone() for k, v in slot.items()}
    return optimizer


# --- writing the state on a compiled model --------------------------------------------
@pytest.mark.parametrize("cls, plain_cls, kwargs", FAMILIES, ids=lambda c: getattr(c, "__name__", ""))
def test_an_incomplete_state_written_after_compiling_merges_and_trains_like_torch(
        cls, plain_cls, kwargs):
    # PopTorch's test_write_ipu_state(incomplete_state=True): one tensor left out, the others
    # random; the left-out one keeps the device's value, the rest are the written ones.
    model, reference = Regressor(), Regressor()
    data = _data()
    optimizer = cls(model.parameters(), **kwargs)
    wrapped = poptorch.trainingModel(model, optimizer=optimizer)
    wrapped(*data[0])  # a step first: the state left out is not all zeros
    plain = plain_cls(reference.parameters(), **kwargs)
    plain_steps(reference, plain, data[:1])

    s0 = optimizer.state_dict()
    moments = sorted(k for k in s0["ipu_state"] if k.startswith("Accl"))
    left_out = moments[0]
    kept = s0["ipu_state"].pop(left_out)
    gen = torch.Generator().manual_seed(3)
    for key in moments[1:]:
        s0["ipu_state"][key] = torch.rand(s0["ipu_state"][key].shape, generator=gen)
    optimizer.load_state_dict(s0)
    s1 = optimizer.state_dict()
    for key, value in s0["ipu_state"].items():
        assert torch.equal(s1["ipu_state"][key], value), key
    assert left_out not in s1["ipu_state"]  # read back as loaded until the model runs
    merged = {**s1["ipu_state"], left_out: kept}

    family = plain_cls.__name__
    _with_state(plain, _torch_state(merged, reference, family))
    for x, y in data[1:]:
        wrapped(x, y)
    plain_steps(reference, plain, data[1:])
    assert_same_weights(model, reference)
    s2 = optimizer.state_dict()
    for key in moments:
        assert not torch.equal(s2["ipu_state"][key], merged[key]), key


def test_the_poptorch_only_lamb_takes_an_incomplete_state_and_moves_on():
    model = Regressor()
    optimizer = poptorch.optim.LAMB(model.parameters(), lr=0.01)
    wrapped = poptorch.trainingModel(model, optimizer=optimizer)
    wrapped.compile(*_data(1)[0])
    s0 = optimizer.state_dict()
    del s0["ipu_state"]["Accl1___model.lin.bias"]
    s0["ipu_state"]["Accl2___model.lin.weight"] = torch.full((2, 3), 0.5)
    optimizer.load_state_dict(s0)
    assert torch.equal(optimizer.state_dict()["ipu_state"]["Accl2___model.lin.weight"],
                       torch.full((2, 3), 0.5))
    wrapped(*_data(1)[0])
    s1 = optimizer.state_dict()["ipu_state"]
    assert not torch.equal(s1["Accl2___model.lin.weight"], torch.full((2, 3), 0.5))
    assert s1["Accl1___model.lin.bias"].abs().sum() > 0  # its first step moved it off zero


def test_an_incomplete_ipu_param_changes_only_the_groups_it_names():
    # PopTorch's test_write_ipu_state(incomplete_state=True) for the hyper-parameters: with
    # one param group per parameter, a learning rate left out keeps its value.
    model, reference = Regressor(), Regressor()
    data = _data(3)
    groups = lambda m: [{"params": [m.lin.weight]}, {"params": [m.lin.bias]}]  # noqa: E731
    optimizer = poptorch.optim.Adam(groups(model), lr=0.01)
    wrapped = poptorch.trainingModel(model, optimizer=optimizer)
    wrapped.compile(*data[0])
    s0 = optimizer.state_dict()
    del s0["ipu_param"]["learningRate___specific___model.lin.weight"]
    s0["ipu_param"]["learningRate___specific___model.lin.bias"] = torch.tensor(0.05)
    optimizer.load_state_dict(s0)
    for x, y in data:
        wrapped(x, y)
    s1 = optimizer.state_dict()["ipu_param"]
    assert_close(s1["learningRate___specific___model.lin.weight"], torch.tensor(0.01))
    assert_close(s1["learningRate___specific___model.lin.bias"], torch.tensor(0.05))
    plain = torch.optim.Adam(groups(reference), lr=0.01)
    plain.param_groups[1]["lr"] = 0.05
    plain_steps(reference, plain, data)
    assert_same_weights(model, reference)


# --- writing it before the model compiles ----------------------------------------------
def test_a_checkpoint_loaded_before_compiling_reaches_the_device():
    # PopTorch's test_write_ipu_state_before_override: a destroyed model's state, loaded into
    # a new optimiser, is what the new model compiles with; training goes on like torch.
    model, reference = Regressor(), Regressor()
    data = _data(4)
    optimizer = poptorch.optim.Adam(model.parameters(), lr=0.02)
    wrapped = poptorch.trainingModel(model, optimizer=optimizer)
    wrapped(*data[0])
    s1 = optimizer.state_dict()
    wrapped.destroy()

    fresh = poptorch.optim.Adam(model.parameters(), lr=0.02)
    fresh.load_state_dict(s1)
    rewrapped = poptorch.trainingModel(model, optimizer=fresh)
    rewrapped.compile(*data[1])
    s2 = fresh.state_dict()
    for key, value in s1["ipu_state"].items():
        assert torch.equal(s2["ipu_state"][key], value), key
    for x, y in data[1:]:
        rewrapped(x, y)
    plain_steps(reference, torch.optim.Adam(reference.parameters(), lr=0.02), data)
    assert_same_weights(model, reference)


def test_an_incomplete_checkpoint_loaded_before_compiling(caplog):
    # Only the weight's moments are in the checkpoint: the bias starts from zeros, as a
    # fresh parameter does on the IPU, and the model says which parameters got no state.
    model, reference = Regressor(), Regressor()
    data = _data(3)
    optimizer = poptorch.optim.Adam(model.parameters(), lr=0.02)
    checkpoint = optimizer.state_dict()
    checkpoint["ipu_state"] = {"Accl1___model.lin.weight": torch.full((2, 3), 0.1),
                               "Accl2___model.lin.weight": torch.full((2, 3), 0.2),
                               "Step___model.lin.weight": torch.tensor(3.0)}
    optimizer.load_state_dict(checkpoint)
    wrapped = poptorch.trainingModel(model, optimizer=optimizer)
    with caplog.at_level(logging.WARNING, logger="pipetorch.optim.ipu_state"):
        for x, y in data:
            wrapped(x, y)
    assert "sets no state for 1 parameter(s) (model.lin.bias)" in caplog.text
    plain = torch.optim.Adam(reference.parameters(), lr=0.02)
    plain.state[reference.lin.weight] = {"exp_avg": torch.full((2, 3), 0.1),
                                         "exp_avg_sq": torch.full((2, 3), 0.2),
                                         "step": torch.tensor(3.0)}
    plain_steps(reference, plain, data)
    assert_same_weights(model, reference)


def test_a_cpu_trained_optimisers_state_carries_on_on_the_device():
    # PopTorch refuses this ("Only IPU optimizer states can be loaded onto the IPU."); here a
    # torch optimiser's state is the device's state, so training just goes on.
    model, reference = Regressor(), Regressor()
    data = _data(4)
    cpu = torch.optim.Adam(model.parameters(), lr=0.02)
    plain_steps(model, cpu, data[:2])
    poptorch_adam = poptorch.optim.Adam(model.parameters(), lr=0.02)
    poptorch_adam.load_state_dict(cpu.state_dict())
    assert poptorch_adam.state_dict()["ipu_state"] is None  # not compiled yet, none written
    wrapped = poptorch.trainingModel(model, optimizer=poptorch_adam)
    for x, y in data[2:]:
        wrapped(x, y)
    plain_steps(reference, torch.optim.Adam(reference.parameters(), lr=0.02), data)
    assert_same_weights(model, reference)
    assert_close(poptorch_adam.state_dict()["ipu_state"]["Step___model.lin.bias"],
                 torch.tensor(4.0))


def test_an_empty_state_dict_is_refused_with_poptorchs_message():
    optimizer = poptorch.optim.Adam(Regressor().parameters())
    with pytest.raises(RuntimeError, match="Cannot load optimizer state dictionary because it "
                                           "is empty."):
        optimizer.load_state_dict({})


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "before-compiling"])
@pytest.mark.parametrize("value, error, message", [
    (torch.zeros(5), ValueError, r"has shape \(5,\) but the optimiser state of model\.lin\.weight "
                                 r"has shape \(2, 3\): nothing was set"),
    (torch.zeros(2, 3, dtype=torch.int64), TypeError, "must be a floating-point tensor"),
], ids=["shape", "dtype"])
def test_a_state_the_update_cannot_use_is_refused_and_nothing_is_set(compiled, value, error,
                                                                      message):
    model, reference = Regressor(), Regressor()
    data = _data(2)
    optimizer = poptorch.optim.Adam(model.parameters(), lr=0.02)
    wrapped = poptorch.trainingModel(model, optimizer=optimizer)
    good = torch.full((2,), 0.3)
    if compiled:
        wrapped.compile(*data[0])
        with pytest.raises(error, match=message):
            optimizer.write_ipu_state({"Accl1___model.lin.bias": good,
                                       "Accl1___model.lin.weight": value})
    else:  # found when the model compiles, and the model can still compile and train
        optimizer.write_ipu_state({"Accl1___model.lin.bias": good,
                                   "Accl1___model.lin.weight": value})
        with pytest.raises(error, match=message):
            wrapped(*data[0])
    for x, y in data:
        wrapped(x, y)
    plain_steps(reference, torch.optim.Adam(reference.parameters(), lr=0.02), data)
    assert_same_weights(model, reference)  # the bias's good moment was not set either


# --- reading it: detached, offline, cached ---------------------------------------------
@pytest.mark.parametrize("cls", [poptorch.optim.SGD, torch.optim.SGD], ids=["poptorch", "torch"])
def test_the_state_read_when_detached_is_the_trained_one_and_attach_sends_it_back(cls, caplog):
    # PopTorch's test_read_ipu_state_on_detach, with momentum so there is state to read.
    model, reference = Regressor(), Regressor()
    data = _data(4)
    optimizer = cls(model.parameters(), lr=0.05, momentum=0.9)
    wrapped = poptorch.trainingModel(model, optimizer=optimizer)
    for x, y in data[:2]:
        wrapped(x, y)
    with caplog.at_level(logging.DEBUG, logger=LOG):
        wrapped.detachFromDevice()
    assert "Writing optimiser state tensors from IPU to host." in caplog.text
    plain = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    plain_steps(reference, plain, data[:2])
    assert_same_weights(model, reference)
    for param, want in zip(model.parameters(), reference.parameters()):
        assert_close(optimizer.state[param]["momentum_buffer"],
                     plain.state[want]["momentum_buffer"])
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger=LOG):
        state = optimizer.state_dict()
    # PopTorch keeps (and reports) a cached state dict for its own optimisers only
    assert ("Using cached optimiser state dict" in caplog.text) == (cls is poptorch.optim.SGD)
    optimizer.load_state_dict(state)
    wrapped.attachToDevice()
    for x, y in data[2:]:
        wrapped(x, y)
    plain_steps(reference, plain, data[2:])
    assert_same_weights(model, reference)


def test_reading_twice_without_a_call_between_uses_the_cached_state(caplog, monkeypatch):
    # PopTorch's test_read_ipu_state_cached: one copy from the device per round of calls.
    model = Regressor()
    optimizer = poptorch.optim.Adam(model.parameters(), lr=0.01)
    wrapped = poptorch.trainingModel(model, optimizer=optimizer)
    wrapped(*_data(1)[0])
    engine = wrapped._compiled.engine
    pulls = []
    original = engine.pull
    monkeypatch.setattr(engine, "pull", lambda **kw: (pulls.append(kw), original(**kw))[1])
    with caplog.at_level(logging.DEBUG, logger=LOG):
        first = optimizer.state_dict()["ipu_state"]
        second = optimizer.state_dict()["ipu_state"]
    assert caplog.text.count("Writing optimiser state tensors from IPU to host.") == 1
    assert "Using cached optimiser state dict" in caplog.text
    assert [kw for kw in pulls if kw.get("optimizer_state")] == [{"optimizer_state": True}]
    for key, value in first.items():
        assert torch.equal(second[key], value), key
    wrapped(*_data(1)[0])
    assert not torch.equal(optimizer.state_dict()["ipu_state"]["Accl1___model.lin.weight"],
                           first["Accl1___model.lin.weight"])


@pytest.mark.parametrize("cls", [poptorch.optim.Adam, torch.optim.Adam], ids=["poptorch", "torch"])
def test_the_first_read_after_compiling_copies_a_poptorch_optimisers_state(cls, caplog):
    # PopTorch's test_read_ipu_state_cached: compiling alone makes the first state_dict() copy
    # a poptorch.optim optimiser's state from the device (a torch optimiser's: not before
    # training); pipetorch copied nothing before the first training call.
    model, reference = Regressor(), Regressor()
    data = _data(3)
    optimizer = cls(model.parameters(), lr=0.01)
    wrapped = poptorch.trainingModel(model, optimizer=optimizer)
    wrapped.compile(*data[0])
    with caplog.at_level(logging.DEBUG, logger=LOG):
        optimizer.state_dict()
        optimizer.state_dict()
    copies = caplog.text.count("Writing optimiser state tensors from IPU to host.")
    assert copies == (1 if cls is poptorch.optim.Adam else 0)
    for x, y in data:
        wrapped(x, y)
    plain_steps(reference, torch.optim.Adam(reference.parameters(), lr=0.01), data)
    assert_same_weights(model, reference)


def test_loading_a_state_after_calls_copies_the_weights_to_the_host_first(caplog):
    # PopTorch's test_LR_scheduler: setOptimizer copies no weights; loading a state after
    # training calls logs the implicit copyWeightsToHost() before the state is sent.
    model, reference = Regressor(), Regressor()
    data = _data(3)
    optimizer = poptorch.optim.Adam(model.parameters(), lr=0.01)
    wrapped = poptorch.trainingModel(model, optimizer=optimizer)
    wrapped(*data[0])
    with caplog.at_level(logging.DEBUG, logger=LOG):
        wrapped.setOptimizer(optimizer)
    assert "copyWeightsToHost()" not in caplog.text
    state = optimizer.state_dict()
    wrapped(*data[1])
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger=LOG):
        optimizer.load_state_dict(state)  # back to the state after call 0
    lines = [r.getMessage() for r in caplog.records]
    assert lines.index("Implicit copyWeightsToHost()") < \
        lines.index("Writing optimiser state tensors from host to IPU memory")
    wrapped(*data[2])
    plain = torch.optim.Adam(reference.parameters(), lr=0.01)
    plain_steps(reference, plain, data[:1])
    saved = copy.deepcopy(plain.state_dict())
    plain_steps(reference, plain, data[1:2])
    plain.load_state_dict(saved)
    plain_steps(reference, plain, data[2:])
    assert_same_weights(model, reference)


def test_an_offline_model_compiles_has_no_device_state_and_refuses_to_run():
    # PopTorch's test_read_ipu_state_offline: the state of an offline model reads as empty.
    model = Regressor()
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.0)
    opts = poptorch.Options().useOfflineIpuTarget()
    wrapped = poptorch.trainingModel(model, opts, optimizer=optimizer)
    wrapped.compile(*_data(1)[0])
    assert wrapped.isCompiled()
    state = optimizer.state_dict()
    assert state["ipu_state"] is None and state["ipu_param"] is None
    with pytest.raises(AssertionError, match="Trying to run a model on an offline device"):
        wrapped(*_data(1)[0])


# --- LR schedulers ---------------------------------------------------------------------
def test_an_lr_scheduler_through_set_optimizer_trains_like_torch_and_rewinds(caplog):
    # PopTorch's test_LR_scheduler: the new lr reaches the device through setOptimizer; a
    # state read earlier, loaded back, is written to the device before the next call.
    model, reference = Regressor(), Regressor()
    data = _data(5)
    optimizer = poptorch.optim.Adam(model.parameters(), lr=0.5)
    scheduler = ExponentialLR(optimizer, 0.5)
    wrapped = poptorch.trainingModel(model, optimizer=optimizer)
    plain = torch.optim.Adam(reference.parameters(), lr=0.5)
    plain_scheduler = ExponentialLR(plain, 0.5)

    losses, plain_losses = [], []
    for x, y in data[:2]:
        losses.append(wrapped(x, y)[1])
        scheduler.step()
        wrapped.setOptimizer(optimizer)
        plain.zero_grad()
        loss = reference(x, y)[1]
        loss.backward()
        plain.step()
        plain_scheduler.step()
        plain_losses.append(loss.detach())
    s0 = optimizer.state_dict()
    assert_close(s0["ipu_param"]["learningRate___specific___model.lin.bias"], torch.tensor(0.125))
    p0 = copy.deepcopy(plain.state_dict())

    losses.append(wrapped(*data[2])[1])  # the device's state moves past s0
    with caplog.at_level(logging.DEBUG, logger=LOG):
        optimizer.load_state_dict(s0)
    assert "Writing optimiser state tensors from host to IPU memory" in caplog.text
    for x, y in data[3:]:
        losses.append(wrapped(x, y)[1])

    for index, (x, y) in enumerate(data[2:]):
        if index == 1:
            plain.load_state_dict(p0)  # the same rewind, by hand
        plain.zero_grad()
        loss = reference(x, y)[1]
        loss.backward()
        plain.step()
        plain_losses.append(loss.detach())
    assert_close(torch.stack(losses), torch.stack(plain_losses))
    assert_same_weights(model, reference)


# --- setOptimizer with frozen options ----------------------------------------------------
def _frozen_post_options():
    opts = poptorch.Options()
    opts.Training.setMeanAccumulationAndReplicationReductionStrategy(
        poptorch.MeanReductionStrategy.Post)
    poptorch.DataLoader(opts, [(torch.ones(3), torch.ones(2))])  # freezes the options
    return opts


def test_set_optimizer_with_frozen_options_keeps_the_compiled_strategy():
    # PopTorch's test_setOptimizer_frozen_options_ok: float16 accumulators make the executable
    # use Running even over the user's Post; a new lr then goes through.
    model, reference = Regressor(), Regressor()
    data = _data(3)
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.5, accum_type=torch.half)
    wrapped = poptorch.trainingModel(model, _frozen_post_options(), optimizer=optimizer)
    wrapped.compile(*data[0])
    assert wrapped.options.Training.meanAccumulationAndReplicationReductionStrategy == \
        poptorch.MeanReductionStrategy.Running
    wrapped(*data[0])
    optimizer.param_groups[0]["lr"] = 0.01
    wrapped.setOptimizer(optimizer)
    for x, y in data[1:]:
        wrapped(x, y)
    plain = torch.optim.SGD(reference.parameters(), lr=0.5)
    plain_steps(reference, plain, data[:1])
    plain.param_groups[0]["lr"] = 0.01
    plain_steps(reference, plain, data[1:])
    for name, param in reference.named_parameters():  # float16 gradients: to their precision
        assert_close(model.get_parameter(name), param, rtol=2e-3, atol=2e-3, msg=name)
    assert not torch.allclose(model.lin.weight, Regressor().lin.weight, atol=1e-2)  # it trained


def test_set_optimizer_needing_another_strategy_after_compiling_is_refused():
    # PopTorch's test_setOptimizer_frozen_options_broken.
    model = Regressor()
    optimizer = poptorch.optim.Adam(model.parameters(), lr=0.5)
    wrapped = poptorch.trainingModel(model, _frozen_post_options(), optimizer=optimizer)
    wrapped.compile(*_data(1)[0])
    assert wrapped.options.Training.meanAccumulationAndReplicationReductionStrategy == \
        poptorch.MeanReductionStrategy.Post
    optimizer.param_groups[0]["lr"] = 0.01
    optimizer.accum_type = torch.half
    with pytest.raises(ValueError, match="MeanReductionStrategy.Running but the executable "
                                         "is already compiled"):
        wrapped.setOptimizer(optimizer)


def test_set_optimizer_before_compiling_may_still_change_the_strategy():
    # PopTorch changes the strategy while the executable is not compiled yet; a choice the
    # user made stays unless float16 accumulators need Running.
    opts = poptorch.Options()
    opts.Training.setMeanAccumulationAndReplicationReductionStrategy(
        poptorch.MeanReductionStrategy.PostAndLoss)
    model = Regressor()
    wrapped = poptorch.trainingModel(model, opts)
    wrapped.setOptimizer(poptorch.optim.SGD(model.parameters(), lr=0.1))
    strategy = lambda: wrapped.options.Training.meanAccumulationAndReplicationReductionStrategy  # noqa: E731
    assert strategy() == poptorch.MeanReductionStrategy.PostAndLoss
    wrapped.setOptimizer(poptorch.optim.SGD(model.parameters(), lr=0.1, accum_type=torch.half))
    assert strategy() == poptorch.MeanReductionStrategy.Running
    wrapped.compile(*_data(1)[0])
    assert strategy() == poptorch.MeanReductionStrategy.Running
