"""How a host optimiser reaches the compiled model that trains its parameters: the link a
trainingModel installs, and the sync/push calls through it (used by ipu_state, ipu_param and
scaling, which must not import each other)."""
from __future__ import annotations

import weakref
from typing import Any, Callable

import torch

__all__: list[str] = []

_LINK = "_pipetorch_ipu_link"


class Link:
    """How a host optimiser reaches its compiled model: parameter names and a sync."""

    def __init__(self, names: dict[int, str], sync: Callable[[], None],
                 push: Callable[[], None]) -> None:
        self.names = names
        self._sync, self._push = weakref.WeakMethod(sync), weakref.WeakMethod(push)
        self.hook: Any = None  # the optimiser's state_dict pre-hook (a RemovableHandle)

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
