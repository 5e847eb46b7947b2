"""Bundles between two workers of one machine through shared memory: a ring of slots per peer,
tag and direction, signalled with one byte through a pipe instead of a gloo message.

    sender                                          receiver
    pack into slot n % N   --- 1 byte, data pipe --->   copy slot n % N out
    (waits for a free slot) <-- 1 byte, credit pipe --   the slot is free again

The receiver makes each of its incoming rings (a memory file, see memfd.py) and its two pipes and
puts their address in the launch's store; the sender opens them through /proc and says so in
the ring's header, and the receiver then closes the ends that are the sender's. Nothing has a
name, so the kernel frees everything with the last process, however it ends. A peer that dies
closes its pipe ends, which wakes the waiting side at once (end of file, or EPIPE); every wait
is also bounded by the timeout and checks that the peer still runs. A send that finds the ring
full is packed aside and delivered by later waits or by `flush`, as gloo's isend would, so a
small ring never deadlocks a schedule that gloo runs.
"""
from __future__ import annotations

import os
import select
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import torch
import torch.distributed as dist

from pipetorch.errors import DeviceError
from pipetorch import memfd
from pipetorch.parallel.comm.transport import BundleLayout, ChannelSpec, LinkOptions, PeerLink, Tag

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's from Python 3.11

__all__: list[str] = []

SLOTS = 3        # messages a sender may run ahead of its receiver without waiting
_HEADER = 64     # bytes before the slots: the pids of both ends (int64 0: receiver, 1: sender)
_CHECK = 0.5     # seconds between checks that the peer is still running while waiting


def _running(pid: int) -> bool:
    from pipetorch.parallel.layout.placement import running

    return pid > 0 and running(pid)


@dataclass(frozen=True)
class _Made:
    """An incoming ring as its receiver made it, before the sender attached."""

    spec: ChannelSpec
    address: memfd.Address
    whole: torch.Tensor
    data: tuple[int, int]     # the data pipe: (read, write)
    credit: tuple[int, int]   # the credit pipe: (read, write)

    def published(self) -> str:
        """What the store holds for the sender: where to open each of its ends."""
        return f"{self.address.pid} {self.address.fd} {self.address.size} " \
               f"{self.data[1]} {self.credit[0]}"


class _Channel:
    """One ring: `wait_fd` brings signals in (data or credits), `post_fd` sends them."""

    def __init__(self, spec: ChannelSpec, whole: torch.Tensor, slot_bytes: int,
                 wait_fd: int, post_fd: int, peer_pid: int) -> None:
        self.spec, self.peer_pid = spec, peer_pid
        self.wait_fd, self.post_fd = wait_fd, post_fd
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

    def __init__(self, *, store: dist.Store, name: str, rank: int,
                 **kwargs: Unpack[LinkOptions]) -> None:
        super().__init__(**kwargs)
        self.store, self.name, self.rank = store, name, rank
        self._in: dict[tuple[int, int], _Channel] = {}
        self._out: dict[tuple[int, int], _Channel] = {}
        self._seconds = self.timeout.total_seconds()

    # -- setting up ---------------------------------------------------------------------------
    def _key(self, source: int, target: int, tag: int) -> str:
        return f"shm/{self.name}{source}-{target}-{int(tag)}"

    def open(self, channels: Sequence[ChannelSpec]) -> None:
        """Make the incoming rings, attach to the outgoing ones, then close the ends that the
        senders opened.

        No step waits on a later one in any worker, so the workers cannot deadlock here.
        """
        largest: dict[tuple[int, int, bool], int] = {}
        for c in channels:  # one ring per peer, tag and direction, sized for its largest message
            key = (c.peer, c.tag, c.outgoing)
            largest[key] = max(largest.get(key, 0), c.nbytes)
        specs = [ChannelSpec(peer, tag, outgoing, nbytes)
                 for (peer, tag, outgoing), nbytes in largest.items()]
        made: list[_Made] = []
        try:
            for spec in specs:
                if not spec.outgoing:
                    made.append(self._make(spec))
            for spec in specs:
                if spec.outgoing:
                    self._attach(spec)
            while made:
                self._finish(made[-1])
                made.pop()
        finally:
            for ring in made:  # a failure before the sender attached
                for fd in (ring.address.fd, *ring.data, *ring.credit):
                    os.close(fd)

    def _sizes(self, spec: ChannelSpec) -> tuple[int, int]:
        slot = max(memfd.aligned(spec.nbytes), memfd.ALIGN)
        return slot, _HEADER + SLOTS * slot

    def _make(self, spec: ChannelSpec) -> _Made:
        address, whole = memfd.make(self._sizes(spec)[1])
        whole[:_HEADER].view(torch.int64)[0] = os.getpid()
        ring = _Made(spec, address, whole, os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC),
                     os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC))
        self.store.set(self._key(self.offset + spec.peer, self.rank, spec.tag), ring.published())
        return ring

    def _attach(self, spec: ChannelSpec) -> None:
        key = self._key(self.rank, self.offset + spec.peer, spec.tag)
        self._until(lambda: self.store.check([key]), f"stage {spec.peer}'s shared memory")
        pid, fd, size, data, credit = map(int, self.store.get(key).split())
        slot, expected = self._sizes(spec)
        if size != expected:
            raise DeviceError(f"Stage {spec.peer} made a ring of {size} bytes for messages that "
                              f"need {expected} here: the two workers disagree on the shapes "
                              "they exchange")
        whole = memfd.attach(memfd.Address(pid, fd, size))
        data_fd = memfd.reopen(pid, data, os.O_WRONLY | os.O_NONBLOCK)
        credit_fd = memfd.reopen(pid, credit, os.O_RDONLY | os.O_NONBLOCK)
        self._out[(self.offset + spec.peer, spec.tag)] = _Channel(spec, whole, slot, credit_fd,
                                                                 data_fd, pid)
        whole[:_HEADER].view(torch.int64)[1] = os.getpid()  # attached: the receiver may close

    def _finish(self, ring: _Made) -> None:
        """Once the sender holds its ends: close ours of them (so its death ends our pipes)."""
        spec, pids = ring.spec, ring.whole[:_HEADER].view(torch.int64)
        self._until(lambda: int(pids[1]) != 0, f"stage {spec.peer} to attach to the shared memory")
        for fd in (ring.address.fd, ring.data[1], ring.credit[0]):
            os.close(fd)
        self.store.delete_key(self._key(self.offset + spec.peer, self.rank, spec.tag))
        self._in[(self.offset + spec.peer, spec.tag)] = _Channel(
            spec, ring.whole, self._sizes(spec)[0], ring.data[0], ring.credit[1], int(pids[1]))

    def _until(self, done: Callable[[], bool], what: str) -> None:
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


def new_link(kind: str, *, store: dist.Store, name: str, rank: int,
             **kwargs: Unpack[LinkOptions]) -> PeerLink:
    """The link of `kind` (from `link_kind`), its rings named `name` in `store` (unique in the
    launch); `kwargs` go to PeerLink."""
    if kind == "shm":
        return ShmLink(store=store, name=name, rank=rank, **kwargs)
    return PeerLink(**kwargs)
