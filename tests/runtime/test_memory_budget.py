"""setMemoryBudget through trainingModel: refused at compile with remedies; the remedy runs."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pipetorch as poptorch
from pipetorch.errors import OutOfMemoryError


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 64), nn.Linear(64, 4)

    def forward(self, x, labels):
        out = self.b(torch.relu(self.a(x)))
        return out, F.cross_entropy(out.float(), labels)


def train(model, budget, x, labels):
    opts = poptorch.Options().deviceIterations(2).setMemoryBudget(budget)
    opts.Training.gradientAccumulation(2)
    opts.showCompilationProgressBar(False)
    optimizer = poptorch.optim.Adam(model.parameters(), lr=0.01, eps=1e-3)
    wrapper = poptorch.trainingModel(model, opts, optimizer=optimizer)
    try:
        return wrapper(x, labels)
    finally:
        wrapper.destroy()


def test_over_budget_is_refused_and_the_fp16_remedy_then_trains():
    torch.manual_seed(0)
    x, labels = torch.randn(16, 32), torch.randint(0, 4, (16,))
    model = Net()
    params = sum(p.numel() for p in model.parameters()) * 4
    budget = 4 * params  # weights + gradients + Adam's two moments: activations do not fit
    with pytest.raises(OutOfMemoryError) as caught:
        train(model, budget, x, labels)
    error = caught.value
    assert "IPU 0" in str(error) and "optimiser state" in str(error)
    # model.half() keeps Adam's moments float32 (PopTorch's default), so it saves less than
    # moving that state to host memory, but it still fits.
    fp16 = next(remedy for remedy in error.remedies if remedy.name.startswith("fp16"))
    assert fp16.fits and "model.half()" in fp16.code
    _, loss = train(model.half(), budget, x.half(), labels)
    assert torch.isfinite(loss).all()


def test_the_budget_check_prices_replicated_tensor_sharded_state():
    # the compile-time estimate counted the whole optimiser state on each replica with
    # useReplicatedTensorSharding(True): it now prices the 1/R shard each keeps
    torch.manual_seed(0)
    model = Net()
    opts = poptorch.Options().replicationFactor(2).setMemoryBudget(1)
    opts.showCompilationProgressBar(False)
    opts.TensorLocations.setOptimizerLocation(
        poptorch.TensorLocationSettings().useReplicatedTensorSharding(True)
        .minElementsForReplicatedTensorSharding(100))
    optimizer = poptorch.optim.Adam(model.parameters(), lr=0.01)
    wrapper = poptorch.trainingModel(model, opts, optimizer=optimizer)
    with pytest.raises(OutOfMemoryError) as caught:
        wrapper(torch.randn(4, 32), torch.randint(0, 4, (4,)))
    wrapper.destroy()
    device = caught.value.estimate.devices[0]
    # Adam's two float32 moments and a 4-byte step count per tensor: the weights over 100
    # elements sharded (their step counts too: 4 bytes the estimate rounds away), the biases
    # whole
    big, small = (32 * 64 + 64 * 4) * 8 + 2 * 4, (64 + 4) * 8 + 2 * 4
    assert device.optimiser_state == big // 2 + small
    assert not any("sharded" in r.name for r in caught.value.remedies)
