"""Gradient buckets: the tensors of one all-reduce cut into flat runs of at most ~25 MB each.

A replica all-reduce used to join every gradient of a dtype into one buffer: 1x the
gradients in extra memory. Reducing bucket after bucket keeps the extra memory at one bucket.
A bucket holds whole tensors of one dtype and device while they fit and slices of a larger
(contiguous) tensor otherwise, so no bucket is over the limit:

    gradients  [ a (10 MB) ][ b (40 MB)                ][ c (5 MB) ]
    buckets    [ a, b[:15 MB] ] [ b[15:40 MB] ] [ c ]                  (limit 25 MB)

Summing elementwise does not care how the elements are grouped into messages: every element
is the sum of the same values over the same replicas as with one buffer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from pipetorch.optim.swap_buckets import BUCKET_BYTES  # one bucket size for every bucketing

__all__: list[str] = []


@dataclass(frozen=True)
class Piece:
    """Elements [start, stop) of `tensor` in its logical (row-major) order."""

    tensor: torch.Tensor
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start

    def view(self) -> torch.Tensor | None:
        """The piece as a flat view of `tensor`'s memory; None when `tensor` is not contiguous
        (its piece is then the whole tensor, see `buckets`)."""
        if not self.tensor.is_contiguous():
            return None
        return self.tensor.view(-1)[self.start:self.stop]

    def read(self) -> torch.Tensor:
        """The piece's values, flat (a view when possible)."""
        view = self.view()
        return view if view is not None else self.tensor.reshape(-1)

    def write(self, values: torch.Tensor) -> None:
        """Set the piece's elements to `values` (flat, `numel` long)."""
        view = self.view()
        if view is None:
            self.tensor.copy_(values.view_as(self.tensor))
        elif view.data_ptr() != values.data_ptr():
            view.copy_(values)


def buckets(tensors: Sequence[torch.Tensor], limit: int = BUCKET_BYTES) -> list[list[Piece]]:
    """`tensors` in buckets of at most `limit` bytes, each of one dtype and device, in order.

    A contiguous tensor is sliced across buckets where it does not fit; a non-contiguous one
    (rare for a gradient) goes whole into a bucket of its own when it is over `limit`.
    """
    if limit < 1:
        raise ValueError(f"A gradient bucket holds at least 1 byte, got limit={limit}")
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    out: list[list[Piece]] = []
    for group in groups.values():
        out += _cut(group, limit)
    return out


def _cut(tensors: list[torch.Tensor], limit: int) -> list[list[Piece]]:
    """Buckets of tensors of one dtype and device."""
    size = tensors[0].element_size()
    room = max(1, limit // size)  # elements per bucket
    out: list[list[Piece]] = []
    current: list[Piece] = []
    used = 0
    for tensor in tensors:
        total = tensor.numel()
        if not tensor.is_contiguous() and total > room - used:  # cannot be sliced
            out.append(current)
            current, used = [], 0
            if total > room:  # over the limit: a bucket of its own
                out.append([Piece(tensor, 0, total)])
                continue
        at = 0
        while at < total:
            if used == room:
                out.append(current)
                current, used = [], 0
            take = min(room - used, total - at)
            current.append(Piece(tensor, at, at + take))
            used += take
            at += take
    if current:
        out.append(current)
    return [bucket for bucket in out if bucket]
