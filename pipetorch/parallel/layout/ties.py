"""Weights tied across devices, found at compile time: each tied parameter, the devices holding
a copy and its name in each stage (parallel.worker.tied keeps the copies equal)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch.nn as nn

from pipetorch.partition.split import StagedModel

__all__: list[str] = []

DeviceSet = tuple[int, ...]


@dataclass(frozen=True)
class Tie:
    """A parameter held on several devices of a replica."""

    name: str                          # in the user's model
    devices: DeviceSet                 # the devices holding a copy, ascending
    held: tuple[tuple[int, str], ...]  # (stage, the parameter's name in that stage's module)


def ties_of(model: nn.Module, staged: StagedModel, owners: Sequence[int]) -> tuple[Tie, ...]:
    """Every parameter of `model` tied across devices (`owners[s]`: the device of stage s), by
    name: the same list for every worker."""
    ties = []
    for name, stages in sorted(staged.tied().items()):
        param = model.get_parameter(name)
        held = tuple((s, _name_in(staged.modules[s], param)) for s in stages)
        ties.append(Tie(name, tuple(sorted(owners[s] for s in stages)), held))
    return tuple(ties)


def _name_in(module: nn.Module, param: nn.Parameter) -> str:
    return next(n for n, p in module.named_parameters(remove_duplicate=False) if p is param)


def device_sets(ties: Sequence[Tie]) -> list[DeviceSet]:
    """The distinct sets of devices sharing a weight, in one order for every worker."""
    return sorted({t.devices for t in ties})


def stepped_elsewhere(ties: Sequence[Tie], stages: Sequence[int],
                      owners: Sequence[int]) -> set[str]:
    """Names (in the user's model) of the tied weights that `stages` hold but do not step:
    a stage on a device after the first one holding the weight."""
    return {t.name for t in ties for stage, _ in t.held
            if stage in stages and owners[stage] != t.devices[0]}
