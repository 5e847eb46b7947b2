"""Tensors mapped from safetensors files: a model's weights read lazily, written back stage by
stage.

A mapped tensor's bytes stay in the file until something reads them, so a model whose
weights are mapped costs the host nothing until then. Each tensor gets a mapping of its own
(from the page holding its first byte), registered as a `Region`: sending the tensor to a
stage worker (parallel.comm.stream) sends the region, and the worker reads those bytes from the
file straight into its own memory. The host never reads them.

    file:  [8-byte size][JSON header][ tensor a | tensor b | tensor c ... ]
    host:               mapping of a ^   mapping of b ^ ...   (private: writes stay in memory)
    worker of stage 1:  reads b's region into its own memory

weights.saving writes a copy of the workers' weights to new files (tensor by tensor, as they
arrive) and then maps the host's tensors to them, so the host's copy of a model larger than
its memory is those files.

A region can also be *live* (weights.shared): a file in shared memory that a CPU
worker maps shared and trains in place, while the host maps it privately. What a tensor's
storage travels as (`travels_as`) and how it arrives (`load`) are decided here, for both kinds:
a region whose private pages were written since it was mapped (an edit on the host) goes as
bytes, since the file no longer holds what the tensor holds.
"""
from __future__ import annotations

import json
import mmap
import os
import struct
import weakref
from dataclasses import dataclass
from typing import Collection

import torch

__all__: list[str] = []

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
           "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


@dataclass(frozen=True)
class Region:
    """Bytes of a file that a tensor's storage maps: [offset, offset + length)."""

    path: str
    offset: int
    length: int
    key: str  # the tensor's name in the file
    live: bool = False  # a file of weights a worker trains in place (weights.shared)


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file: where its bytes are, its dtype and shape."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute offsets in the file
    end: int


_regions: dict[int, Region] = {}  # storage data pointer -> region, while the mapping lives
_mappings: dict[int, "weakref.ReferenceType[mmap.mmap]"] = {}  # the same pointers' mappings
_owned: dict[str, int] = {}  # path -> descriptor: live files this process made (their name may
# be gone: regions a worker sends back are mapped from the descriptor)
_PAGE = mmap.PAGESIZE


class SafetensorsFile:
    """A safetensors file's header, and its tensors mapped one by one."""

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)
        try:
            with open(self.path, "rb") as file:
                size, = struct.unpack("<Q", file.read(8))
                header = json.loads(file.read(size))
        except (OSError, ValueError, struct.error) as exc:
            raise ValueError(f"{path} is not a readable safetensors file ({exc}); write one "
                             "with safetensors.torch.save_file(model.state_dict(), path)") from exc
        self.header_bytes = 8 + size
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self.entries: dict[str, Entry] = {}
        for key, info in header.items():
            if info["dtype"] not in _DTYPES:
                raise ValueError(f"{path}: tensor {key!r} has dtype {info['dtype']}, which "
                                 f"pipetorch cannot map (it maps {sorted(_DTYPES)})")
            begin, end = info["data_offsets"]
            self.entries[key] = Entry(_DTYPES[info["dtype"]], tuple(info["shape"]),
                                      self.header_bytes + begin, self.header_bytes + end)

    def tensor(self, key: str) -> torch.Tensor:
        """`key`'s tensor, mapped privately (a write copies the page in memory; the file never
        changes)."""
        entry = self.entries[key]
        count = (entry.end - entry.start) // max(1, torch.empty((), dtype=entry.dtype).element_size())
        if entry.end == entry.start:
            return torch.empty(entry.shape, dtype=entry.dtype)
        offset = entry.start - entry.start % mmap.ALLOCATIONGRANULARITY
        flat = map_region(Region(self.path, offset, entry.end - offset, key))
        skip = entry.start - offset
        if skip % torch.empty((), dtype=entry.dtype).element_size():
            # an unaligned tensor (not written by safetensors): read into memory instead
            return flat[skip:].clone().view(entry.dtype).view(entry.shape)
        return flat[skip:].view(entry.dtype)[:count].view(entry.shape)


def map_region(region: Region, *, shared: bool = False) -> torch.Tensor:
    """`region`'s bytes as a flat uint8 tensor over a new mapping of them, registered (its
    storage is `region`): private (a write copies the page) or `shared` (a write goes to the
    file). A live file this process made is mapped from its descriptor."""
    owned = _owned.get(region.path)
    fd = os.open(region.path, os.O_RDWR if shared else os.O_RDONLY) if owned is None else owned
    try:
        memory = mmap.mmap(fd, region.length,
                           flags=mmap.MAP_SHARED if shared else mmap.MAP_PRIVATE,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=region.offset)
    finally:
        if owned is None:
            os.close(fd)
    flat = torch.frombuffer(memory, dtype=torch.uint8)
    pointer = flat.untyped_storage().data_ptr()
    _regions[pointer] = region
    _mappings[pointer] = weakref.ref(memory)
    weakref.finalize(memory, _forget, pointer)
    return flat


def _forget(pointer: int) -> None:
    _regions.pop(pointer, None)
    _mappings.pop(pointer, None)


def region_of(storage: torch.UntypedStorage) -> Region | None:
    """The file region `storage` maps, None for any other storage."""
    found = _regions.get(storage.data_ptr())
    return found if found is not None and found.length == storage.nbytes() else None


def own(path: str, fd: int) -> None:
    """This process made the live file `path` and keeps `fd` open (see map_region)."""
    _owned[path] = fd


def disown(path: str) -> None:
    _owned.pop(path, None)


def unmodified(storage: torch.UntypedStorage) -> bool:
    """Whether no page of `storage`'s mapping was written privately since it was mapped (its
    bytes are the file's): /proc/self/pagemap flags a page copied on write as anonymous."""
    start, length = storage.data_ptr(), storage.nbytes()
    first, last = start // _PAGE, (start + length - 1) // _PAGE
    try:
        with open("/proc/self/pagemap", "rb") as pagemap:
            pagemap.seek(first * 8)
            entries = pagemap.read((last - first + 1) * 8)
    except OSError:
        return False  # cannot tell: the bytes themselves are safe
    for (entry,) in struct.iter_unpack("<Q", entries):
        present_or_swapped, file_page = entry >> 62, (entry >> 61) & 1
        if present_or_swapped and not file_page:
            return False
    return True


def refresh(tensor: torch.Tensor) -> None:
    """Drop the private pages of `tensor`'s mapping: its next read sees the file (what a live
    file's worker wrote), as a copy from the worker would, without moving a byte."""
    storage = tensor.untyped_storage()
    memory = _mappings.get(storage.data_ptr())
    mapping = memory() if memory is not None else None
    if mapping is not None:
        mapping.madvise(mmap.MADV_DONTNEED, 0, len(mapping))


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` are the same view of mappings of one live file's region (a copy
    from one to the other is `refresh`)."""
    region = region_of(a.untyped_storage())
    return (region is not None and region.live and region == region_of(b.untyped_storage())
            and a.storage_offset() == b.storage_offset() and a.shape == b.shape
            and a.stride() == b.stride() and a.dtype == b.dtype)


def travels_as(storage: torch.UntypedStorage,
               shared: Collection[int] = ()) -> tuple[str, Region] | None:
    """How `storage` crosses to another process: ("shared", region) to be mapped shared by a
    worker whose `shared` pointers name it, ("mapped", region) to be read (or, a live file's
    region back at the host that made it, mapped), None as its own bytes: any other storage,
    a live file's region sent by the host that made it (its name may be gone), and a region
    written since it was mapped."""
    region = region_of(storage)
    if region is None:
        return None
    if region.live:
        if storage.data_ptr() in shared:
            return "shared", region
        if region.path in _owned:
            return None
    return ("mapped", region) if unmodified(storage) else None


def load(kind: str, region: Region) -> torch.UntypedStorage:
    """The storage of a region that arrived as `kind` (see travels_as)."""
    if kind == "shared" or (region.live and region.path in _owned):
        return map_region(region, shared=kind == "shared").untyped_storage()
    return read(region)


def read(region: Region) -> torch.UntypedStorage:
    """A new storage in this process's memory holding `region`'s bytes (read, not mapped)."""
    storage = torch.UntypedStorage(region.length)
    view = torch.empty(0, dtype=torch.uint8).set_(storage).numpy().data
    fd = os.open(region.path, os.O_RDONLY)
    try:
        done = 0
        while done < region.length:
            got = os.preadv(fd, [view[done:]], region.offset + done)
            if got == 0:
                raise OSError(f"{region.path} ended before byte {region.offset + region.length} "
                              f"(tensor {region.key!r}): was the file changed while in use?")
            done += got
    finally:
        os.close(fd)
    return storage
