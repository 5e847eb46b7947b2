"""How a host optimiser reaches the compiled model that trains its parameters: the link a
trainingModel installs, and the sync/push calls through it (used by ipu_state, ipu_param and
scaling, which must not import each other)."""
from __future__ import annotations

import weakref
from typing import Callable, Mapping, TypeVar

import torch
from torch.utils.hooks import RemovableHandle

__all__: list[str] = []

_V = TypeVar("_V")

_LINK = "_pipetorch_ipu_link"
POPTORCH_ROOT = "model."  # PopTorch's IR name of the user's model: `Accl___model.fc.weight`


def poptorch_name(name: str) -> str:
    """PopTorch's IR name of the user model's parameter `name`: `fc.weight` -> `model.fc.weight`."""
    return POPTORCH_ROOT + name


def resolve(name: str, known: Mapping[str, object]) -> str | None:
    """The key of `known` (PopTorch's names) that `name` stands for: itself, or, spelled
    without PopTorch's root (`fc.weight`, as pipetorch wrote before), its PopTorch name."""
    if name in known:
        return name
    return poptorch_name(name) if poptorch_name(name) in known else None


def poptorch_keys(values: dict[str, _V], known: Mapping[str, object]) -> dict[str, _V]:
    """`values` (`Accl___fc.weight`, `learningRate___specific___fc.weight`: the parameter
    after the last `___`) with each parameter named as in `known`, where `resolve` finds it."""
    spelled = {}
    for key, value in values.items():
        head, sep, name = key.rpartition("___")
        found = resolve(name, known) if sep else None
        spelled[f"{head}{sep}{found}" if found else key] = value
    return spelled


class Link:
    """How a host optimiser reaches its compiled model: parameter names and a sync."""

    def __init__(self, names: dict[int, str], sync: Callable[[], None],
                 push: Callable[[], None]) -> None:
        self.names = names
        self._sync, self._push = weakref.WeakMethod(sync), weakref.WeakMethod(push)
        self.hook: RemovableHandle | None = None  # the optimiser's state_dict pre-hook

    def sync(self) -> None:
        method = self._sync()
        if method is not None:
            method()

    def push(self) -> None:
        method = self._push()
        if method is not None:
            method()


def linked_names(optimizer: torch.optim.Optimizer) -> dict[int, str] | None:
    """Parameter id -> name in the compiled model, None before a trainingModel compiled."""
    found: Link | None = optimizer.__dict__.get(_LINK)
    return None if found is None else found.names


def sync(optimizer: torch.optim.Optimizer) -> None:
    """Bring the device's latest state and hyper-parameters to `optimizer` (if compiled)."""
    found: Link | None = optimizer.__dict__.get(_LINK)
    if found is not None:
        found.sync()


def push(optimizer: torch.optim.Optimizer) -> None:
    """Make `optimizer`'s state and hyper-parameters the device's (if compiled)."""
    found: Link | None = optimizer.__dict__.get(_LINK)
    if found is not None:
        found.push()
