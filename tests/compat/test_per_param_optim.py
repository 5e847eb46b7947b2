"""Issue 40: per-parameter hyper-parameters in an optimiser's "ipu_param" (PopTorch keeps
every value per parameter), loaded complete or incomplete, for every poptorch.optim class;
the device steps each parameter with its own values, compared with plain PyTorch stepping
the same parameters in groups of their own."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.testing import assert_close

import pipetorch as poptorch
from helpers.models import regression_data
from helpers.reference import assert_same_weights, plain_steps

# (optimiser, arguments, PopART name of the learning rate in "ipu_param", from lr)
FAMILIES = [
    (poptorch.optim.SGD, {"lr": 0.05}, "scaledLearningRate0"),  # no momentum: PopART's SGD0
    (poptorch.optim.SGD, {"lr": 0.05, "momentum": 0.9}, "learningRate"),
    (poptorch.optim.Adam, {"lr": 0.01}, "learningRate"),
    (poptorch.optim.AdamW, {"lr": 0.01}, "learningRate"),
    (poptorch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5}, "learningRate"),
    (poptorch.optim.LAMB, {"lr": 0.01}, "learningRate"),
]
IDS = ["SGD0", "SGD", "Adam", "AdamW", "RMSprop", "LAMB"]
OWN_LR = {"first.weight": 0.2, "first.bias": 0.003}  # first.* differ; second.* keep lr


class TwoLayers(nn.Module):
    """Linear(3, 4) then Linear(4, 2), on two devices when `devices` is 2; (out, MSE loss)."""

    def __init__(self, devices: int = 1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = nn.Linear(3, 4), nn.Linear(4, 2)
        if devices == 2:
            poptorch.BeginBlock(self.second, ipu_id=1)

    def forward(self, x, y):
        out = self.second(torch.relu(self.first(x)))
        return out, F.mse_loss(out, y)


def _reference(model, cls, args):
    """Plain PyTorch: the same parameters, each with an own learning rate in its own group."""
    plain = copy.deepcopy(model)
    poptorch.removeBlocks(plain)
    groups = [{"params": [p], **({"lr": OWN_LR[n]} if n in OWN_LR else {})}
              for n, p in plain.named_parameters()]
    return plain, cls(groups, **args)


def _trained(cls, args, name, *, complete, devices=1, data):
    model = TwoLayers(devices)
    plain, plain_opt = _reference(model, cls, args)
    optimizer = cls(model.parameters(), **args)
    opts = poptorch.Options()
    if devices == 2:
        opts.Training.gradientAccumulation(4)
    wrapper = poptorch.trainingModel(model, opts, optimizer=optimizer)
    wrapper.compile(*data[0])
    state = optimizer.state_dict()
    if not complete:  # the names left out keep their values
        state["ipu_param"] = {}
    for param, lr in OWN_LR.items():
        state["ipu_param"][f"{name}___specific___{param}"] = torch.tensor(lr)
    optimizer.load_state_dict(state)
    read = optimizer.state_dict()["ipu_param"]
    for param, lr in OWN_LR.items():
        assert_close(read[f"{name}___specific___model.{param}"], torch.tensor(lr))
    left_out = f"{name}___specific___model.second.weight"
    if complete:
        assert_close(read[left_out], torch.tensor(args["lr"]))
    else:  # as PopTorch (test_write_ipu_state): read back as loaded until the model runs
        assert left_out not in read
    assert [g["lr"] for g in optimizer.param_groups] == [args["lr"]]  # the user's group stays
    for x, y in data:
        wrapper(x, y)
    assert_close(optimizer.state_dict()["ipu_param"][left_out], torch.tensor(args["lr"]))
    plain_steps(plain, plain_opt, data)  # accumulated micro-batch means: the batch's mean
    return wrapper, plain


@pytest.mark.parametrize("complete", [True, False], ids=["complete", "incomplete"])
@pytest.mark.parametrize("cls,args,name", FAMILIES, ids=IDS)
def test_own_learning_rates_step_as_own_groups(cls, args, name, complete):
    # pipetorch refused a group's parameters different values ("keeps one per param group")
    data = regression_data(3, inputs=3, outputs=2, seed=4)
    wrapper, plain = _trained(cls, args, name, complete=complete, data=data)
    assert_same_weights(wrapper.model, plain)


@pytest.mark.slow
@pytest.mark.parametrize("cls,args,name", [FAMILIES[0], FAMILIES[2]], ids=["SGD0", "Adam"])
def test_own_learning_rates_reach_the_stage_workers(cls, args, name):
    # the values travel with each parameter's state to the worker that steps it
    data = regression_data(2, inputs=3, outputs=2, seed=5)
    wrapper, plain = _trained(cls, args, name, complete=False, devices=2, data=data)
    assert_same_weights(wrapper.model, plain)


def test_values_every_parameter_shares_become_the_groups():
    # a checkpoint's learning rate for all parameters is the group's again (LR schedulers)
    model = TwoLayers()
    optimizer = poptorch.optim.Adam(model.parameters(), lr=0.01)
    wrapper = poptorch.trainingModel(model, optimizer=optimizer)
    wrapper.compile(*regression_data(1, inputs=3, outputs=2, seed=0)[0])
    state = optimizer.state_dict()
    state["ipu_param"] = {f"learningRate___specific___{n}": torch.tensor(0.5)
                          for n, _ in model.named_parameters()}
    optimizer.load_state_dict(state)
    assert optimizer.param_groups[0]["lr"] == 0.5
    assert all(not optimizer.state[p].get("pipetorch_own_hyperparameters")
               for p in model.parameters())


def test_the_optimiser_sent_to_the_device_is_logged_in_poptorchs_words(caplog):
    # PopTorch's optimizer tests read its "graph optimizer" / "group N optimizer" debug lines
    model = TwoLayers()
    optimizer = poptorch.optim.Adam(model.parameters(), lr=0.01, accum_type=torch.float16,
                                    second_order_momentum_accum_type=torch.float16)
    wrapper = poptorch.trainingModel(model, optimizer=optimizer)
    with caplog.at_level("DEBUG", logger="pipetorch.runtime.optimizer"):
        wrapper.compile(*regression_data(1, inputs=3, outputs=2, seed=0)[0])
        optimizer.param_groups[0]["lr"] = 0.5
        wrapper.setOptimizer(optimizer)
        wrapper.setOptimizer(optimizer)  # nothing changed: nothing sent, nothing logged
    lines = [r.getMessage() for r in caplog.records if "optimizer with" in r.getMessage()]
    assert lines[0].startswith("Updating graph optimizer with Adam: accumType=float16, "
                               "firstOrderMomentumAccumType=float32, "
                               "secondOrderMomentumAccumType=float16, defaultLearningRate=0.01,")
    assert lines[0].endswith("lossScaling=1 (const)")  # constant: compiled in (PopTorch's mark)
    assert lines[1].startswith("Updating group 0 optimizer with Adam: learningRate=0.01,")
    assert "learningRate=0.5," in lines[3] and len(lines) == 4
