"""An inference wrapper of the user's model follows a training wrapper of a module around it
(sharing its weights, PopTorch's `user_model`), whichever of the two was compiled first."""

import torch
import torch.nn as nn

import pipetorch as poptorch
from helpers.models import AroundCopy


def test_inference_compiled_first_sees_weights_trained_around_it():
    # Story: the training wrapper, compiled second, replaced the user's model's sync with its
    # own, so the inference wrapper never learnt of the training and kept the first weights.
    torch.manual_seed(0)
    user = nn.Linear(4, 4)
    training = poptorch.PoplarExecutor(
        model=AroundCopy(user), options=poptorch.Options(), training=True,
        optimizer=torch.optim.SGD(user.parameters(), lr=0.1), user_model=user,
        poptorch_version=poptorch.__version__)
    inference = poptorch.inferenceModel(user)
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    before = inference(x)
    for _ in range(5):
        training(x, y)
    after = inference(x)
    assert not torch.allclose(after, before)
    torch.testing.assert_close(after, user(x).detach())
