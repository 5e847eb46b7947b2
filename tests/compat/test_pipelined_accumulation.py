"""Issue 32, group 6: pipelined training with gradient accumulation, as PopTorch's
batching_test runs it: two stages on two devices, deviceIterations 1 and 2,
gradientAccumulation 4 and 5; each OutputMode's shapes, and outputs, losses and weights
equal to plain PyTorch's after several calls."""
import copy

import pytest
import torch
import torch.nn as nn
from torch.testing import assert_close

import pipetorch as poptorch
from helpers.reference import expected_outputs, plain_train_call
from parallel.parallel_cases import assert_in_processes, cleaned, one_thread_everywhere

B, CALLS = 2, 3
pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _one_thread(request, monkeypatch):
    one_thread_everywhere(request, monkeypatch)


class TwoStages(nn.Module):
    """fc1 on device 0; fc2 and the loss on device 1 (BeginBlock)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(4, 6)
        self.fc2 = poptorch.BeginBlock(nn.Linear(6, 3), ipu_id=1)

    def forward(self, x, target):
        out = self.fc2(torch.tanh(self.fc1(x)))
        return out, nn.functional.mse_loss(out, target)


def _call_data(call, rows):
    gen = torch.Generator().manual_seed(100 + call)
    return torch.randn(rows, 4, generator=gen), torch.randn(rows, 3, generator=gen)


MODES = {"All": poptorch.OutputMode.All, "Final": poptorch.OutputMode.Final,
         "Sum": poptorch.OutputMode.Sum}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("G", [4, 5])
@pytest.mark.parametrize("D", [1, 2])
def test_pipelined_accumulation_returns_each_modes_shapes_and_torchs_numbers(request, D, G, mode):
    model = TwoStages()
    plain = copy.deepcopy(model)
    opts = poptorch.Options().deviceIterations(D).outputMode(MODES[mode])
    opts.Training.gradientAccumulation(G)
    opts.setExecutionStrategy(poptorch.PipelinedExecution(poptorch.AutoStage.SameAsIpu))
    wrapped = cleaned(request, poptorch.trainingModel(
        model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=0.05)))
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.05)
    rows = D * G * B
    for call in range(CALLS):
        x, target = _call_data(call, rows)
        out, loss = wrapped(x, target)
        want_out, want_loss = expected_outputs(
            plain_train_call(plain, optimizer, x, target, D=D, G=G, R=1), mode,
            steps=D * G, R=1)
        shape = (rows, 3) if mode == "All" else (B, 3)
        assert tuple(out.shape) == shape
        assert tuple(loss.shape) == ((D * G,) if mode == "All" else ())
        assert_close(out, want_out, msg=f"call {call}")
        assert_close(loss.as_subclass(torch.Tensor), want_loss, msg=f"call {call}")
    assert_in_processes(wrapped, 2)
    wrapped.copyWeightsToHost()
    for name, param in plain.named_parameters():
        assert_close(model.get_parameter(name), param, msg=name)


def test_pipelined_accumulation_every_n_returns_the_periods_iterations(request):
    # deviceIterations 2 x gradientAccumulation 4 = 8 iterations, every 4th returned.
    D, G = 2, 4
    model = TwoStages()
    plain = copy.deepcopy(model)
    opts = poptorch.Options().deviceIterations(D).outputMode(poptorch.OutputMode.EveryN, 4)
    opts.Training.gradientAccumulation(G)
    wrapped = cleaned(request, poptorch.trainingModel(
        model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=0.05)))
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.05)
    for call in range(2):
        x, target = _call_data(call, D * G * B)
        out, loss = wrapped(x, target)
        want_out, want_loss = expected_outputs(
            plain_train_call(plain, optimizer, x, target, D=D, G=G, R=1), "EveryN",
            steps=D * G, R=1, period=4)
        assert tuple(out.shape) == (2 * B, 3) and tuple(loss.shape) == (2,)
        assert_close(out, want_out)
        assert_close(loss.as_subclass(torch.Tensor), want_loss)
