"""The other stage workers an optimiser step sums with: for global-norm clipping and overflows.

A stage worker holds part of the model, so clipping's norm and loss scaling's overflow count
sum over every device and replica. The worker steps inside `during(peers)`, the step reads
`current()`: nothing is put on the user's optimiser; a step anywhere else sums locally.
"""
from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

__all__: list[str] = []


@dataclass(frozen=True)
class Peers:
    """`reduce` sums a tensor over every stage and replica."""

    reduce: Callable[[torch.Tensor], torch.Tensor]


_CURRENT: ContextVar[Peers | None] = ContextVar("pipetorch_step_peers", default=None)


def current() -> Peers | None:
    """The peers of the step running now; None outside a stage worker's step."""
    return _CURRENT.get()


@contextlib.contextmanager
def during(peers: Peers | None) -> Iterator[None]:
    """Optimiser steps in this block sum with `peers`."""
    token = _CURRENT.set(peers)
    try:
        yield
    finally:
        _CURRENT.reset(token)
