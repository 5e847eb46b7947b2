"""The other stage workers an optimiser step sums with: for global-norm clipping and overflows.

A stage worker holds part of the model, so clipping's gradient norm and automatic loss
scaling's overflow count need sums over every device and replica. The worker runs each step
inside `during(peers)` and the step reads `current()`: nothing is stored on the user's
optimiser, and a step anywhere else (one process holding every stage) sums locally.
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
    """`reduce` sums a tensor over every stage and replica; `shares[id(param)]` is the part of
    a weight's squared norm that this copy adds (1 / copies for a weight tied across devices)."""

    reduce: Callable[[torch.Tensor], torch.Tensor]
    shares: dict[int, float]


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
