"""A ring of pre-allocated shared-memory batch slots, and the messages that pass them around.

One shared buffer holds `buffer_size` slots; a slot holds one host call's tensors, laid out
back to back. The loader process writes a slot and sends READY; the user's process reads the
slot in place (its tensors are views of shared memory) and sends FREE when it asks for the
next batch. Only slot numbers cross the pipe, never tensor data:

    loader process                      user process
    write slot 0 ---- READY(0) ------>  next() -> views of slot 0
    write slot 1 ---- READY(1) ------>
    write slot 2 ---- READY(2) ------>  next(): FREE(0), views of slot 1
    (waits for a FREE) <-- FREE(0) ---
    write slot 0 ...

The buffer is a shared memory file (pipetorch/memfd.py, as the activations use): the
loader makes it and keeps its descriptor until the user's process has attached (ACK). It has no
name, so nothing can be left behind; the memory goes back to the system when both processes
have dropped their mappings.
"""
from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeAlias

import torch

from pipetorch import memfd
from pipetorch.data.fetch import DirectFetch
from pipetorch.data.structure import flatten

__all__: list[str] = []


class Msg(enum.IntEnum):
    """Messages on the loader pipe: loader -> user (SETUP..ERROR), user -> loader (ACK..)."""

    SETUP = 0       # (layout, tree, the buffer's memfd.Address, items_per_slot)
    READY = 1       # (slot, sizes): sizes None for a full slot, else each tensor's rows
    EPOCH_END = 2
    RESET_ACK = 3
    ERROR = 4       # (type name, message, traceback text, pickled exception or None)
    ACK = 10        # the user's process has mapped the buffer
    FREE = 11       # (slot,)
    START = 12      # the user started (or moved on to) an epoch
    RESET = 13      # the user abandoned the epoch: drop everything, start a fresh one
    SHUTDOWN = 14


# READY's sizes: None for a full slot, else each tensor's rows (None for a 0-d tensor).
SlotSizes: TypeAlias = "tuple[int | None, ...] | None"
# A message from the user's process to the loader: (kind,), or (FREE, slot).
Command: TypeAlias = "tuple[Msg] | tuple[Msg, int]"


@dataclass(frozen=True)
class SlotLayout:
    """Shapes, dtypes and byte offsets of the tensors in one slot."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    offsets: tuple[int, ...]
    slot_bytes: int

    @classmethod
    def of(cls, leaves: list[torch.Tensor], *, rows: int | None = None) -> SlotLayout:
        """A layout fitting `leaves`; `rows` (rebatching) replaces every first dimension."""
        shapes, offsets, position = [], [], 0
        for leaf in leaves:
            shape = tuple(leaf.shape)
            if rows is not None:
                shape = (rows, *shape[1:])
            shapes.append(shape)
            offsets.append(position)
            position += memfd.aligned(math.prod(shape) * leaf.element_size())  # on a cache line
        return cls(tuple(shapes), tuple(t.dtype for t in leaves), tuple(offsets),
                   max(position, memfd.ALIGN))

    def views(self, buffer: torch.Tensor, slot: int) -> list[torch.Tensor]:
        """The tensors of `slot`, as views of the shared byte buffer."""
        base = slot * self.slot_bytes
        out = []
        for shape, dtype, offset in zip(self.shapes, self.dtypes, self.offsets, strict=True):
            size = math.prod(shape) * dtype.itemsize
            raw = buffer[base + offset: base + offset + size]
            out.append(raw.view(dtype).view(shape))
        return out

    def check(self, leaves: list[torch.Tensor], *, where: str, any_rows: bool = False) -> None:
        """Raise unless `leaves` fit the slots: the first dimension may be shorter (or any
        length when rebatching), everything else must match the first batch."""
        if len(leaves) != len(self.shapes):
            raise ValueError(
                f"{where} has {len(leaves)} tensors but the first batch had {len(self.shapes)}:"
                " every batch must have the same structure.")
        for i, (leaf, shape, dtype) in enumerate(zip(leaves, self.shapes, self.dtypes,
                                                     strict=True)):
            fits = tuple(leaf.shape) == shape or (
                leaf.dim() == len(shape) and leaf.dim() > 0
                and tuple(leaf.shape[1:]) == shape[1:]
                and (any_rows or leaf.shape[0] <= shape[0]))
            # A dtype the slot's holds without loss (torch.promote_types) is cast on copy, as
            # torch.cat would join it with the first batch; any other dtype cannot be stored.
            if not fits or torch.promote_types(leaf.dtype, dtype) != dtype:
                raise ValueError(
                    f"{where}: tensor {i} is {list(leaf.shape)} {leaf.dtype} but the ring "
                    f"buffer slots hold {list(shape)} {dtype} (shaped by the first batch). "
                    "Asynchronous loading needs every batch shaped like the first (only a "
                    "last, partial batch may be shorter) and of a dtype the first batch's "
                    "promotes it to: pad or resize the samples, cast them to one dtype, or use "
                    "mode=DataLoaderMode.Sync.")


def pin(buffer: torch.Tensor) -> bool:
    """Page-lock the buffer for fast, asynchronous copies to a GPU; False without CUDA."""
    if not torch.cuda.is_available():
        return False
    status = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0)
    return int(status) == 0


def unpin(buffer: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())


class SlotWriter:
    """Loader-side writer: copies batches into free slots and announces full ones.

    With `rows_per_slot` it repacks: batches of any size are cut and joined so every slot
    holds exactly `rows_per_slot` items (the epoch's last slot may hold fewer). Without it,
    each batch fills one slot. `wait_for_free` blocks until a FREE message arrived (it appends
    to `free`); `publish(slot, sizes)` sends READY.
    """

    def __init__(self, layout: SlotLayout, buffer: torch.Tensor, slots: int, *,
                 rows_per_slot: int | None, wait_for_free: Callable[[], None],
                 publish: Callable[[int, SlotSizes], None]) -> None:
        self.layout = layout
        self.views = [layout.views(buffer, s) for s in range(slots)]
        self.rows_per_slot = rows_per_slot
        self.free: deque[int] = deque(range(slots))
        self._wait_for_free = wait_for_free
        self._publish = publish
        self._current: int | None = None
        self._filled = 0
        self.batches_seen = 0

    def reset(self) -> None:
        """Forget every slot's content: all slots are free again."""
        self.free = deque(range(len(self.views)))
        self._current, self._filled = None, 0
        self.batches_seen = 0

    def _acquire(self) -> int:
        while not self.free:
            self._wait_for_free()
        return self.free.popleft()

    def write(self, item: object) -> None:
        """Copy one batch (a nested batch or a DirectFetch) into the ring."""
        self.batches_seen += 1
        where = f"batch {self.batches_seen} of the epoch"
        if isinstance(item, DirectFetch) and self._fits_directly(item.rows):
            self._write_direct(item)
            return
        if isinstance(item, DirectFetch):
            item = item.materialize()
        leaves, _ = flatten(item, where=where)
        if self.rows_per_slot is None:
            self._write_whole(leaves, where)
        else:
            self._write_rows(leaves, where)

    def _fits_directly(self, rows: int) -> bool:
        if self.rows_per_slot is None:
            return rows == self.layout.shapes[0][0]
        return rows <= self.rows_per_slot - self._filled

    def _write_direct(self, item: DirectFetch) -> None:
        if self._current is None:
            self._current, self._filled = self._acquire(), 0
        start, stop = self._filled, self._filled + item.rows
        item.write_into([v[start:stop] for v in self.views[self._current]])
        self._filled = stop
        if self.rows_per_slot is None or stop == self.rows_per_slot:
            self._publish(self._current, None)
            self._current, self._filled = None, 0

    def _write_whole(self, leaves: list[torch.Tensor], where: str) -> None:
        self.layout.check(leaves, where=where)
        slot = self._acquire()
        sizes = []
        for leaf, view in zip(leaves, self.views[slot], strict=True):
            rows = leaf.shape[0] if leaf.dim() else None
            (view[:rows] if rows is not None else view).copy_(leaf)
            sizes.append(rows)
        full = all(s is None or s == v.shape[0]
                   for s, v in zip(sizes, self.views[slot], strict=True))
        self._publish(slot, None if full else tuple(sizes))

    def _write_rows(self, leaves: list[torch.Tensor], where: str) -> None:
        self.layout.check(leaves, where=where, any_rows=True)
        assert self.rows_per_slot is not None  # write() rebatches only with it
        rows = leaves[0].shape[0]
        if any(leaf.shape[0] != rows for leaf in leaves):
            raise ValueError(
                f"{where}: rebatching needs every tensor to have the same first (batch) "
                f"dimension, got {[list(t.shape) for t in leaves]}.")
        done = 0
        while done < rows:
            if self._current is None:
                self._current, self._filled = self._acquire(), 0
            take = min(rows - done, self.rows_per_slot - self._filled)
            for leaf, view in zip(leaves, self.views[self._current], strict=True):
                view[self._filled:self._filled + take].copy_(leaf[done:done + take])
            self._filled += take
            done += take
            if self._filled == self.rows_per_slot:
                self._publish(self._current, None)
                self._current, self._filled = None, 0

    def finish_epoch(self, *, keep_partial: bool) -> None:
        """Announce (or drop) the slot that the epoch's last rows only partly filled."""
        self.batches_seen = 0
        if self._current is None:
            return
        slot, filled = self._current, self._filled
        self._current, self._filled = None, 0
        if keep_partial and filled:
            self._publish(slot, tuple(filled for _ in self.layout.shapes))
        else:
            self.free.appendleft(slot)
