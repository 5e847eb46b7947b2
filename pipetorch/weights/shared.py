"""The host copy's weights shared with its CPU stage workers: in memory once, not twice.

A CPU worker holds its stage's weights and trains them; the host holds its copy of the model
(PopTorch's host copy, which reading a weight after a call refreshes). Kept apart, the weights
sit in memory twice. Instead, at each launch the host writes the parameters of the first
replica's CPU stages into one anonymous memory file (memfd: no name in /dev/shm, so nothing
is left behind however the processes end, and no /dev/shm size limit applies) and maps its own
parameters to it privately; their workers open it through /proc/<host pid>/fd/<fd>, map it
shared and train it in place:

    memory file:  [ w0 | w1 | w2 ... ]        one page-aligned region per storage
    worker:       mapped shared: its optimiser steps write the file
    host:         mapped privately: a read sees the file; a write (an edit on the host)
                  copies the page, which the workers never see (host edits reach the device
                  only through copyWeightsToDevice, which sends that copy's bytes)

A copy to the host then moves nothing: the worker names its region, and the host drops its
private pages of it (mapped.refresh), as a copy would overwrite them. The host keeps the
file's descriptor until the engine closes, to map the regions a worker names; its mappings
keep the memory after that.

Weights tied across devices are shared by their first device only (two workers stepping one
memory would apply each update twice); replicas after the first, and GPU workers, read their
own copy. A training call cut short (a worker killed mid-step) can leave the file half
updated, so a training engine shares only while the workers write snapshots
(PIPETORCH_SNAPSHOTS is not 0) and they write one at launch: recovery restores from it.
"""
from __future__ import annotations

import itertools
import logging
import mmap
import os
import weakref
from typing import Iterable

import torch

from pipetorch import memfd
from pipetorch.weights import mapped

__all__: list[str] = []

logger = logging.getLogger(__name__)

_files = itertools.count()  # names this process's files apart (a closed fd's number is reused)


class SharedWeights:
    """One launch's file of weights, and the host's tensors mapped to it.

    `tensors` are the host's tensors moved into it; a worker whose message names their
    storages' data pointers among its `shared` ones maps those regions shared (stream.send)."""

    def __init__(self, path: str, fd: int, tensors: list[torch.Tensor]) -> None:
        self.path, self.tensors = path, tensors
        self._finalizer = weakref.finalize(self, _close, path, fd)

    @property
    def pointers(self) -> frozenset[int]:
        """The data pointers of the file's storages, one per region."""
        return frozenset(t.untyped_storage().data_ptr() for t in self.tensors)

    @classmethod
    def write(cls, params: Iterable[torch.Tensor]) -> SharedWeights | None:
        """Move `params` (CPU tensors; others are left as they are) into a new memory file,
        each storage once, their tensors keeping their objects; None (and nothing moved) when
        no such file can be made or hold them."""
        by_storage: dict[int, list[torch.Tensor]] = {}
        for tensor in params:
            storage = tensor.untyped_storage()
            region = mapped.region_of(storage)
            if (tensor.device.type != "cpu" or storage.nbytes() == 0
                    or (region is not None and not region.live)):  # a weights file's: read
                continue
            by_storage.setdefault(storage.data_ptr(), []).append(tensor)
        if not by_storage or not memfd.reachable():
            return None
        offsets, total = [], 0
        for tensors in by_storage.values():
            offsets.append(total)
            total += memfd.aligned(tensors[0].untyped_storage().nbytes(),
                                   mmap.ALLOCATIONGRANULARITY)
        try:
            fd = memfd.new_file(total, name="pipetorch-weights", reserve=True)
        except OSError as exc:
            logger.info("Weights not shared with the workers: no memory file of %.2f GB (%s); "
                        "each holds its own copy", total / 1e9, exc)
            return None
        path, name = f"/proc/{os.getpid()}/fd/{fd}", next(_files)
        mapped.own(path, fd)
        with torch.no_grad():
            for n, (tensors, offset) in enumerate(zip(by_storage.values(), offsets, strict=True)):
                storage = tensors[0].untyped_storage()
                _write_all(fd, storage, offset)
                flat = mapped.map_region(mapped.Region(path, offset, storage.nbytes(),
                                                       f"file{name}/storage{n}", live=True))
                for tensor in tensors:
                    tensor.data = torch.empty(0, dtype=tensor.dtype).set_(
                        flat.untyped_storage(), tensor.storage_offset(), tensor.shape,
                        tensor.stride())
        return cls(path, fd, [t for ts in by_storage.values() for t in ts])

    def refresh(self) -> None:
        """Drop the host's private pages: its tensors read the file (what the workers hold)
        again, and the memory of pages the host wrote or read to send is freed."""
        for tensor in self.tensors:
            mapped.refresh(tensor)

    def close(self) -> None:
        self._finalizer()


def _close(path: str, fd: int) -> None:
    mapped.disown(path)
    os.close(fd)


def _write_all(fd: int, storage: torch.UntypedStorage, offset: int) -> None:
    data = torch.empty(0, dtype=torch.uint8).set_(storage).numpy().data
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)

