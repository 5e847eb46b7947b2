"""Hyper-parameters of single parameters, differing from their param group's (PopTorch's
per-parameter `ipu_param` values), and the step that applies them.

PopTorch keeps every hyper-parameter per parameter (`learningRate___specific___fc.weight`),
so a checkpoint may give two parameters of one group two learning rates. pipetorch keeps
such a value in the optimiser's state of that parameter, under `KEY`: a dict of group keys
(`{"lr": 0.5}`) overriding the group's. Being state, it travels wherever the state goes (to
the stage workers, back to the host, into the user's `state_dict()`). `stepping` runs a step
with each set of parameters sharing overrides in a param group of its own, so torch's update
sees the values PopTorch would use; the user's groups are the same before and after.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, TypeAlias

import torch

__all__: list[str] = []

#: The state key of a parameter's own hyper-parameters (an empty dict: none).
KEY = "pipetorch_own_hyperparameters"

#: A param group as torch keeps it: "params" (the group's parameters) and the hyper-parameters
#: by name (lr, betas, flags, dtypes...), each of its own type, hence torch's dict[str, Any],
#: named here once. Also what a parameter overrides of its group (the dict under KEY).
ParamGroup: TypeAlias = dict[str, Any]


def own(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> ParamGroup:
    """The group keys `param` overrides (empty when it takes its group's values)."""
    if param not in optimizer.state:
        return {}
    return dict(optimizer.state[param].get(KEY) or {})


def settle(optimizer: torch.optim.Optimizer, group: ParamGroup,
           wanted: dict[torch.Tensor, ParamGroup]) -> None:
    """Give the parameters of `group` the hyper-parameters `wanted` (a parameter's whole
    group dict, "params" aside): the group's own values when every parameter agrees, else
    each parameter keeps what differs from the group under KEY."""
    first = next(iter(wanted.values()), None)
    if first is not None and len(wanted) == len(group["params"]) and all(
            values == first for values in wanted.values()):
        group.update(first)
        wanted = {param: group for param in wanted}
    for param, values in wanted.items():
        differs = {k: v for k, v in values.items() if k != "params" and group.get(k) != v}
        if differs or own(optimizer, param):
            # An empty dict (not a removed key) so that a push to the workers clears theirs.
            optimizer.state[param][KEY] = differs


@contextmanager
def stepping(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """While a step runs: each set of parameters with the same overrides in a group of its
    own, and KEY out of the state (a state holding only KEY is a fresh one to torch)."""
    held = {param: optimizer.state[param].pop(KEY)
            for group in optimizer.param_groups for param in group["params"]
            if param in optimizer.state and KEY in optimizer.state[param]}
    groups = optimizer.param_groups
    if any(held.values()):
        optimizer.param_groups = [part for group in groups for part in _split(group, held)]
    try:
        yield
    finally:
        optimizer.param_groups = groups
        for param, values in held.items():
            optimizer.state[param][KEY] = values


def _split(group: ParamGroup, held: dict[torch.Tensor, ParamGroup]) -> list[ParamGroup]:
    """`group` as groups of parameters sharing overrides: its own values first."""
    parts: dict[tuple[tuple[str, object], ...], list[torch.Tensor]] = {}
    for param in group["params"]:
        parts.setdefault(tuple(sorted((held.get(param) or {}).items())), []).append(param)
    return [{**group, **dict(values), "params": params} for values, params in parts.items()]
