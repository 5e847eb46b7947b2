"""Training state across stage workers: checkpoints, and automatic loss scaling's overflow skip."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.testing import assert_close

import pipetorch as poptorch
from parallel_cases import assert_in_processes, cleaned, one_thread_everywhere
from pipetorch.optim import scaling

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _one_thread(request, monkeypatch):
    one_thread_everywhere(request, monkeypatch)


class TwoStage(nn.Module):
    """Stage 0 multiplies the input by a small `gain` first: a huge input value overflows the
    gain's gradient (float16) while the activations stage 1 sees stay small."""

    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.full((), 1e-3))
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x, labels):
        with poptorch.Block("A", ipu_id=0):
            h = torch.tanh(self.a(x * self.gain))
        with poptorch.Block("B", ipu_id=1):
            out = self.b(h)
            return out, F.cross_entropy(out.float(), labels)


def data(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def opts_for(D, G, R=1):
    opts = poptorch.Options().deviceIterations(D).replicationFactor(R)
    opts.Training.gradientAccumulation(G)
    opts.outputMode(poptorch.OutputMode.All).showCompilationProgressBar(False)
    return opts


def test_a_checkpoint_continues_with_identical_losses(request):
    D, G, B = 2, 3, 2
    batches = [data(D * G * B, seed) for seed in range(4)]
    torch.manual_seed(0)
    model = TwoStage()
    optimizer = poptorch.optim.Adam(model.parameters(), lr=0.01)
    wrapper = cleaned(request, poptorch.trainingModel(model, opts_for(D, G), optimizer=optimizer))
    for batch in batches[:2]:
        wrapper(*batch)
    wrapper.copyWeightsToHost()
    saved = copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    assert saved["optimizer"]["state"], "the optimiser state came home with the weights"
    losses = [wrapper(*batch)[1] for batch in batches[2:]]
    assert_in_processes(wrapper, 2)
    wrapper.destroy()

    restored = TwoStage()
    restored.load_state_dict(saved["model"])
    restored_optimizer = poptorch.optim.Adam(restored.parameters(), lr=0.01)
    restored_optimizer.load_state_dict(saved["optimizer"])
    again = cleaned(request, poptorch.trainingModel(restored, opts_for(D, G),
                                                    optimizer=restored_optimizer))
    for batch, loss in zip(batches[2:], losses):
        assert torch.equal(again(*batch)[1], loss)


def test_an_overflow_on_one_stage_and_replica_skips_the_step_everywhere(request):
    """float16, automatic loss scaling, 2 stages x 2 replicas: the gain's gradient overflows
    in one micro-batch of replica 1 only; every stage of both replicas skips that step."""
    D, G, R, B = 2, 3, 2, 2
    clean = data(D * G * R * B, seed=0)
    x, labels = data(D * G * R * B, seed=1)
    x[(G * R - 1) * B, 0] = 60000.0  # device iteration 0, last micro-batch: replica 1
    torch.manual_seed(0)
    model = TwoStage().half()
    plain = copy.deepcopy(model)
    opts = opts_for(D, G, R)
    opts.Training.setAutomaticLossScaling(True)
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.1)
    wrapper = cleaned(request, poptorch.trainingModel(model, opts, optimizer=optimizer))

    plain_optimizer = poptorch.optim.SGD(plain.parameters(), lr=0.1)
    scaling.enable_automatic_loss_scaling(plain_optimizer)
    start = scaling.loss_scale(plain_optimizer)
    overflowed = {}

    def plain_call(x, labels):
        """The hand loop: the same optimiser class with the same automatic scaling."""
        for d in range(D):
            plain_optimizer.zero_grad()
            scale = scaling.loss_scale(plain_optimizer)
            for m in range(G * R):
                rows = slice((d * G * R + m) * B, (d * G * R + m + 1) * B)
                _, loss = plain(x[rows].half(), labels[rows])
                (loss * scale / (G * R)).backward()
            overflowed.setdefault(d, {n: bool(torch.isfinite(p.grad).all())
                                      for n, p in plain.named_parameters()})
            plain_optimizer.step()

    for batch in (clean, (x, labels)):
        wrapper(batch[0].half(), batch[1])
        overflowed.clear()
        plain_call(*batch)
    # Only stage 0's gain overflowed in the plain loop: stage 1 alone would have stepped.
    assert overflowed[0] == {"gain": False, "a.weight": True, "a.bias": True, "b.weight": True,
                             "b.bias": True}
    assert scaling.skipped_steps(plain_optimizer) == 1
    wrapper.copyWeightsToHost()
    assert scaling.skipped_steps(optimizer) == 1
    assert scaling.loss_scale(optimizer) == start / 2 == scaling.loss_scale(plain_optimizer)
    for name, param in plain.named_parameters():
        assert_close(model.get_parameter(name), param, msg=name)
    assert_in_processes(wrapper, 2 * R)
