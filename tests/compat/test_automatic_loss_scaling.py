"""Issue 32 D: opts.Training.setAutomaticLossScaling(True) with each PopTorch optimiser,
starting from loss_scaling 1.0 and 2.0.

PopTorch's test_automatic_loss_scaling (half model): after compile(), before every call,
`optimizer.state_dict()["ipu_state"]["lossScaleUpdateFactor"]` times the initial loss scaling
is the anchor "finalLossScale" the call then reports. pipetorch's own scheme (documented in
docs/precision.md) starts at 2**15 when loss_scaling is 1.0 and halves on an overflow,
skipping that step; without an overflow the numbers are plain PyTorch's.
"""
import copy

import pytest
import torch
import torch.nn as nn
from torch.testing import assert_close

import pipetorch as poptorch
from helpers.models import Regressor, regression_data
from pipetorch.optim import scaling

OPTIMIZERS = [poptorch.optim.SGD, poptorch.optim.Adam, poptorch.optim.AdamW,
              poptorch.optim.RMSprop, poptorch.optim.LAMB]
PLAIN = {poptorch.optim.SGD: torch.optim.SGD, poptorch.optim.Adam: torch.optim.Adam,
         poptorch.optim.AdamW: torch.optim.AdamW, poptorch.optim.RMSprop: torch.optim.RMSprop}


class SumOfSquares(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(5, 5)

    def forward(self, x):
        out = self.lin(x)
        return out, poptorch.identity_loss(out.float().pow(2).sum(), reduction="sum")


def als_options():
    opts = poptorch.Options()
    opts.Training.setAutomaticLossScaling(True)
    opts.anchorTensor("ls_final", "finalLossScale", poptorch.OutputMode.Final)
    return opts


def make(cls, params, **kwargs):
    if cls is poptorch.optim.SGD:
        kwargs["use_combined_accum"] = False
    return cls(params, **kwargs)


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("initial_ls", [1.0, 2.0])
def test_final_loss_scale_is_initial_times_the_update_factor_read_before_the_call(cls,
                                                                                  initial_ls):
    model = SumOfSquares().half()  # fp16 gradients: the scale matters (and overflows here)
    optimizer = make(cls, model.parameters(), lr=0.0, loss_scaling=initial_ls)
    wrapped = poptorch.trainingModel(model, als_options(), optimizer)
    x = torch.ones(1, 5).half()
    wrapped.compile(x)  # the factor is readable from compile on, before the first call
    factors = []
    for _ in range(5):
        factor = optimizer.state_dict()["ipu_state"]["lossScaleUpdateFactor"]
        wrapped(x)
        assert_close(wrapped.getAnchoredTensor("ls_final"),
                     torch.tensor(initial_ls * float(factor)))
        factors.append(float(factor))
    wrapped.destroy()
    if initial_ls == 1.0:
        # pipetorch starts 1.0 at 2**15; the sum of squares overflows fp16 there once.
        assert factors == [2.0 ** 15] + [2.0 ** 14] * 4
    else:
        assert factors == [1.0] * 5


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("initial_ls", [1.0, 2.0])
def test_without_overflow_training_is_plain_pytorchs(cls, initial_ls):
    data = regression_data(4, inputs=3, outputs=2, seed=0)
    model = Regressor()
    plain = copy.deepcopy(model)
    optimizer = make(cls, model.parameters(), lr=0.05, loss_scaling=initial_ls)
    wrapped = poptorch.trainingModel(model, als_options(), optimizer)
    reference = (PLAIN[cls] if cls in PLAIN else cls)(plain.parameters(), lr=0.05)
    for x, y in data:
        _, loss = wrapped(x, y)
        reference.zero_grad()
        _, want = plain(x, y)
        want.backward()
        reference.step()
        assert_close(loss, want.detach())
    assert scaling.skipped_steps(optimizer) == 0
    scale = float(wrapped.getAnchoredTensor("ls_final"))
    assert scale == (2.0 ** 15 if initial_ls == 1.0 else initial_ls)
    wrapped.destroy()
    assert_close(model.lin.weight, plain.lin.weight)
    assert_close(model.lin.bias, plain.lin.bias)


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_an_overflowing_step_is_skipped_and_the_scale_halves(cls):
    model = SumOfSquares().half()
    before = copy.deepcopy(model.state_dict())
    optimizer = make(cls, model.parameters(), lr=0.01)
    wrapped = poptorch.trainingModel(model, als_options(), optimizer)
    x = torch.ones(1, 5).half()
    wrapped(x)  # at 2**15 the fp16 gradients overflow: no update
    assert scaling.skipped_steps(optimizer) == 1
    assert float(wrapped.getAnchoredTensor("ls_final")) == 2.0 ** 15
    assert float(optimizer.state_dict()["ipu_state"]["lossScaleUpdateFactor"]) == 2.0 ** 14
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    wrapped(x)  # 2**14 fits: this step updates
    assert scaling.skipped_steps(optimizer) == 1
    assert not torch.equal(model.lin.weight, before["lin.weight"])
    wrapped.destroy()


def test_a_torch_optimiser_is_refused_naming_the_difference():
    model = Regressor()
    wrapped = poptorch.trainingModel(model, als_options(),
                                     torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(poptorch.Error, match="PopTorch also accepts torch.optim's optimisers "
                                             "here; pipetorch does not"):
        wrapped(*regression_data(1, inputs=3, outputs=2, seed=0)[0])
