"""Python values holding tensors, sent from one worker to another through torch.distributed
(gloo between CPU workers, NCCL between GPUs): the values a stage hands the next one when
their shapes change from call to call (generation), where the links' fixed-size rings cannot.

A value goes first as one message of FIRST bytes: two int64 (its header's bytes, and 1 if the
whole value is in this message), its header (parallel.comm.stream's pickle with the tensor
storages taken out), then each storage's bytes when they fit. A value that does not fit
sends the rest of its header, then each storage, as messages of their own.
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
_PREFIX = 16  # the first message opens with two int64: its header's bytes, and whole


class Hops:
    """Sends and receives between this worker and its peers (global ranks), staging every
    message on `device` (the CPU for gloo, the worker's GPU for NCCL)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pending: list[tuple[Any, torch.Tensor]] = []  # (work, the buffer it reads)

    def send(self, value: object, to: int) -> None:
        """Start sending `value` to rank `to` (finished by `wait`)."""
        header, storages = stream.pack(value)
        whole = _PREFIX + len(header) + sum(s.nbytes() for s in storages) <= FIRST
        prefix = torch.tensor([len(header), whole], dtype=torch.int64).view(torch.uint8)
        head = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        parts = [prefix, head, *(stream.bytes_of(s) for s in storages if whole)]
        body = torch.cat([part.to(self.device) for part in parts])
        first = torch.zeros(FIRST, dtype=torch.uint8, device=self.device)
        first[:min(body.numel(), FIRST)] = body[:FIRST]
        later = [] if whole else [body[FIRST:], *(stream.bytes_of(s).to(self.device)
                                                  for s in storages)]
        for buffer in (first, *later):
            if buffer.numel():
                self._pending.append((dist.isend(buffer, to), buffer))

    def receive(self, source: int, device: torch.device) -> object:
        """The next value rank `source` sent, its tensors on `device`."""
        first = torch.empty(FIRST, dtype=torch.uint8, device=self.device)
        dist.recv(first, source)
        length, whole = first[:_PREFIX].view(torch.int64).tolist()
        header = first[_PREFIX:_PREFIX + length]
        if _PREFIX + length > FIRST:  # a header longer than the first message holds
            header = torch.cat([header, self._received(_PREFIX + length - FIRST, source)])
        unpickler, sizes = stream.unpack(header.cpu().numpy().tobytes(),
                                         lambda size: torch.UntypedStorage(size, device=device))
        value = unpickler.load()
        at = _PREFIX + length
        for storage, size in zip(unpickler.storages, sizes):
            target = stream.bytes_of(storage)
            if whole:
                target.copy_(first[at:at + size])
                at += size
            elif size and target.device == self.device:
                dist.recv(target, source)
            elif size:  # staged on the wire's device
                target.copy_(self._received(size, source))
        return value

    def _received(self, size: int, source: int) -> torch.Tensor:
        """The next message of `size` bytes from rank `source`, on the wire's device."""
        raw = torch.empty(size, dtype=torch.uint8, device=self.device)
        dist.recv(raw, source)
        return raw

    def reap(self) -> None:
        """Forget the sends that finished (their buffers are free again)."""
        self._pending = [(work, buffer) for work, buffer in self._pending
                         if not work.is_completed()]

    def wait(self) -> None:
        """Finish every send started."""
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()

