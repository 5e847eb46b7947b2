"""Messages with tensors over a pipe, storage by storage: no pickled copy of their bytes.

`send` pickles a message with every tensor storage taken out (a persistent id in its place),
then sends each storage's bytes straight from the tensor's memory, in chunks. `receive`
unpickles the skeleton with empty storages and reads the bytes straight into them. A message
holding a model's stage thus costs the sender nothing beyond its tensors (one chunk at a time
for a GPU tensor, copied to host memory) and the receiver exactly one copy of them, where a
pickled buffer costs each side a second copy of the whole message.

    sender                                   receiver
    [skeleton: pickle, sizes]  ------------> unpickle: storages allocated, empty
    [storage 0, chunk 0]       ------------> read into storage 0
    [storage 0, chunk 1] ...   ------------> ...

A message whose storages hold at most INLINE bytes (a generation step, a reply) goes as one
pipe message instead, its storages' bytes after the skeleton: one write and one wake-up of the
reader where a message of five small tensors took six.

A storage mapped from a file (weights.mapped) goes as its file region instead: the receiver
reads those bytes from the file (or maps them: weights the host shares with a CPU worker,
weights.shared), and the sender never touches them.

User code travels by value: cloudpickle's pickler pickles the classes, functions and hooks of
the user's `__main__` (a script, `python -c`, a notebook) by value, and everything importable
by reference. A message that names nothing of `__main__` and that the standard library's C
pickler can take (a generation step, a reply, the values a stage hands on) is pickled by it
instead, its tensors reduced by entries of its dispatch table: a fifth of cloudpickle's cost,
whose Python hook runs for every object. A worker's `__main__` is not the user's, and running
the user's script again in each worker (multiprocessing spawn's `__mp_main__`) would need a
`__main__` guard and cannot work for `python -c` or a notebook. A class sent by value comes
back from a worker as the user's own class (cloudpickle tracks it).

Every read is bounded: `timeout` seconds without a byte arriving raises TimeoutError, and a
sender that dies mid-message closes the pipe (EOFError). A message that arrives whole but
cannot be rebuilt (a class the receiver cannot import, a weights file gone) raises
Undeliverable, with the message's bytes read off the pipe.
"""
from __future__ import annotations

import copyreg
import functools
import io
import os
import pickle
import struct
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Callable, Collection

import cloudpickle
import torch

from pipetorch.weights import mapped

__all__: list[str] = []

CHUNK = 16 << 20  # bytes per pipe message: bounds what a GPU storage stages in host memory
INLINE = 1 << 20  # a message whose storages hold at most this many bytes is one pipe message
# (1 MB: 16 sequences' logits, 512 KB, come back in one write; benchmarks/generate.py, 16
# sequences in 2 lanes: 0.91x plain HF, 0.84x with 64 KB)
_INLINE = struct.Struct("!IB")  # the first frame opens with its header's bytes and 1 if inline
POLL = 0.2  # seconds between checks that the other side is still there, while waiting


def bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the storage's memory (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class Undeliverable(Exception):
    """A message arrived but could not be rebuilt here; its cause is chained."""


class _Storages:
    """What both picklers share: each tensor storage taken out once, in order (or named by its
    file region), for a reference in the pickle."""

    def __init__(self, shared: Collection[int], *, files: bool = True) -> None:
        self.storages: list[torch.UntypedStorage] = []
        self._seen: dict[int, int] = {}
        self._shared, self._files = shared, files

    def reference(self, untyped: torch.UntypedStorage, dtype: torch.dtype | None) -> tuple:
        region = mapped.travels_as(untyped, self._shared) if self._files else None
        if region is not None:  # a file's bytes: the receiver reads or maps them
            return (*region, dtype)
        key = untyped._cdata
        if key not in self._seen:
            self._seen[key] = len(self.storages)
            self.storages.append(untyped)
        return ("storage", self._seen[key], dtype)


def _typed(obj: object) -> tuple[torch.UntypedStorage, torch.dtype | None] | None:
    """A storage's untyped bytes and dtype (None: not a storage, or one on the meta device)."""
    if isinstance(obj, torch.storage.TypedStorage):
        untyped, dtype = obj._untyped_storage, obj.dtype
    elif isinstance(obj, torch.UntypedStorage):
        untyped, dtype = obj, None
    else:
        return None
    return None if untyped.device.type == "meta" else (untyped, dtype)


class _Pickler(cloudpickle.Pickler):
    """Pickles tensors' storages by reference and the user's `__main__` code by value."""

    def __init__(self, file: io.BytesIO, taken: _Storages) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.taken = taken

    def persistent_id(self, obj: object) -> tuple | None:
        typed = _typed(obj)
        return None if typed is None else self.taken.reference(*typed)


class _FastPickler(pickle.Pickler):
    """The C pickler, tensors and storages reduced to `_stored` calls by entries of its
    dispatch table (looked up by exact type: no Python call for any other object)."""

    def __init__(self, file: io.BytesIO, taken: _Storages) -> None:
        self.taken = taken
        self.dispatch_table = {**copyreg.dispatch_table, torch.Tensor: self._tensor,
                               torch.UntypedStorage: self._storage,
                               torch.storage.TypedStorage: self._storage}
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)

    def _tensor(self, tensor: torch.Tensor) -> tuple:
        if tensor.layout != torch.strided or tensor.is_quantized or tensor.is_nested or \
                tensor.is_conj() or tensor.is_neg() or tensor.device.type == "meta" or \
                tensor.__dict__:
            return tensor.__reduce_ex__(pickle.HIGHEST_PROTOCOL)  # torch's, storages by _storage
        place = self.taken.reference(tensor.untyped_storage(), None)
        return _stored, (place, tensor.dtype, tensor.storage_offset(), tuple(tensor.shape),
                         tensor.stride(), tensor.requires_grad)

    def _storage(self, storage: torch.UntypedStorage | torch.storage.TypedStorage
                 ) -> str | tuple:
        typed = _typed(storage)
        if typed is None:
            return storage.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
        return _stored, (self.taken.reference(*typed),)


def _stored(*args: object) -> object:
    """Stands for the receiving _Unpickler's `_stored` (its find_class swaps them)."""
    raise pickle.UnpicklingError("a pipetorch message unpickled outside stream.unpack")


class _Unpickler(pickle.Unpickler):
    """Rebuilds the skeleton over `storages`, the ones the sender took out, in its order."""

    def __init__(self, file: io.BytesIO, storages: list[torch.UntypedStorage]) -> None:
        super().__init__(file)
        self.storages = storages
        self._read: dict[mapped.Region, torch.UntypedStorage] = {}

    def persistent_load(self, pid: tuple) -> torch.UntypedStorage | torch.storage.TypedStorage:
        return _placed(self.storages, self._read, pid)

    def find_class(self, module: str, name: str) -> Any:
        if module == __name__ and name == "_stored":
            # not a bound method: the memo holding it would keep this unpickler, and every
            # storage it made, alive until the garbage collector finds the cycle
            return functools.partial(_rebuilt, self.storages, self._read)
        return super().find_class(module, name)


def _placed(storages: list[torch.UntypedStorage], read: dict[mapped.Region, torch.UntypedStorage],
            pid: tuple) -> torch.UntypedStorage | torch.storage.TypedStorage:
    """The storage a persistent id names: one the sender took out, or a file's region."""
    kind, index, dtype = pid
    if kind != "storage":
        if index not in read:
            read[index] = mapped.load(kind, index)
        untyped = read[index]
    else:
        untyped = storages[index]
    if dtype is None:
        return untyped
    return torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)


def _rebuilt(storages: list[torch.UntypedStorage], read: dict[mapped.Region, torch.UntypedStorage],
             place: tuple, dtype: torch.dtype | None = None, offset: int = 0,
             shape: tuple[int, ...] = (), stride: tuple[int, ...] = (),
             requires_grad: bool = False) -> object:
    """A `_stored` call of the sender: a storage (`place` alone), or a tensor over one, given
    its dtype, offset, shape, stride and requires_grad."""
    untyped = _placed(storages, read, place)
    if dtype is None:
        return untyped
    rebuilt = torch.empty(0, dtype=dtype, device=untyped.device).set_(
        untyped, offset, shape, stride)
    return rebuilt.requires_grad_() if requires_grad else rebuilt


_MAIN = b"__main__"  # a pickle naming it refers to the user's script: cloudpickle's then


def pack(message: object, *, shared: Collection[int] = (), files: bool = True
         ) -> tuple[bytes, list[torch.UntypedStorage]]:
    """`message` pickled with every tensor storage taken out, as a header that names their
    sizes; the storages, whose bytes the receiver reads into those `unpack` is given.
    `files` False: a storage mapped from a file goes as its bytes too (to another machine)."""
    buffer, taken = io.BytesIO(), _Storages(shared, files=files)
    try:
        _FastPickler(buffer, taken).dump(message)
        fast = buffer.getvalue()
        skeleton = None if _MAIN in fast or cloudpickle.list_registry_pickle_by_value() else fast
    except Exception:  # noqa: BLE001 - cloudpickle's pickler takes it, or says why not
        skeleton = None
    if skeleton is None:
        buffer, taken = io.BytesIO(), _Storages(shared, files=files)
        _Pickler(buffer, taken).dump(message)
        skeleton = buffer.getvalue()
    sizes = [s.nbytes() for s in taken.storages]
    header = pickle.dumps((sizes, skeleton), protocol=pickle.HIGHEST_PROTOCOL)
    return header, taken.storages


def unpack(header: bytes, storage: Callable[[int], torch.UntypedStorage]
           ) -> tuple[_Unpickler, list[int]]:
    """The unpickler of a `pack`ed message over new storages (`storage(size)`), and their
    sizes: its load() rebuilds the message once their bytes are read in."""
    sizes, skeleton = pickle.loads(header)
    return _Unpickler(io.BytesIO(skeleton), [storage(size) for size in sizes]), sizes


@dataclass(frozen=True)
class Encoded:
    """A message as the frames `send` writes: encoded once, written to several pipes."""

    frames: tuple[Any, ...]  # bytes, or uint8 tensors on the CPU
    nbytes: int


def encode(message: object, *, shared: Collection[int] = ()) -> Encoded:
    """`message`'s frames: its header, then each storage's bytes in chunks; a message whose
    storages hold at most INLINE bytes is one frame (one write, one wake-up of the reader:
    a generation step's small tensors each cost a write and a wake-up otherwise)."""
    header, storages = pack(message, shared=shared)
    total = sum(storage.nbytes() for storage in storages)
    if total <= INLINE:
        return Encoded((_inline(header, storages),), len(header) + total)
    frames: list[Any] = [_INLINE.pack(len(header), 0) + header]
    for storage in storages:
        whole = bytes_of(storage)
        frames.extend(whole[start:start + CHUNK] for start in range(0, storage.nbytes(), CHUNK))
    return Encoded(tuple(frames), len(header) + total)


def _inline(header: bytes, storages: list[torch.UntypedStorage]) -> bytes:
    """One frame: the header, then the storages' bytes (joined: one copy)."""
    parts = [bytes_of(storage).cpu().numpy().data for storage in storages]
    return b"".join([_INLINE.pack(len(header), 1), header, *parts])


def _filled(storages: list[torch.UntypedStorage], frame: bytes, at: int) -> None:
    """Read the storages' bytes out of an inline frame, from byte `at` on."""
    for storage in storages:
        whole = bytes_of(storage).numpy()
        whole[:] = memoryview(frame)[at:at + len(whole)]
        at += len(whole)


def dumps(message: object) -> bytes:
    """`message` (tensors on the CPU) as bytes for another machine: every storage's own bytes
    after the header, mapped ones too; `loads` rebuilds it. A call's outputs of 8 micro-batches
    go and come back in 0.27 ms, against torch.save and load's 0.95 (on every call of a
    pipeline over processes)."""
    return _inline(*pack(message, files=False))


def loads(frame: bytes) -> Any:
    """The message `dumps` made."""
    length, _ = _INLINE.unpack_from(frame)
    unpickler, _ = unpack(frame[_INLINE.size:_INLINE.size + length], torch.UntypedStorage)
    message = unpickler.load()
    _filled(unpickler.storages, frame, _INLINE.size + length)
    return message


def send(conn: Connection, message: object, *, shared: Collection[int] = ()) -> int:
    """Send `message` (any picklable object holding tensors on any device, or its Encoded
    frames); its bytes. The receiver maps the live regions whose storages' data pointers are
    in `shared`."""
    encoded = message if isinstance(message, Encoded) else encode(message, shared=shared)
    for frame in encoded.frames:
        if isinstance(frame, torch.Tensor):
            frame = (frame if frame.device.type == "cpu" else frame.cpu()).numpy()
        conn.send_bytes(frame)
    return encoded.nbytes


def receive(conn: Connection, *, timeout: float,
            alive: Callable[[], bool] | None = None) -> tuple[Any, int]:
    """The next message and its bytes, the wait for its first byte bounded by `timeout` s
    (TimeoutError) and each later read likewise; `alive()` False ends the wait (EOFError).
    A message that cannot be rebuilt raises Undeliverable once its bytes are read."""
    wait(conn, timeout, alive)
    first = conn.recv_bytes()
    length, inline = _INLINE.unpack_from(first)
    header = first[_INLINE.size:_INLINE.size + length]
    unpickler, sizes = unpack(header, torch.UntypedStorage)
    try:
        message = unpickler.load()
    except Exception as exc:
        for size in sizes if not inline else ():  # their chunks follow: read them off the pipe
            scratch = memoryview(bytearray(min(size, CHUNK)))
            for start in range(0, size, CHUNK):
                wait(conn, timeout, alive)
                _read_message_into(conn, scratch[:min(CHUNK, size - start)])
        raise Undeliverable(f"{type(exc).__name__}: {exc}") from exc
    if inline:
        _filled(unpickler.storages, first, _INLINE.size + length)
        return message, len(header) + sum(sizes)
    for storage in unpickler.storages:
        whole = bytes_of(storage).numpy()
        for start in range(0, storage.nbytes(), CHUNK):
            wait(conn, timeout, alive)
            _read_message_into(conn, whole.data[start:start + CHUNK])
    return message, len(header) + sum(sizes)


def wait(conn: Connection, timeout: float, alive: Callable[[], bool] | None = None) -> None:
    """Until `conn` has bytes to read: TimeoutError after `timeout` s, EOFError once
    `alive()` says the other side's process is gone."""
    deadline = time.monotonic() + timeout
    while not conn.poll(POLL):
        if alive is not None and not alive():
            raise EOFError("the process that started this worker has exited")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no message within {timeout:.0f}s")


def _read_message_into(conn: Connection, view: memoryview) -> None:
    """Read one framed message (Connection's format: a 4-byte size, or -1 and an 8-byte
    one) straight into `view`, which must be its size."""
    fd = conn.fileno()
    size, = struct.unpack("!i", _read_exact(fd, 4))
    if size == -1:
        size, = struct.unpack("!Q", _read_exact(fd, 8))
    if size != len(view):
        raise OSError(f"a tensor chunk of {size} bytes arrived where {len(view)} were expected")
    got = 0
    while got < size:
        n = os.readv(fd, [view[got:]])
        if n == 0:
            raise EOFError("the sender closed the pipe mid-message")
        got += n


def _read_exact(fd: int, n: int) -> bytes:
    data = b""
    while len(data) < n:
        part = os.read(fd, n - len(data))
        if not part:
            raise EOFError("the sender closed the pipe mid-message")
        data += part
    return data
