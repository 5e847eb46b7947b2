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

from pipetorch.optim.per_param import ParamGroup

__all__: list[str] = []

#: A param group key: its tensors are this replica's slices of weights whose optimiser state
#: is sharded over the replicas (parallel.worker.sharded_step), not whole weights.
SLICED = "pipetorch_sliced"


@dataclass(frozen=True)
class Peers:
    """`reduce` sums a tensor over every stage and replica, each replica's (identical) share
    counted once. With replicated tensor sharding, `slices` replicas each hold a different
    slice of a sliced weight, and `slice_sum` sums over them (LAMB's per-weight norms)."""

    reduce: Callable[[torch.Tensor], torch.Tensor]
    slices: int = 1
    slice_sum: Callable[[torch.Tensor], torch.Tensor] | None = None

    def weight(self, group: ParamGroup) -> float:
        """What a term of `group`'s tensors counts for in `reduce`: a slice is held by one
        of `slices` replicas, where a whole weight is on each."""
        return float(self.slices) if group.get(SLICED) else 1.0


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
