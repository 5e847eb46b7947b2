"""setOptimizer accepts a plain torch optimiser in place of pipetorch's: its missing
`loss_scaling` is PopTorch's default 1.0, not a changed constant."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pipetorch as poptorch


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def forward(self, x, y):
        out = self.layer(x)
        return out, F.mse_loss(out, y)


def test_torch_sgd_replaces_the_default_optimizer():
    # Story: setOptimizer(torch.optim.SGD(..., lr=0.0)) after the default poptorch SGD was
    # refused as "loss_scaling was 1.0 ... got None" (PopTorch's weights_writing_test).
    torch.manual_seed(0)
    model = _Model()
    training = poptorch.trainingModel(model)  # default: poptorch.optim.SGD(lr=0.01)
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    training(x, y)
    training.setOptimizer(torch.optim.SGD(model.parameters(), lr=0.0))
    _, first = training(x, y)
    _, second = training(x, y)
    torch.testing.assert_close(first, second)  # lr 0: nothing moves


def test_a_changed_loss_scaling_is_still_refused():
    model = _Model()
    training = poptorch.trainingModel(model)
    training(torch.randn(2, 4), torch.randn(2, 4))
    with pytest.raises(ValueError, match="'loss_scaling' .* is constant"):
        training.setOptimizer(poptorch.optim.SGD(model.parameters(), lr=0.01, loss_scaling=4.0))
