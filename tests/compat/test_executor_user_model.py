"""PopTorch's full PoplarExecutor constructor: `user_model` is the model the wrapper shows
while another module (sharing its weights, e.g. a loss wrapper) runs; `poptorch_version`."""
import copy

import torch
import torch.nn as nn
from torch.testing import assert_close

import pipetorch as poptorch
from helpers.models import AroundCopy


def _wrap(user: nn.Module) -> poptorch.PoplarExecutor:
    opt = torch.optim.SGD(user.parameters(), lr=0.1)
    return poptorch.PoplarExecutor(model=AroundCopy(user), options=poptorch.Options(),
                                   training=True, optimizer=opt, user_model=user,
                                   poptorch_version=poptorch.__version__)


def test_attributes_come_from_the_user_model():
    user = nn.Linear(3, 2)
    wrapped = _wrap(user)
    assert wrapped.weight is user.weight and wrapped.in_features == 3


def test_training_updates_the_user_models_weights():
    torch.manual_seed(0)
    user = nn.Linear(3, 2)
    reference = copy.deepcopy(user)
    x, y = torch.randn(4, 3), torch.randn(4, 2)
    _wrap(user)(x, y)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    nn.functional.mse_loss(reference(x), y).backward()
    ref_opt.step()
    # Regression: the weights were fetched for the running wrapper only, never for `user`.
    assert_close(user.weight, reference.weight)


def test_model_property_is_the_user_model():
    # PopTorch's PoplarExecutor.model returns `user_model`, not the module run in its place.
    user = nn.Linear(3, 2)
    assert _wrap(user).model is user
