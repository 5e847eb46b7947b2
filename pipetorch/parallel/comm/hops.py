"""Python values holding tensors, sent from one worker to another through torch.distributed
(gloo between CPU workers, NCCL between GPUs): the values a stage hands the next one when
their shapes change from call to call (generation), where the links' fixed-size rings cannot.

A value goes as one message of FIRST bytes (its sizes, its header: parallel.comm.stream's
pickle with the tensor storages taken out, then each storage's bytes), and the rest of its
bytes as a second message when they do not fit.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from pipetorch.parallel.comm import stream

__all__: list[str] = []

# Bytes of a value's first message, a size the receiver knows: a decoding step's values fit
# in it whole. Each message costs a round trip (gloo sends once the receiver has posted its
# buffer) that waits for the sender to be scheduled: a value of four messages, its length,
# header and two tensors, took 8 ms to cross between busy workers where one takes 1 ms.
FIRST = 64 << 10
_PREFIX = 16  # the first message opens with two int64: the value's bytes, its header's


class Hops:
    """Sends and receives between this worker and its peers (global ranks), staging every
    message on `device` (the CPU for gloo, the worker's GPU for NCCL)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pending: list[tuple[Any, torch.Tensor]] = []  # (work, the buffer it reads)

    def send(self, value: object, to: int) -> None:
        """Start sending `value` to rank `to` (finished by `wait`)."""
        header, storages = stream.pack(value)
        total = _PREFIX + len(header) + sum(s.nbytes() for s in storages)
        sizes = torch.tensor([total, len(header)], dtype=torch.int64).view(torch.uint8)
        parts = [sizes, torch.frombuffer(bytearray(header), dtype=torch.uint8)]
        body = torch.cat([p.to(self.device) for p in parts]
                         + [stream.bytes_of(s).to(self.device) for s in storages])
        first = torch.zeros(FIRST, dtype=torch.uint8, device=self.device)
        first[:min(total, FIRST)] = body[:FIRST]
        for buffer in (first, body[FIRST:]):
            if buffer.numel():
                self._pending.append((dist.isend(buffer, to), buffer))

    def receive(self, source: int, device: torch.device) -> object:
        """The next value rank `source` sent, its tensors on `device`."""
        body = torch.empty(FIRST, dtype=torch.uint8, device=self.device)
        dist.recv(body, source)
        total, length = body[:_PREFIX].view(torch.int64).tolist()
        if total > FIRST:
            rest = torch.empty(total - FIRST, dtype=torch.uint8, device=self.device)
            dist.recv(rest, source)
            body = torch.cat([body, rest])
        at = _PREFIX + length
        unpickler, sizes = stream.unpack(body[_PREFIX:at].cpu().numpy().tobytes(),
                                         lambda size: torch.UntypedStorage(size, device=device))
        value = unpickler.load()
        for storage, size in zip(unpickler.storages, sizes):
            stream.bytes_of(storage).copy_(body[at:at + size])
            at += size
        return value

    def reap(self) -> None:
        """Forget the sends that finished (their buffers are free again)."""
        self._pending = [(work, buffer) for work, buffer in self._pending
                         if not work.is_completed()]

    def wait(self) -> None:
        """Finish every send started."""
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()

