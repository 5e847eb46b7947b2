"""Issue 32 C: SGD's velocity scaling as PopTorch reports it in `ipu_param`.

PopTorch's separate SGD variant (use_combined_accum=False) scales its velocity by the loss
scaling: its test_optimizer_SGD_separate_velocity_scale_matched sees lossScaling=2 and
defaultVelocityScaling=2 for loss_scaling=2.0, and test_variable_groups sees the velocity
scaling follow a new loss scaling. The combined variant uses velocity_scaling as given.
"""
import pytest
import torch
from torch.testing import assert_close

import pipetorch as poptorch
from helpers.models import Regressor, regression_data


def velocity_scalings(optimizer):
    params = optimizer.state_dict()["ipu_param"]
    return ({k: float(v) for k, v in params.items() if k.startswith("velocityScaling")},
            float(params["lossScaling_FLOAT"]))


def test_the_separate_variant_matches_velocity_scaling_to_loss_scaling():
    model = Regressor()
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, loss_scaling=2.0,
                                   use_combined_accum=False)
    wrapped = poptorch.trainingModel(model, optimizer=optimizer)
    wrapped(*regression_data(1, inputs=3, outputs=2, seed=0)[0])
    scalings, loss_scaling = velocity_scalings(optimizer)
    assert loss_scaling == 2.0
    assert scalings == {"velocityScaling___specific___model.lin.weight": 2.0,
                        "velocityScaling___specific___model.lin.bias": 2.0}
    optimizer.loss_scaling = 4.0  # a new loss scaling moves the velocity scaling with it
    wrapped.setOptimizer(optimizer)
    wrapped(*regression_data(1, inputs=3, outputs=2, seed=1)[0])
    scalings, loss_scaling = velocity_scalings(optimizer)
    assert loss_scaling == 4.0 and set(scalings.values()) == {4.0}
    wrapped.destroy()


@pytest.mark.parametrize("use_combined_accum, want", [(True, 3.0), (False, 2.0)])
def test_velocity_scaling_is_the_groups_only_in_the_combined_variant(use_combined_accum, want):
    model = Regressor()
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, loss_scaling=2.0,
                                   velocity_scaling=3.0, use_combined_accum=use_combined_accum)
    wrapped = poptorch.trainingModel(model, optimizer=optimizer)
    wrapped.compile(*regression_data(1, inputs=3, outputs=2, seed=0)[0])
    scalings, _ = velocity_scalings(optimizer)
    assert set(scalings.values()) == {want}
    wrapped.destroy()


def test_the_velocity_scaling_reported_does_not_change_the_numbers():
    # The separate variant's numbers stay torch's SGD with momentum whatever the scaling.
    data = regression_data(3, inputs=3, outputs=2, seed=0)
    plain = Regressor()
    reference = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    for x, y in data:
        reference.zero_grad()
        plain(x, y)[1].backward()
        reference.step()
    model = Regressor()
    wrapped = poptorch.trainingModel(model, optimizer=poptorch.optim.SGD(
        model.parameters(), lr=0.1, momentum=0.9, loss_scaling=2.0, use_combined_accum=False))
    for x, y in data:
        wrapped(x, y)
    wrapped.destroy()
    assert_close(model.lin.weight, plain.lin.weight)
