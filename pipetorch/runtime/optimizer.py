"""The device's own copy of the user's optimiser, and hyper-parameter updates to it."""
from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn as nn

from pipetorch.errors import ConfigError

__all__: list[str] = []


def default_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """PopTorch's default when trainingModel gets no optimiser: SGD with lr=0.01."""
    from pipetorch.optim import SGD

    return SGD(model.parameters(), lr=0.01)


def device_optimizer(optimizer: torch.optim.Optimizer, host: nn.Module,
                     device: nn.Module, *, options: Any = None) -> torch.optim.Optimizer:
    """A copy of `optimizer` (hyper-parameters and state) that updates `device`'s parameters."""
    memo: dict[int, object] = {}
    for (name, h), (_, d) in zip(host.named_parameters(remove_duplicate=False),
                                 device.named_parameters(remove_duplicate=False)):
        memo[id(h)] = d
    for index, group in enumerate(optimizer.param_groups):
        strangers = [tuple(p.shape) for p in group["params"] if id(p) not in memo]
        if strangers:
            raise ConfigError(
                f"The optimiser's param group {index} holds {len(strangers)} tensors (shapes "
                f"{strangers[:3]}) that are not parameters of the wrapped model: build the "
                "optimiser from model.parameters() of the model you pass to trainingModel"
            )
    # deepcopy with the host parameters pre-mapped: groups, state and defaults are copied,
    # and every reference to a host parameter becomes the matching device parameter.
    clone = copy.deepcopy(optimizer, memo)
    for param, state in clone.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.device != param.device and value.dim():
                state[key] = value.to(param.device)
    return clone


def copy_hyperparameters(source: torch.optim.Optimizer, target: torch.optim.Optimizer) -> None:
    """setOptimizer: new learning rates etc. reach the device; its state stays."""
    if type(source) is not type(target):
        raise ConfigError(
            f"setOptimizer got a {type(source).__name__} but the model trains with a "
            f"{type(target).__name__}: keep the optimiser type, or build a new trainingModel"
        )
    if len(source.param_groups) != len(target.param_groups):
        raise ConfigError(
            f"setOptimizer got {len(source.param_groups)} param groups but the model was compiled "
            f"with {len(target.param_groups)}: keep the same groups"
        )
    for src, dst in zip(source.param_groups, target.param_groups):
        if len(src["params"]) != len(dst["params"]):
            raise ConfigError("setOptimizer: a param group holds a different number of parameters")
        dst.update({k: copy.deepcopy(v) for k, v in src.items() if k != "params"})
    for key in ("loss_scaling",):
        if hasattr(source, key):
            setattr(target, key, getattr(source, key))


def copy_state_to_host(device_opt: torch.optim.Optimizer, host_opt: torch.optim.Optimizer) -> None:
    """Give the user's optimiser the device's state, e.g. for a checkpoint."""
    host_opt.load_state_dict(copy.deepcopy(device_opt.state_dict()))
