"""Options.checkNonFinite (a pipetorch extension): NaN/Inf in inputs refused before anything
runs, the first non-finite micro-batch of a call named, non-finite weights warned once."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn

import pipetorch as poptorch
from error_cases import TwoStageClassifier, no_worker_started
from pipetorch.errors import NonFiniteError


class LogRegressor(nn.Module):
    """NaN wherever x <= 0: log of the data, then a linear layer and an MSE loss."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x, y):
        out = self.fc(torch.log(x))
        return out, nn.functional.mse_loss(out, y)


def checked(D=4):
    return (poptorch.Options().deviceIterations(D).checkNonFinite()
            .showCompilationProgressBar(False))


def data(D=4, B=2, bad_micro_batch=None):
    x, y = torch.rand(D * B, 4) + 0.5, torch.rand(D * B, 1)
    if bad_micro_batch is not None:
        x[bad_micro_batch * B] = -1.0  # log(-1) = nan
    return x, y


# Issue 23: non-finite values in inputs or loss passed without a word.
def test_non_finite_inputs_are_refused_before_any_worker_starts():
    wrapper = poptorch.inferenceModel(TwoStageClassifier(), checked(D=2))
    x = torch.ones(4, 4)
    x[3, 1] = float("inf")
    with no_worker_started(), pytest.raises(NonFiniteError) as info:
        wrapper(x, torch.zeros(4, dtype=torch.int64))
    assert str(info.value) == (
        "checkNonFinite: argument 0 (x) holds inf (first at sample 3, micro-batch 1 of this "
        "call): the data is broken before the model sees it. Clean or filter it in the dataset "
        "(e.g. torch.nan_to_num), or find what produced it")
    assert not wrapper.isCompiled()


def test_the_first_non_finite_micro_batch_is_named_and_weights_warned_once(caplog):
    torch.manual_seed(0)
    model = LogRegressor()
    wrapper = poptorch.trainingModel(model, checked(),
                                     optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    wrapper(*data())  # finite: no complaint
    with caplog.at_level(logging.WARNING), pytest.raises(NonFiniteError) as info:
        wrapper(*data(bad_micro_batch=2))
    assert str(info.value) == (
        "checkNonFinite: output[0] of micro-batch 2 (device iteration 2, accumulation step 0, "
        "replica 0) is nan; it is the first of 2 non-finite micro-batch(es) in this call. This "
        "call's optimiser steps ran: the model holds the weights after them. Look for what "
        "overflows at that micro-batch: lower the learning rate, clip gradients "
        "(max_grad_norm), use loss scaling for float16, or check that micro-batch's data")
    warnings = [r.getMessage() for r in caplog.records if "checkNonFinite" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith(
        "checkNonFinite: after call 2 the weights ['fc.weight', 'fc.bias'] hold NaN or Inf")
    caplog.clear()
    with caplog.at_level(logging.WARNING), pytest.raises(NonFiniteError,
                                                         match="micro-batch 0 .* first of 4"):
        wrapper(*data())  # the weights are NaN now: every micro-batch is
    assert not [r for r in caplog.records if "checkNonFinite" in r.getMessage()]
    wrapper.destroy()


def test_inference_names_the_micro_batch_without_optimiser_steps():
    opts = checked()
    opts.outputMode(poptorch.OutputMode.Final)  # the NaN micro-batch is not even returned
    wrapper = poptorch.inferenceModel(LogRegressor(), opts)
    with pytest.raises(NonFiniteError) as info:
        wrapper(*data(bad_micro_batch=1))
    message = str(info.value)
    assert message.startswith("checkNonFinite: output[0] of micro-batch 1 (device iteration 1, "
                              "accumulation step 0, replica 0) is nan; it is the first of 1 ")
    assert "optimiser steps" not in message


def test_without_the_option_non_finite_values_pass_as_before():
    wrapper = poptorch.inferenceModel(LogRegressor(), poptorch.Options().deviceIterations(4))
    out, loss = wrapper(*data(bad_micro_batch=1))
    assert torch.isnan(out[2]).all() and torch.isfinite(out[4:]).all()


def test_the_option_is_validated_and_read_back():
    assert poptorch.Options().check_non_finite is False
    assert poptorch.Options().checkNonFinite().check_non_finite is True
    with pytest.raises(TypeError, match=r"checkNonFinite: enabled must be True or False; got 1"):
        poptorch.Options().checkNonFinite(1)
