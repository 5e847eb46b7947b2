"""OutputMode.EveryN (and an anchor's EveryN) whose period does not divide a call's
iterations is refused when the model is wrapped, before anything runs."""
from __future__ import annotations

import pytest
import torch

import pipetorch as poptorch
from error_cases import Regressor, no_worker_started
from pipetorch.errors import ConfigError


# Issue 23: EveryN(3) with deviceIterations(4) was accepted and each call returned one
# iteration's output, silently dropping the fourth.
def test_every_n_not_dividing_device_iterations_is_refused_at_wrap():
    opts = poptorch.Options().deviceIterations(4).outputMode(poptorch.OutputMode.EveryN, 3)
    with no_worker_started(), pytest.raises(ConfigError) as info:
        poptorch.inferenceModel(Regressor(), opts)
    assert str(info.value) == (
        "outputMode(OutputMode.EveryN, output_return_period=3): the period must divide the 4 "
        "iteration(s) of each host call (deviceIterations (4)); with 3 a call returns 1 of "
        "them and the last 1 never. Use a period in [1, 2, 4], or make deviceIterations a "
        "multiple of 3")


def test_training_counts_accumulation_steps_too():
    opts = poptorch.Options().deviceIterations(3).outputMode(poptorch.OutputMode.EveryN, 4)
    opts.Training.gradientAccumulation(2)
    with no_worker_started(), pytest.raises(ConfigError) as info:
        poptorch.trainingModel(Regressor(), opts)
    message = str(info.value)
    assert "divide the 6 iteration(s) of each host call (deviceIterations (3) x " \
           "gradientAccumulation (2))" in message
    assert "Use a period in [1, 2, 3, 6]" in message


def test_an_anchor_with_a_bad_period_is_named():
    opts = poptorch.Options().deviceIterations(2)
    opts.anchorTensor("out", "fc", poptorch.OutputMode.EveryN, 4)
    with pytest.raises(ConfigError, match=r"^anchorTensor\('out', 'fc', OutputMode.EveryN, "
                                          r"output_return_period=4\): the period must divide "
                                          r"the 2 iteration"):
        poptorch.inferenceModel(Regressor(), opts)


def test_a_dividing_period_returns_every_nth_iteration():
    opts = poptorch.Options().deviceIterations(4).outputMode(poptorch.OutputMode.EveryN, 2)
    model = Regressor()
    x = torch.randn(8, 4)
    out = poptorch.inferenceModel(model, opts)(x)
    with torch.no_grad():
        expected = model(x).view(4, 2, 1)[1::2].reshape(4, 1)
    torch.testing.assert_close(out, expected)
