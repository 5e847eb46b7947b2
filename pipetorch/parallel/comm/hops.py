"""Python values holding tensors, sent from one worker to another over a PeerLink (shared
memory between the CPU workers of one machine, else torch.distributed: gloo, or NCCL between
GPUs): the values a stage hands the next one when their shapes change from call to call
(generation), which the links' bundles of fixed shapes cannot carry as they are.

A value goes first as one bundle of FIRST bytes: two int64 (its header's bytes, and 1 if the
whole value is in this message), its header (parallel.comm.stream's pickle with the tensor
storages taken out), then each storage's bytes when they fit. A value that does not fit
sends the rest of its header, then each storage, as torch.distributed messages of their own.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from pipetorch.parallel.comm import stream
from pipetorch.parallel.comm.transport import BundleLayout, ChannelSpec, PeerLink, started
from pipetorch.parallel.layout.routes import TensorSpec

__all__: list[str] = []

# Bytes of a value's first message, a size the receiver knows: a decoding step's values fit
# in it whole. Each torch.distributed message costs a round trip (gloo sends once the
# receiver has posted its buffer) that waits for the sender to be scheduled: a value of four
# messages, its length, header and two tensors, took 8 ms to cross between busy workers
# where one takes 1 ms.
FIRST = 64 << 10
_PREFIX = 16  # the first message opens with two int64: its header's bytes, and whole
_BUNDLE = BundleLayout((TensorSpec((FIRST,), torch.uint8, False),))
_TAG = 0  # torch.distributed's default, the later messages' too: apart from the stages' tags


def channels(devices: tuple[int, ...], mine: int) -> list[ChannelSpec]:
    """The first messages' channels of the worker on device `mine` when stage s runs on
    `devices[s]`: from each stage to the next one, where they are on different devices."""
    found = []
    for sender, receiver in zip(devices, devices[1:], strict=False):
        if sender != receiver and mine in (sender, receiver):
            outgoing = sender == mine
            found.append(ChannelSpec(receiver if outgoing else sender, _TAG, outgoing,
                                     FIRST))
    return found


class Hops:
    """Sends and receives between this worker and the other devices of its replica (peers as
    `link` numbers them), through the link's channels from `channels` (opened by the caller)."""

    def __init__(self, link: PeerLink) -> None:
        self.link = link
        self._later: list[tuple[dist.Work, torch.Tensor]] = []  # (work, the buffer it reads)

    def send(self, value: object, to: int) -> None:
        """Start sending `value` to device `to` (finished by `settle` or `wait`)."""
        header, storages = stream.pack(value)
        whole = _PREFIX + len(header) + sum(s.nbytes() for s in storages) <= FIRST
        device = self.link.wire_device
        prefix = torch.tensor([len(header), whole], dtype=torch.int64).view(torch.uint8)
        head = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        parts = [prefix, head, *(stream.bytes_of(s) for s in storages if whole)]
        body = torch.cat([part.to(device) for part in parts])
        first = torch.zeros(FIRST, dtype=torch.uint8, device=device)
        first[:min(body.numel(), FIRST)] = body[:FIRST]
        self.link.send(_BUNDLE, [first], to, _TAG)
        later = [] if whole else [body[FIRST:], *(stream.bytes_of(s).to(device)
                                                  for s in storages)]
        for buffer in later:
            if buffer.numel():
                self._later.append((started(dist.isend(buffer, self.link.offset + to)), buffer))

    def receive(self, source: int, device: torch.device) -> object:
        """The next value device `source` sent, its tensors on `device`."""
        first, = self.link.recv(_BUNDLE, source, _TAG)
        length, whole = first[:_PREFIX].view(torch.int64).tolist()
        header = first[_PREFIX:_PREFIX + length]
        if _PREFIX + length > FIRST:  # a header longer than the first message holds
            header = torch.cat([header, self._received(_PREFIX + length - FIRST, source)])
        unpickler, sizes = stream.unpack(header.cpu().numpy().tobytes(),
                                         lambda size: torch.UntypedStorage(size, device=device))
        value = unpickler.load()
        at = _PREFIX + length
        for storage, size in zip(unpickler.storages, sizes, strict=True):
            target = stream.bytes_of(storage)
            if whole:
                target.copy_(first[at:at + size])
                at += size
            elif size and target.device == self.link.wire_device:
                dist.recv(target, self.link.offset + source)
            elif size:  # staged on the wire's device
                target.copy_(self._received(size, source))
        return value

    def _received(self, size: int, source: int) -> torch.Tensor:
        """The next message of `size` bytes from device `source`, on the wire's device."""
        raw = torch.empty(size, dtype=torch.uint8, device=self.link.wire_device)
        dist.recv(raw, self.link.offset + source)
        return raw

    def settle(self) -> None:
        """After a step: the sends still in flight finish without this process (the link's
        settle), and those that finished free their buffers."""
        self.link.settle()
        self._later = [(work, buffer) for work, buffer in self._later
                       if not work.is_completed()]

    def wait(self) -> None:
        """Finish every send started."""
        self.link.flush()
        for work, _ in self._later:
            work.wait()
        self._later.clear()
