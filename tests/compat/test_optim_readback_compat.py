"""Issue 54: optimiser state and attributes as PopTorch's optimizer tests read them: a loaded
"ipu_state" / "ipu_param" reads back as loaded until the model runs, constant attributes are
marked "(const)" in the debug lines, amsgrad is a tracked attribute, and a momentum switched
on by setOptimizer starts from a zero buffer; training is compared with plain PyTorch."""
import logging

import pytest
import torch
from torch.testing import assert_close

import pipetorch as poptorch
from pipetorch import log_level
from helpers.models import Regressor, regression_data
from helpers.reference import assert_same_weights, plain_steps


@pytest.fixture(autouse=True)
def _fresh_repeat_counts(monkeypatch):
    monkeypatch.setattr(log_level._repeat_filter, "_last", None)


def test_a_loaded_incomplete_state_reads_back_as_loaded_until_the_model_runs():
    # PopTorch's test_write_ipu_state: the left-out names come back only once the model ran
    model, reference = Regressor(), Regressor()
    data = regression_data(3, inputs=3, outputs=2, seed=1)
    optimizer = poptorch.optim.Adam(model.parameters(), lr=0.01)
    wrapped = poptorch.trainingModel(model, optimizer=optimizer)
    wrapped(*data[0])
    plain = torch.optim.Adam(reference.parameters(), lr=0.01)
    plain_steps(reference, plain, data[:1])
    state = optimizer.state_dict()
    left_state = "Accl1___model.lin.bias"
    kept = state["ipu_state"].pop(left_state)
    state["ipu_param"].pop("lossScaling_FLOAT")
    optimizer.load_state_dict(state)
    read = optimizer.state_dict()
    assert left_state not in read["ipu_state"] and "lossScaling_FLOAT" not in read["ipu_param"]
    assert set(read["ipu_state"]) == set(state["ipu_state"])
    for x, y in data[1:]:
        wrapped(x, y)
    plain_steps(reference, plain, data[1:])
    assert_same_weights(model, reference)
    read = optimizer.state_dict()
    assert left_state in read["ipu_state"] and not torch.equal(read["ipu_state"][left_state], kept)
    assert_close(read["ipu_param"]["lossScaling_FLOAT"], torch.tensor(1.0))


def test_rmsprop_momentum_switched_on_after_steps_starts_from_a_zero_buffer():
    # setOptimizer(momentum 0 -> 0.5) made torch's RMSprop step miss "momentum_buffer"
    model, reference = Regressor(), Regressor()
    data = regression_data(4, inputs=3, outputs=2, seed=2)
    optimizer = poptorch.optim.RMSprop(model.parameters(), lr=0.01, momentum=0.0)
    wrapped = poptorch.trainingModel(model, optimizer=optimizer)
    plain = torch.optim.RMSprop(reference.parameters(), lr=0.01, momentum=0.0)
    for x, y in data[:2]:
        wrapped(x, y)
    plain_steps(reference, plain, data[:2])
    optimizer.param_groups[0]["momentum"] = 0.5
    wrapped.setOptimizer(optimizer)
    plain.param_groups[0]["momentum"] = 0.5
    for param in reference.parameters():
        plain.state[param]["momentum_buffer"] = torch.zeros_like(param)
    for x, y in data[2:]:
        wrapped(x, y)
    plain_steps(reference, plain, data[2:])
    assert_same_weights(model, reference)


def _graph_line(caplog, model, optimizer):
    wrapped = poptorch.trainingModel(model, optimizer=optimizer)
    with caplog.at_level(logging.DEBUG, logger="pipetorch.runtime.optimizer"):
        wrapped.compile(*regression_data(1, inputs=3, outputs=2, seed=0)[0])
    wrapped.destroy()
    return next(r.getMessage() for r in caplog.records if "graph optimizer" in r.getMessage())


def test_constant_attributes_are_marked_const_in_the_graph_optimizer_line(caplog):
    # PopTorch's test_variable_default reads "defaultMomentum=0 (const)" for torch's defaults
    model = Regressor()
    line = _graph_line(caplog, model, torch.optim.SGD(model.parameters(), lr=1.0))
    assert "defaultLearningRate=1," in line  # the learning rate is always variable
    assert "defaultMomentum=0 (const)," in line and "lossScaling=1 (const)" in line
    caplog.clear()
    explicit = poptorch.optim.SGD(model.parameters(), lr=1.0, momentum=0.0,
                                  use_combined_accum=False)
    assert "defaultMomentum=0," in _graph_line(caplog, model, explicit)  # passed: variable


def test_amsgrad_is_an_attribute_variable_attrs_tracks():
    # PopTorch's Adam lets scripts mark amsgrad constant; pipetorch raised "Unknown attribute"
    params = Regressor().parameters()
    assert poptorch.optim.Adam(params, lr=0.1).variable_attrs.isConstant("amsgrad")
    explicit = poptorch.optim.Adam(Regressor().parameters(), lr=0.1, amsgrad=False)
    assert not explicit.variable_attrs.isConstant("amsgrad")
    explicit.variable_attrs.markAsConstant("amsgrad")
    assert explicit.variable_attrs.isConstant("amsgrad")
