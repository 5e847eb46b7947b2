"""A model whose forward calls a submodule through a closure (the enclosing function's
variable, not `self.x`) trains its weights, as it does in PopTorch."""
import torch
import torch.nn as nn
import torch.nn.functional as F

import pipetorch as poptorch


def _model_calling_a_closure() -> tuple[nn.Module, nn.Linear]:
    base = nn.Linear(4, 4)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.base = base  # registered, but forward reaches it through the closure

        def forward(self, x, target):
            out = base(x)
            return out, F.mse_loss(out, target)

    return Model(), base


def test_closure_submodule_is_trained():
    # Story: the device copy's forward called the user's (host) Linear, so gradients went to
    # the host copy, the optimiser stepped the device copy, and the loss never fell.
    torch.manual_seed(0)
    model, base = _model_calling_a_closure()
    before = base.weight.detach().clone()
    training = poptorch.trainingModel(
        model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    x, target = torch.randn(4), torch.randn(4)
    _, first = training(x, target)
    for _ in range(30):
        _, loss = training(x, target)
    assert loss < first / 10
    assert base.weight.grad is None  # nothing ran backward through the host copy
    assert not torch.equal(base.weight, before)  # the trained weights came back


def test_closure_model_inference_matches_eager():
    torch.manual_seed(0)
    model, _ = _model_calling_a_closure()
    x, target = torch.randn(2, 4), torch.randn(2, 4)
    expected = model(x, target)
    got = poptorch.inferenceModel(model)(x, target)
    torch.testing.assert_close(got, expected)
