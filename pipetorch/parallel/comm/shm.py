"""Bundles between two workers of one machine through shared memory: a ring of slots per peer,
tag and direction, signalled with one byte through a pipe (a FIFO) instead of a gloo message.

    sender                                          receiver
    pack into slot n % N   --- 1 byte, data FIFO --->   copy slot n % N out
    (waits for a free slot) <-- 1 byte, credit FIFO --   the slot is free again

The receiver makes each of its incoming channels (a segment and two FIFOs in /dev/shm), the
sender attaches, and the receiver unlinks all three as soon as both ends are open: from then on
the kernel frees them with the last process, however it ends. A peer that dies closes its FIFO
ends, which wakes the waiting side at once (end of file, or EPIPE); every wait is also bounded
by the timeout and checks that the peer still runs. A send that finds the ring full is packed
aside and delivered by later waits or by `flush`, as gloo's isend would, so a small ring never
deadlocks a schedule that gloo runs.
"""
from __future__ import annotations

import errno
import mmap
import os
import select
import struct
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import torch

from pipetorch.errors import DeviceError
from pipetorch.parallel.comm.transport import BundleLayout, ChannelSpec, LinkOptions, PeerLink, Tag

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's from Python 3.11

__all__: list[str] = []

FOLDER = Path("/dev/shm")
SLOTS = 3        # messages a sender may run ahead of its receiver without waiting
_HEADER = 64     # bytes before the slots: the pids of both ends
_ALIGN = 64      # every slot starts on a cache line
_CHECK = 0.5     # seconds between checks that the peer is still running while waiting


def segment_prefix(host_pid: int, launch: str) -> str:
    """The names of one launch's shared-memory files (`launch`: its rendezvous prefix)."""
    return f"pipetorch-shm-{os.getuid()}-{host_pid}-{launch.strip('/').rpartition('/')[2]}-"


def remove_leftovers(prefix: str) -> int:
    """Remove files named `prefix`* that a worker killed during start-up left; how many."""
    removed = 0
    for path in FOLDER.glob(f"{prefix}*"):
        path.unlink(missing_ok=True)
        removed += 1
    return removed


def _running(pid: int) -> bool:
    from pipetorch.parallel.layout.placement import running

    return pid > 0 and running(pid)


class _Channel:
    """One ring: `wait_fd` brings signals in (data or credits), `post_fd` sends them."""

    def __init__(self, spec: ChannelSpec, memory: mmap.mmap, slot_bytes: int,
                 wait_fd: int, post_fd: int, peer_pid: int) -> None:
        self.spec, self.memory, self.peer_pid = spec, memory, peer_pid
        self.wait_fd, self.post_fd = wait_fd, post_fd
        whole = torch.frombuffer(memory, dtype=torch.uint8)
        self.slots = [whole[_HEADER + n * slot_bytes:_HEADER + (n + 1) * slot_bytes]
                      for n in range(SLOTS)]
        self.count = 0                                # messages through this channel so far
        self.ready = SLOTS if spec.outgoing else 0    # free slots (sender), messages (receiver)
        self.pending: deque[torch.Tensor] = deque()   # packed sends waiting for a free slot
        self.closed = False                           # the peer closed its end

    def next_slot(self) -> torch.Tensor:
        slot = self.slots[self.count % SLOTS]
        self.count += 1
        self.ready -= 1
        return slot

    def take_signals(self) -> None:
        """Count the signals that arrived, without waiting."""
        try:
            got = os.read(self.wait_fd, 4096)
        except BlockingIOError:
            return
        if not got:
            self.closed = True
        self.ready += len(got)

    def post(self) -> None:
        try:
            os.write(self.post_fd, b"\x01")
        except (BrokenPipeError, OSError) as exc:
            self.closed = True
            raise _gone(self, f"its end of the shared-memory link is closed ({exc})") from None

    def deliver(self) -> None:
        """Move packed sends into free slots."""
        while self.pending and self.ready > 0:
            message = self.pending.popleft()
            if message.numel():
                self.next_slot()[:message.numel()].copy_(message)
            else:
                self.next_slot()
            self.post()

    def close(self) -> None:
        for fd in (self.wait_fd, self.post_fd):
            try:
                os.close(fd)
            except OSError:
                pass


def _gone(channel: _Channel, why: str) -> DeviceError:
    return DeviceError(f"Stage {channel.spec.peer} (pid {channel.peer_pid}) stopped answering: "
                       f"{why}; it has probably died")


class ShmLink(PeerLink):
    """PeerLink whose point-to-point bundles go through shared memory (workers of one machine).

    Replica all-reduces still go through torch.distributed. Call `open` once with every
    channel this worker sends or receives on, in every worker at the same time.
    """

    kind = "shm"

    def __init__(self, *, prefix: str, rank: int, **kwargs: Unpack[LinkOptions]) -> None:
        super().__init__(**kwargs)
        self.prefix, self.rank = prefix, rank
        self._in: dict[tuple[int, int], _Channel] = {}
        self._out: dict[tuple[int, int], _Channel] = {}
        self._seconds = self.timeout.total_seconds()

    # -- setting up ---------------------------------------------------------------------------
    def _path(self, source: int, target: int, tag: int, suffix: str) -> Path:
        return FOLDER / f"{self.prefix}{source}-{target}-{int(tag)}.{suffix}"

    def open(self, channels: Sequence[ChannelSpec]) -> None:
        """Make the incoming rings, attach to the outgoing ones, then unlink every file.

        No step waits on a later one in any worker, so the workers cannot deadlock here.
        """
        largest: dict[tuple[int, int, bool], int] = {}
        for c in channels:  # one ring per peer, tag and direction, sized for its largest message
            key = (c.peer, c.tag, c.outgoing)
            largest[key] = max(largest.get(key, 0), c.nbytes)
        specs = [ChannelSpec(peer, tag, outgoing, nbytes)
                 for (peer, tag, outgoing), nbytes in largest.items()]
        incoming = [c for c in specs if not c.outgoing]
        try:
            made = [self._make(c) for c in incoming]
            for spec in specs:
                if spec.outgoing:
                    self._attach(spec)
            for spec, data_fd in zip(incoming, made):
                self._finish(spec, data_fd)
        except BaseException:
            for spec in incoming:  # what this side made and has not unlinked yet
                for suffix in ("tmp", "seg", "data", "credit"):
                    self._path(self.offset + spec.peer, self.rank, spec.tag, suffix).unlink(
                        missing_ok=True)
            raise

    def _sizes(self, spec: ChannelSpec) -> tuple[int, int]:
        slot = (spec.nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        return slot, _HEADER + SLOTS * max(slot, _ALIGN)

    def _make(self, spec: ChannelSpec) -> int:
        peer = self.offset + spec.peer
        path = lambda suffix: self._path(peer, self.rank, spec.tag, suffix)  # noqa: E731
        os.mkfifo(path("data"), 0o600)
        os.mkfifo(path("credit"), 0o600)
        data_fd = os.open(path("data"), os.O_RDONLY | os.O_NONBLOCK)
        _, size = self._sizes(spec)
        staging = path("tmp")
        fd = os.open(staging, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            os.pwrite(fd, struct.pack("q", os.getpid()), 0)
        finally:
            os.close(fd)
        os.rename(staging, path("seg"))  # the sender waits for this name: everything is ready
        return data_fd

    def _attach(self, spec: ChannelSpec) -> None:
        peer = self.offset + spec.peer
        path = lambda suffix: self._path(self.rank, peer, spec.tag, suffix)  # noqa: E731
        self._until(lambda: path("seg").exists(), f"stage {spec.peer}'s shared memory")
        fd = os.open(path("seg"), os.O_RDWR)
        try:
            _, size = self._sizes(spec)
            memory = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        memory[8:16] = struct.pack("q", os.getpid())
        # data before credit: the receiver unlinks every file once credit has a reader
        data_fd = os.open(path("data"), os.O_WRONLY | os.O_NONBLOCK)
        credit_fd = os.open(path("credit"), os.O_RDONLY | os.O_NONBLOCK)
        peer_pid = struct.unpack("q", memory[0:8])[0]
        self._out[(peer, spec.tag)] = _Channel(spec, memory, self._sizes(spec)[0], credit_fd,
                                               data_fd, peer_pid)

    def _finish(self, spec: ChannelSpec, data_fd: int) -> None:
        peer = self.offset + spec.peer
        path = lambda suffix: self._path(peer, self.rank, spec.tag, suffix)  # noqa: E731
        credit_fd = -1

        def opened() -> bool:  # the sender has opened its reading end of the credit FIFO
            nonlocal credit_fd
            try:
                credit_fd = os.open(path("credit"), os.O_WRONLY | os.O_NONBLOCK)
            except OSError as exc:
                if exc.errno != errno.ENXIO:
                    raise
            return credit_fd >= 0

        self._until(opened, f"stage {spec.peer} to attach to the shared memory")
        fd = os.open(path("seg"), os.O_RDWR)
        try:
            memory = mmap.mmap(fd, self._sizes(spec)[1])
        finally:
            os.close(fd)
        for suffix in ("seg", "data", "credit"):
            path(suffix).unlink(missing_ok=True)
        peer_pid = struct.unpack("q", memory[8:16])[0]
        self._in[(peer, spec.tag)] = _Channel(spec, memory, self._sizes(spec)[0], data_fd,
                                              credit_fd, peer_pid)

    def _until(self, done, what: str) -> None:
        deadline = time.monotonic() + self._seconds
        pause = 1e-4
        while not done():
            if time.monotonic() > deadline:
                raise DeviceError(f"Waited {self._seconds:.0f}s for {what} (PIPETORCH_TIMEOUT)")
            time.sleep(pause)
            pause = min(pause * 2, 0.01)

    # -- traffic ------------------------------------------------------------------------------
    def send(self, layout: BundleLayout, tensors: Sequence[torch.Tensor], peer: int,
             tag: int) -> None:
        if not layout.specs:
            return
        self._send(self._out[(self.offset + peer, tag)], layout, tensors)
        self.bytes_sent += layout.nbytes

    def _send(self, channel: _Channel, layout: BundleLayout | None,
              tensors: Sequence[torch.Tensor]) -> None:
        channel.take_signals()
        channel.deliver()
        if channel.ready > 0 and not channel.pending:
            slot = channel.next_slot()
            if layout is not None:
                layout.pack_into(tensors, slot[:layout.nbytes])
            channel.post()
        else:  # the ring is full: keep a packed copy for a later wait or flush to deliver
            channel.pending.append(layout.pack(tensors, self.wire_device) if layout is not None
                                   else torch.empty(0, dtype=torch.uint8))

    def recv(self, layout: BundleLayout, peer: int, tag: int) -> list[torch.Tensor]:
        if not layout.specs:
            return []
        channel = self._in[(self.offset + peer, tag)]
        self._await(channel)
        buffer = channel.next_slot()[:layout.nbytes].clone()
        channel.post()  # the slot is free again
        self.bytes_received += layout.nbytes
        return layout.unpack(buffer)

    def signal(self, peer: int, tag: int = Tag.DONE) -> None:
        self._send(self._out[(self.offset + peer, tag)], None, ())

    def wait_signal(self, peer: int, tag: int = Tag.DONE) -> None:
        channel = self._in[(self.offset + peer, tag)]
        self._await(channel)
        channel.next_slot()
        channel.post()

    def flush(self) -> None:
        """Wait until every packed-aside send is in a slot."""
        for channel in self._out.values():
            while channel.pending:
                self._await(channel, deliver=True)

    def settle(self) -> None:
        """A send the full ring packed aside is delivered only by this process: deliver
        every one (waiting for the receiver to free slots)."""
        self.flush()

    def _await(self, channel: _Channel, *, deliver: bool = False) -> None:
        """Until `channel` has a signal (or, with `deliver`, has no send pending), delivering
        other channels' pending sends meanwhile; a closed or dead peer raises at once."""
        deadline = time.monotonic() + self._seconds
        poller = None
        while True:
            channel.take_signals()
            if deliver:
                channel.deliver()
                if not channel.pending:
                    return
            elif channel.ready > 0:
                return
            if channel.closed:
                raise _gone(channel, "its end of the shared-memory link closed")
            behind = [c for c in self._out.values() if c.pending and c is not channel]
            for other in behind:
                other.take_signals()
                other.deliver()
            if poller is None or behind:
                poller = select.poll()
                for c in {channel, *behind}:
                    poller.register(c.wait_fd, select.POLLIN)
            now = time.monotonic()
            if now > deadline:
                raise DeviceError(f"No data from stage {channel.spec.peer} within "
                                  f"{self._seconds:.0f}s (PIPETORCH_TIMEOUT)")
            if not poller.poll(min(_CHECK, deadline - now) * 1000) and \
                    not _running(channel.peer_pid):
                raise _gone(channel, "its process is no longer running")

    def close(self) -> None:
        for channel in [*self._in.values(), *self._out.values()]:
            channel.close()
        self._in.clear()
        self._out.clear()


def new_link(kind: str, *, prefix: str, rank: int, **kwargs: Unpack[LinkOptions]) -> PeerLink:
    """The link of `kind` (from `link_kind`); `kwargs` go to PeerLink."""
    if kind == "shm":
        return ShmLink(prefix=prefix, rank=rank, **kwargs)
    return PeerLink(**kwargs)
