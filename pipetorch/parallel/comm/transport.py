"""Where a micro-batch crosses devices: bundles of tensors sent point-to-point between workers.

A bundle (the activations one stage hands the next, or the gradients coming back) travels
as one message: its tensors are packed back to back into one byte buffer, so a transfer pays
the per-message latency once. Both ends know every bundle's shapes and dtypes from the
compile-time shape pass, so nothing but the data crosses. Transfers go through
torch.distributed: gloo between CPU processes, NCCL between GPUs (gloo with a copy through
host memory when two workers share one GPU, which NCCL refuses).
"""
from __future__ import annotations

import datetime
import enum
import functools
from dataclasses import dataclass
from typing import Sequence, TypedDict

import torch
import torch.distributed as dist

from pipetorch import environment
from pipetorch.errors import DeviceError
from pipetorch import memfd
from pipetorch.parallel.comm.buckets import BUCKET_BYTES, Piece, buckets
from pipetorch.parallel.layout.routes import TensorSpec

__all__: list[str] = []

_ALIGN = 16  # bytes: every packed tensor starts at an offset its dtype can be viewed at


class Tag(enum.IntEnum):
    """Kinds of traffic between stages."""

    ACTIVATIONS = 1
    GRADIENTS = 2
    DONE = 3


def channel(tag: Tag, stage: int) -> int:
    """The message tag of `tag` traffic sent by stage `stage`: two workers holding several
    stages (ipus 0, 1, 0, 1) never mix up the bundles of different stages."""
    return int(tag) + len(Tag) * stage


def started(work: dist.Work | None) -> dist.Work:
    """A point-to-point transfer's handle: torch.distributed gives None only to a rank outside
    the group, and these transfers use the default group, which holds every rank."""
    assert work is not None
    return work


@dataclass(frozen=True)
class BundleLayout:
    """Byte offsets of a bundle's tensors inside its packed buffer."""

    specs: tuple[TensorSpec, ...]

    @functools.cached_property
    def offsets(self) -> list[int]:
        offsets, at = [], 0
        for spec in self.specs:
            offsets.append(at)
            at += memfd.aligned(spec.nbytes, _ALIGN)
        return offsets

    @functools.cached_property
    def nbytes(self) -> int:
        return sum(memfd.aligned(spec.nbytes, _ALIGN) for spec in self.specs)

    def check(self, tensors: Sequence[torch.Tensor]) -> None:
        """DeviceError unless `tensors` have the layout's shapes and dtypes."""
        for spec, tensor in zip(self.specs, tensors, strict=True):
            if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
                raise DeviceError(
                    f"A value crossing stages has shape {list(tensor.shape)} and dtype "
                    f"{tensor.dtype}, but the stages were compiled for {list(spec.shape)} "
                    f"{spec.dtype}: forward must produce the same shapes on every call (no "
                    "shape that depends on the data)")

    def pack(self, tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
        """One uint8 buffer holding `tensors` (checked against the layout)."""
        buffer = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        self.pack_into(tensors, buffer)
        return buffer

    def pack_into(self, tensors: Sequence[torch.Tensor], buffer: torch.Tensor) -> None:
        """Copy `tensors` into `buffer` (uint8, `nbytes` long, 16-byte aligned) at the offsets."""
        self.check(tensors)
        for spec, at, tensor in zip(self.specs, self.offsets, tensors, strict=True):
            if spec.nbytes:  # a typed view takes any strides in one copy
                buffer[at:at + spec.nbytes].view(spec.dtype).view(spec.shape).copy_(
                    tensor.detach())

    def unpack(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Fresh leaf tensors viewing `buffer`'s bytes."""
        return [buffer[at:at + spec.nbytes].view(spec.dtype).view(spec.shape).detach()
                for spec, at in zip(self.specs, self.offsets, strict=True)]


@dataclass(frozen=True)
class ChannelSpec:
    """One direction of traffic with one peer: its tag and the largest message it carries."""

    peer: int          # the peer as `send` / `recv` name it (its rank is offset + peer)
    tag: int           # a Tag, or any message tag both ends agree on
    outgoing: bool
    nbytes: int


@dataclass
class InFlight:
    """An all-reduce of one bucket that was started and not yet waited for."""

    work: dist.Work
    flat: torch.Tensor      # the bucket's elements as they cross (summed in place)
    bucket: list[Piece]
    who: str                # named in a timeout's message


class _LinkPlaces(TypedDict):
    device: torch.device
    wire_device: torch.device
    timeout: float


class LinkOptions(_LinkPlaces, total=False):
    """PeerLink's keyword arguments, as `shm.new_link` passes them on."""

    offset: int
    replica_group: dist.ProcessGroup | None
    backend: str


class PeerLink:
    """Point-to-point bundles between this worker and the other workers of its replica.

    A peer is a worker's device number within the replica (its rank is `offset + peer`);
    `tag` is a `channel`. Sends are asynchronous: the buffer is kept until `flush` (called
    once per schedule step) makes sure every send finished. On gloo a receive blocks for at
    most `timeout` seconds; on NCCL it only orders the compute stream after the transfer
    (see `_wait`). `backend` is torch.distributed's ("gloo" or "nccl").
    """

    def __init__(self, *, device: torch.device, wire_device: torch.device, timeout: float,
                 offset: int = 0, replica_group: dist.ProcessGroup | None = None,
                 backend: str = "gloo") -> None:
        self.backend = backend
        self.device, self.wire_device = device, wire_device
        self.offset = offset                 # rank of this replica's device 0
        self.replica_group = replica_group   # this device in every replica (None: one replica)
        self.timeout = datetime.timedelta(seconds=timeout)
        self.bytes_sent = 0
        self.bytes_received = 0
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []
        self.bucket_bytes = BUCKET_BYTES  # the most an all-reduce sends at once

    @property
    def kind(self) -> str:
        """How bundles cross, as traces name it: the backend ("gloo" or "nccl")."""
        return self.backend

    def send(self, layout: BundleLayout, tensors: Sequence[torch.Tensor], peer: int,
             tag: int) -> None:
        if not layout.specs:
            return
        buffer = layout.pack(tensors, self.wire_device)
        self._pending.append((started(dist.isend(buffer, self.offset + peer, tag=int(tag))),
                              buffer))
        self.bytes_sent += buffer.numel()

    def recv(self, layout: BundleLayout, peer: int, tag: int) -> list[torch.Tensor]:
        if not layout.specs:
            return []
        buffer = torch.empty(layout.nbytes, dtype=torch.uint8, device=self.wire_device)
        self._wait(started(dist.irecv(buffer, self.offset + peer, tag=int(tag))), peer)
        self.bytes_received += buffer.numel()
        if self.wire_device != self.device:
            buffer = buffer.to(self.device, non_blocking=True)
        return layout.unpack(buffer)

    def signal(self, peer: int, tag: int) -> None:
        """A data-less message (one byte): 'micro-batch done' in sharded inference."""
        flag = torch.ones(1, dtype=torch.uint8, device=self.wire_device)
        self._pending.append((started(dist.isend(flag, self.offset + peer, tag=tag)), flag))

    def wait_signal(self, peer: int, tag: int) -> None:
        flag = torch.empty(1, dtype=torch.uint8, device=self.wire_device)
        self._wait(started(dist.irecv(flag, self.offset + peer, tag=tag)), peer)

    def all_reduce(self, tensors: Sequence[torch.Tensor], *, group: dist.ProcessGroup | None = None,
                   who: str = "the other replicas") -> None:
        """Sum `tensors` in place over this device's replicas (or over `group`, the workers
        named `who` in a timeout's message), one bucket (`buckets.BUCKET_BYTES`) at a time
        through one reused buffer per dtype: the extra memory is one bucket, not a copy of
        every tensor."""
        scratch: dict[torch.dtype, torch.Tensor] = {}
        for bucket in buckets(tensors, self.bucket_bytes):
            self.finish_all_reduce(self.start_all_reduce(bucket, group=group, who=who,
                                                         scratch=scratch))

    def start_all_reduce(self, bucket: list[Piece], *, group: dist.ProcessGroup | None = None,
                         who: str = "the other replicas",
                         scratch: dict[torch.dtype, torch.Tensor] | None = None) -> InFlight:
        """Start summing one bucket over the replicas (or `group`); `finish_all_reduce` waits
        and writes the sums back. Without `scratch` the bucket gets a buffer of its own, so
        several can be in flight at once."""
        flat = self._gather(bucket, {} if scratch is None else scratch)
        process_group = self.replica_group if group is None else group
        return InFlight(dist.all_reduce(flat, group=process_group, async_op=True), flat,
                        bucket, who)

    def finish_all_reduce(self, flight: InFlight) -> None:
        """Wait for `flight` and write its sums into the bucket's tensors."""
        self._wait(flight.work, flight.who)
        at = 0
        for piece in flight.bucket:
            piece.write(flight.flat[at:at + piece.numel])
            at += piece.numel
        nbytes = flight.flat.numel() * flight.flat.element_size()
        self.bytes_sent += nbytes
        self.bytes_received += nbytes

    def _gather(self, bucket: list[Piece], scratch: dict[torch.dtype, torch.Tensor]
                ) -> torch.Tensor:
        """`bucket`'s elements, flat, on the wire device: the tensor itself when the bucket is
        one slice of one tensor already there, else copied into `scratch`'s buffer of its
        dtype (grown to the largest bucket; the buckets before the last are full)."""
        view = bucket[0].view() if len(bucket) == 1 else None
        if view is not None and view.device == self.wire_device:
            return view
        size, dtype = sum(piece.numel for piece in bucket), bucket[0].tensor.dtype
        if dtype not in scratch or scratch[dtype].numel() < size:
            scratch[dtype] = torch.empty(size, dtype=dtype, device=self.wire_device)
        flat, at = scratch[dtype][:size], 0
        for piece in bucket:
            flat[at:at + piece.numel].copy_(piece.read())
            at += piece.numel
        return flat

    def _wait(self, work: dist.Work, peer: int | str) -> None:
        """Wait for `work` (a receive, send or all-reduce with `peer`, a device number or who).

        gloo: the CPU blocks for at most `timeout`, then a DeviceError names the peer. NCCL:
        `wait()` without a timeout only makes the current stream wait for the transfer, so the
        CPU runs on and queues more work. With a timeout, ProcessGroupNCCL instead spins the
        CPU until the kernel finished, after the whole compute stream drained. A peer that
        never answers is still bounded: the host reports it after PIPETORCH_TIMEOUT without a
        reply (a dead one at once, on its pipe), and the NCCL watchdog aborts the work after
        the process group's timeout (PIPETORCH_TIMEOUT, plus compiled.COMPILE_ALLOWANCE while
        stages compile).
        """
        if self.backend == "nccl":
            work.wait()
        elif not work.wait(self.timeout):
            who = f"the worker of device {peer}" if isinstance(peer, int) else peer
            raise DeviceError(f"No data from {who} within "
                              f"{self.timeout.total_seconds():.0f}s (PIPETORCH_TIMEOUT)")

    def flush(self) -> None:
        """Wait until every send of this step has left; their buffers can then be freed."""
        for work, _ in self._pending:
            if self.backend == "nccl":
                work.wait()  # see _wait
            else:
                work.wait(self.timeout)
        self._pending.clear()

    def settle(self) -> None:
        """Leave the sends started to finish on their own (torch.distributed finishes them):
        forget those that did, freeing their buffers."""
        self._pending = [(work, buffer) for work, buffer in self._pending
                         if not work.is_completed()]

    def open(self, channels: Sequence[ChannelSpec]) -> None:
        """Set up the traffic of `channels` before the first call (nothing to do for gloo)."""

    def close(self) -> None:
        """Release what `open` set up."""


def link_kind(devices: Sequence[torch.device], *, one_host: bool) -> str:
    """"shm" or "gloo" (torch.distributed: gloo, or NCCL between GPUs) for point-to-point bundles.

    $PIPETORCH_TRANSPORT picks; shared memory (the default) needs CPU workers of one host
    process, and torch.distributed carries whatever it cannot reach.
    """
    wanted = environment.get("transport")
    reachable = one_host and all(d.type == "cpu" for d in devices) and memfd.reachable()
    return "shm" if wanted == "shm" and reachable else "gloo"


def backend_for(devices: Sequence[torch.device]) -> tuple[str, bool]:
    """(torch.distributed backend, whether bundles go through host memory) for these devices.

    NCCL needs every process on its own GPU; workers sharing a GPU, or CPU workers, use gloo.
    """
    if all(d.type == "cuda" for d in devices):
        if len({d.index for d in devices}) == len(devices) and dist.is_nccl_available():
            return "nccl", False
        return "gloo", True
    return "gloo", False
