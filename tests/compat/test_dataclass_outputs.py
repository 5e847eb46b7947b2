"""A forward returning a dataclass of the user's own: refused with the registration to do
while torch's pytree cannot see its tensors, then trained like plain PyTorch once registered."""
import copy
import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.testing import assert_close

import pipetorch as poptorch
from pipetorch.errors import CompileError


def _output_class() -> type:
    """A new class each call: registering it with pytree is process-wide and for good."""
    @dataclasses.dataclass
    class StepOutput:
        loss: torch.Tensor
        logits: torch.Tensor

    return StepOutput


class Net(nn.Module):
    def __init__(self, output: type) -> None:
        super().__init__()
        self.output = output
        self.a = nn.Linear(4, 4)
        self.b = poptorch.BeginBlock(nn.Linear(4, 3), ipu_id=1)

    def forward(self, x, labels):
        logits = self.b(torch.tanh(self.a(x)))
        return self.output(F.cross_entropy(logits, labels), logits)


def _wrapped(model: nn.Module, optimizer: torch.optim.Optimizer) -> poptorch.PoplarExecutor:
    opts = poptorch.Options().showCompilationProgressBar(False)
    opts.setExecutionStrategy(poptorch.ShardedExecution(poptorch.AutoStage.SameAsIpu))
    opts.Training.gradientAccumulation(2)
    return poptorch.trainingModel(model, opts, optimizer=optimizer)


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(4, 4, generator=g), torch.randint(0, 3, (4,), generator=g)


def test_an_unregistered_dataclass_is_refused_with_its_registration():
    torch.manual_seed(0)
    model = Net(_output_class())
    wrapper = _wrapped(model, torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        with pytest.raises(CompileError, match=r"torch\.export\.register_dataclass\(StepOutput\)"):
            wrapper(*_batch(0))
    finally:
        wrapper.destroy()


@pytest.mark.slow  # two stage workers
def test_a_registered_dataclass_trains_like_plain_pytorch():
    output = _output_class()
    torch.export.register_dataclass(output)
    torch.manual_seed(0)
    model = Net(output)
    plain = copy.deepcopy(model)
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    wrapper = _wrapped(model, torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        for call in range(3):
            x, labels = _batch(call)
            got = wrapper(x, labels)
            assert isinstance(got, output)
            plain_optimizer.zero_grad()
            losses = []
            for half in (slice(0, 2), slice(2, 4)):  # gradientAccumulation 2
                out = plain(x[half], labels[half])
                (out.loss / 2).backward()
                losses.append(out.loss.detach())
            plain_optimizer.step()
            assert_close(got.loss.as_subclass(torch.Tensor).reshape(-1)[-1], losses[-1])
        wrapper.copyWeightsToHost()
        for (name, mine), theirs in zip(model.state_dict().items(), plain.state_dict().values()):
            assert_close(mine, theirs, msg=name)
    finally:
        wrapper.destroy()
