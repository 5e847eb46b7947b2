"""Python values holding tensors, sent from one worker to another through torch.distributed
(gloo between CPU workers, NCCL between GPUs): the values a stage hands the next one when
their shapes change from call to call (generation), where the links' fixed-size rings cannot.

A value goes as three kinds of message, in order on the pair's channel: its header's length,
the header (parallel.comm.stream's pickle with the tensor storages taken out), then each storage's
bytes.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from pipetorch.parallel.comm import stream

__all__: list[str] = []


class Hops:
    """Sends and receives between this worker and its peers (global ranks), staging every
    message on `device` (the CPU for gloo, the worker's GPU for NCCL)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pending: list[tuple[Any, torch.Tensor]] = []  # (work, the buffer it reads)

    def send(self, value: object, to: int) -> None:
        """Start sending `value` to rank `to` (finished by `wait`)."""
        header, storages = stream.pack(value)
        body = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(self.device)
        length = torch.tensor([body.numel()], dtype=torch.int64, device=self.device)
        for buffer in (length, body, *(stream.bytes_of(s).to(self.device) for s in storages)):
            if buffer.numel():
                self._pending.append((dist.isend(buffer, to), buffer))

    def receive(self, source: int, device: torch.device) -> object:
        """The next value rank `source` sent, its tensors on `device`."""
        length = torch.empty(1, dtype=torch.int64, device=self.device)
        dist.recv(length, source)
        body = torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
        dist.recv(body, source)
        unpickler, sizes = stream.unpack(body.cpu().numpy().tobytes(),
                                         lambda size: torch.UntypedStorage(size, device=device))
        value = unpickler.load()
        for storage, size in zip(unpickler.storages, sizes):
            target = stream.bytes_of(storage)
            if size and target.device == self.device:
                dist.recv(target, source)
            elif size:  # staged on the wire's device
                raw = torch.empty(size, dtype=torch.uint8, device=self.device)
                dist.recv(raw, source)
                target.copy_(raw)
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

