"""Host inputs and outputs through shared memory: an arena per worker and direction, passed once
by file descriptor, so a host call pickles only a few descriptors instead of its tensors.

    host --("run", call, Packed)--> worker      the inputs' bytes lie in the host's arena
    host <--("ok", outputs, Packed)-- worker    the outputs' bytes lie in the worker's arena

The writer lays the tensors out in its arena (stacking straight into it) and sends their places;
when they need more room than the arena has, it makes a larger one (an anonymous memfd, never a
file) and the descriptor follows the message over the same socket. The host writes the next
call's inputs only after every worker answered, and a worker writes its next outputs only after
the host sent the next call, so nobody writes what the other is still reading.
"""
from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle, send_handle
from typing import Sequence

import torch

from pipetorch.partition.export import Tree
from pipetorch.partition.split import map_leaves

__all__: list[str] = []

_ALIGN = 64
_MINIMUM = 1 << 20


@dataclass(frozen=True)
class Place:
    """One tensor in an arena."""

    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class Packed:
    """Where a message's tensors lie; `grown`: the size of a new arena whose descriptor follows
    the message (None: the receiver's current one)."""

    places: tuple[Place, ...]
    grown: int | None = None


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes of a tensor of this shape and dtype."""
    count = 1
    for size in shape:
        count *= size
    return count * torch.empty((), dtype=dtype).element_size()


def nbytes(place: Place) -> int:
    return _nbytes(place.shape, place.dtype)


class Arena:
    """One direction's shared bytes, seen by the writer and by the reader."""

    def __init__(self) -> None:
        self.fd = -1
        self.size = 0
        self._whole: torch.Tensor | None = None

    def _map(self, fd: int, size: int, *, keep: bool) -> None:
        """Map `fd`; keep it open only while it still has to be sent (the mapping holds its
        own reference, so an arena costs no descriptor once shared)."""
        self.close()
        self.size = size
        self._whole = torch.frombuffer(mmap.mmap(fd, size), dtype=torch.uint8)
        if keep:
            self.fd = fd
        else:
            os.close(fd)

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
            at += (_nbytes(shape, dtype) + _ALIGN - 1) // _ALIGN * _ALIGN
        grown = None
        if at > self.size:
            grown = max(at, 2 * self.size, _MINIMUM)
            fd = os.memfd_create("pipetorch-arena", os.MFD_CLOEXEC)
            os.ftruncate(fd, grown)
            self._map(fd, grown, keep=True)
        packed = Packed(tuple(places), grown)
        return packed, [self.view(p) for p in packed.places]

    def pack(self, tensors: Sequence[torch.Tensor]) -> Packed:
        packed, views = self.lay_out([(tuple(t.shape), t.dtype) for t in tensors])
        for view, tensor in zip(views, tensors):
            view.copy_(tensor)
        return packed

    def send_growth(self, conn: Connection, packed: Packed) -> None:
        """After sending the message that carries `packed`: its new arena, if it has one."""
        if packed.grown is not None:
            send_handle(conn, self.fd, 0)
            os.close(self.fd)
            self.fd = -1

    # -- the reader ---------------------------------------------------------------------------
    def unpack(self, conn: Connection, packed: Packed) -> list[torch.Tensor]:
        """Views of the message's tensors (valid until the writer writes the next message)."""
        if packed.grown is not None:
            self._map(recv_handle(conn), packed.grown, keep=False)
        return [self.view(p) for p in packed.places]

    def close(self) -> None:
        """Forget the mapping; tensors still viewing it keep it alive."""
        if self.fd >= 0:
            os.close(self.fd)
        self.fd, self.size, self._whole = -1, 0, None


def pack_tree(arena: Arena, value: Tree) -> tuple[Tree, Packed]:
    """`value` (lists, tuples, dicts) with its tensors replaced by their index in the Packed."""
    tensors: list[torch.Tensor] = []

    def strip(tensor: torch.Tensor) -> _Slot:
        tensors.append(tensor.detach())
        return _Slot(len(tensors) - 1)

    skeleton = map_leaves(value, torch.Tensor, strip)
    return skeleton, arena.pack(tensors)


def unpack_tree(arena: Arena, conn: Connection, skeleton: Tree, packed: Packed) -> Tree:
    """The value `pack_tree` stripped, its tensors copied out of the arena."""
    views = arena.unpack(conn, packed)
    return map_leaves(skeleton, _Slot, lambda slot: views[slot.index].clone())


@dataclass(frozen=True)
class _Slot:
    index: int
