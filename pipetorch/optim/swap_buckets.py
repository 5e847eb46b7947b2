"""Swap buckets: the parameters whose float32 stand-ins one part of a step holds at once.

A float16 or bfloat16 parameter is updated through a float32 copy of itself and of its
gradient (8 bytes per parameter). Making those copies for a whole stage at once doubled a
16-bit stage's weight memory during `step()`; a step now goes bucket by bucket, so the
copies of one bucket (~25 MB of float32 parameters, or one larger parameter) exist at a time:

    group 0: [ a  b  c ][ d ][ e  f ]     group 1: [ g  h ]       (buckets, in order)

A bucket holds whole parameters of one param group in their order; torch's updates are
per parameter, so the numbers do not depend on how the parameters are grouped.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from pipetorch.optim.per_param import ParamGroup

__all__: list[str] = []

BUCKET_BYTES = 25 * 2**20  # as DistributedDataParallel's default bucket_cap_mb


@dataclass(frozen=True)
class Bucket:
    """Parameters `params` of param group number `group`."""

    group: int
    params: tuple[torch.Tensor, ...]


def working_bytes(param: torch.Tensor) -> int:
    """Bytes of a parameter's stand-in during the update: float32 at least."""
    return param.numel() * max(param.element_size(), 4)


def split(param_groups: Sequence[ParamGroup], limit: int | None = None) -> list[Bucket]:
    """The param groups' parameters cut into buckets of at most `limit` working bytes
    (`BUCKET_BYTES` by default), a larger parameter alone in its bucket."""
    limit = BUCKET_BYTES if limit is None else limit
    buckets: list[Bucket] = []
    for index, group in enumerate(param_groups):
        current: list[torch.Tensor] = []
        size = 0
        for param in group["params"]:
            if current and size + working_bytes(param) > limit:
                buckets.append(Bucket(index, tuple(current)))
                current, size = [], 0
            current.append(param)
            size += working_bytes(param)
        if current:
            buckets.append(Bucket(index, tuple(current)))
    return buckets
