"""Host inputs and outputs through shared memory: an arena per worker and direction (a memory
file, see memfd.py), so a host call pickles only a few places instead of its tensors.

    host --("run", call, Packed)--> worker      the inputs' bytes lie in the host's arena
    host <--("ok", outputs, Packed)-- worker    the outputs' bytes lie in the worker's arena

The writer lays the tensors out in its arena (stacking straight into it) and sends their places;
when they need more room than the arena has, it makes a larger file, whose address the
message carries. The host writes the next call's inputs only after every worker answered, and a
worker writes its next outputs only after the host sent the next call, so nobody writes what the
other is still reading, and a writer replaces its file only after the reader attached to it.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Sequence

import torch

from pipetorch import memfd
from pipetorch.partition.split import map_leaves

__all__: list[str] = []

_MINIMUM = 1 << 20


@dataclass(frozen=True)
class Place:
    """One tensor in an arena."""

    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class Packed:
    """Where a message's tensors lie; `grown`: the writer's new file (None: the reader's
    current one)."""

    places: tuple[Place, ...]
    grown: memfd.Address | None = None


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes of a tensor of this shape and dtype."""
    return math.prod(shape) * dtype.itemsize


def nbytes(place: Place) -> int:
    return _nbytes(place.shape, place.dtype)


class Arena:
    """One direction's shared bytes, seen by the writer and by the reader."""

    def __init__(self) -> None:
        self._made: memfd.Address | None = None  # the writer's file, kept open
        self._whole: torch.Tensor | None = None

    def view(self, place: Place) -> torch.Tensor:
        assert self._whole is not None
        nbytes = _nbytes(place.shape, place.dtype)
        return self._whole[place.offset:place.offset + nbytes].view(place.dtype).view(place.shape)

    # -- the writer ---------------------------------------------------------------------------
    def lay_out(self, shapes: Sequence[tuple[tuple[int, ...], torch.dtype]]
                ) -> tuple[Packed, list[torch.Tensor]]:
        """Places for tensors of these shapes and dtypes, and views to write them into."""
        places, at = [], 0
        for shape, dtype in shapes:
            places.append(Place(at, tuple(shape), dtype))
            at += memfd.aligned(_nbytes(shape, dtype))
        grown = None
        size = 0 if self._whole is None else self._whole.numel()
        if at > size:
            self.close()
            grown, self._whole = memfd.make(max(at, 2 * size, _MINIMUM))
            self._made = grown
        packed = Packed(tuple(places), grown)
        return packed, [self.view(p) for p in packed.places]

    def pack(self, tensors: Sequence[torch.Tensor]) -> Packed:
        packed, views = self.lay_out([(tuple(t.shape), t.dtype) for t in tensors])
        for view, tensor in zip(views, tensors, strict=True):
            view.copy_(tensor)
        return packed

    # -- the reader ---------------------------------------------------------------------------
    def unpack(self, packed: Packed) -> list[torch.Tensor]:
        """Views of the message's tensors (valid until the writer writes the next message)."""
        if packed.grown is not None:
            self._whole = memfd.attach(packed.grown)
        return [self.view(p) for p in packed.places]

    def close(self) -> None:
        """Forget the file; tensors still viewing it keep its memory."""
        if self._made is not None:
            os.close(self._made.fd)
        self._made, self._whole = None, None


StageOutputs = dict[int, dict[int, list[object]]]
"""A call's outputs on one device: stage -> micro-batch -> the values it returns to the host."""


def pack_tree(arena: Arena, value: StageOutputs) -> tuple[StageOutputs, Packed]:
    """`value` with its tensors replaced by their index in the Packed."""
    tensors: list[torch.Tensor] = []

    def strip(tensor: torch.Tensor) -> _Slot:
        tensors.append(tensor.detach())
        return _Slot(len(tensors) - 1)

    skeleton = map_leaves(value, torch.Tensor, strip)
    assert isinstance(skeleton, dict)  # map_leaves rebuilds the dicts
    return skeleton, arena.pack(tensors)


def unpack_tree(arena: Arena, skeleton: StageOutputs, packed: Packed) -> StageOutputs:
    """The value `pack_tree` stripped, its tensors copied out of the arena."""
    views = arena.unpack(packed)
    value = map_leaves(skeleton, _Slot, lambda slot: views[slot.index].clone())
    assert isinstance(value, dict)  # map_leaves rebuilds the dicts
    return value


@dataclass(frozen=True)
class _Slot:
    index: int
