"""A model or optimiser that cannot train is refused when wrapped, not in a worker's backward."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import pipetorch as poptorch
from error_cases import Regressor, TwoStageClassifier, no_worker_started
from pipetorch.errors import ConfigError

FIX = ("so training would have nothing to update. Make the weights to train trainable "
       "(param.requires_grad_(True)) before wrapping, or run the model with "
       "poptorch.inferenceModel")


# Issue 23: a model with no trainable parameter failed only in a worker's backward, 4.8 s in.
def test_a_frozen_model_is_refused_by_training_model():
    model = TwoStageClassifier().requires_grad_(False)
    with no_worker_started(), pytest.raises(ConfigError) as info:
        poptorch.trainingModel(model)
    assert str(info.value) == (
        "trainingModel: none of TwoStageClassifier's 4 parameters requires a gradient (e.g. "
        f"'fc1.weight' has requires_grad=False), {FIX}")
    poptorch.inferenceModel(model)  # what the message offers works


def test_a_model_without_parameters_is_refused():
    class LossOnly(nn.Module):
        def forward(self, x, y):
            return nn.functional.mse_loss(x, y)

    with pytest.raises(ConfigError) as info:
        poptorch.trainingModel(LossOnly())
    assert str(info.value) == f"trainingModel: LossOnly has no parameters, {FIX}"


def test_partly_frozen_models_train():
    model = Regressor()
    model.fc.bias.requires_grad_(False)
    poptorch.trainingModel(model).destroy()


@pytest.mark.parametrize("make", [
    lambda m: Regressor().parameters(),                  # another model
    lambda m: copy.deepcopy(m).parameters(),             # a copy of this one
    lambda m: [m.fc.weight, nn.Parameter(torch.ones(3))],  # one stray tensor
])
def test_an_optimizer_of_another_model_is_refused_at_wrap(make):
    model = Regressor()
    optimizer = torch.optim.SGD(make(model), lr=0.1)
    count = len(optimizer.param_groups[0]["params"])
    strangers = 1 if count == 2 and optimizer.param_groups[0]["params"][0] is model.fc.weight \
        else count
    with no_worker_started(), pytest.raises(ConfigError) as info:
        poptorch.trainingModel(model, optimizer=optimizer)
    message = str(info.value)
    assert message.startswith(f"trainingModel: the optimizer's param group 0 holds {strangers} "
                              f"of {count} tensors (shapes [")
    assert message.endswith(
        "that are not parameters of the wrapped Regressor: it was built for another model, or "
        "for a copy (copy.deepcopy makes new parameters). Build it from this model: "
        "SGD(model.parameters(), ...) with the model you wrap")


def test_set_optimizer_refuses_another_models_parameters():
    model = Regressor()
    wrapper = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ConfigError, match="^setOptimizer: the optimizer's param group 0 holds 2 "
                                          "of 2 tensors"):
        wrapper.setOptimizer(torch.optim.SGD(Regressor().parameters(), lr=0.2))
    wrapper.destroy()
