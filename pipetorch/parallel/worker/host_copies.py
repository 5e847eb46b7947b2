"""Outputs on their way to the host: copied without stalling the schedule, waited for once.

A blocking `.to("cpu")` in the middle of a schedule stops the CPU until the GPU has run
everything queued before it, so the device idles while the CPU queues the next work. Instead
each output is copied with `non_blocking=True` into pinned host memory and the call waits on
one event, recorded after its last copy, before the outputs are handed back:

    F0 -> copy0 .. F1 -> copy1 .. B1 .. STEP | event.record(); event.synchronize() | reply
"""
from __future__ import annotations

from typing import Callable, Protocol

import torch

__all__: list[str] = []


class Event(Protocol):
    """What HostCopies needs of torch.cuda.Event."""

    def record(self) -> None: ...

    def synchronize(self) -> None: ...


class HostCopies:
    """Copies of a call's outputs for the host, finished by one `ready()` at the call's end.

    `event`: makes the event recorded after the copies (torch.cuda.Event on a GPU); None hands
    values over as they are, which suits the CPU: the reply copies them into shared memory
    before anything can change them. `pin`: copy into pinned (page-locked) host memory, which
    a GPU copies to without blocking.
    """

    def __init__(self, *, event: Callable[[], Event] | None = None, pin: bool = False) -> None:
        self._event, self._pin = event, pin
        self._waiting = False  # copies made since the last ready()

    @classmethod
    def for_device(cls, device: torch.device) -> HostCopies:
        """Pinned buffers and a CUDA event on a GPU; plain hand-over on the CPU."""
        if device.type == "cuda":
            return cls(event=torch.cuda.Event, pin=True)
        return cls()

    def take(self, value: object) -> object:
        """`value` for the host, detached: a copy on its way when it is a tensor and copies
        are made, else `value` itself. Read it only after `ready()`."""
        if not isinstance(value, torch.Tensor):
            return value
        value = value.detach()
        if self._event is None:
            return value.to("cpu")
        buffer = torch.empty_like(value, device="cpu", pin_memory=self._pin)
        buffer.copy_(value, non_blocking=True)
        self._waiting = True
        return buffer

    def ready(self) -> None:
        """Wait until every copy made since the last call has landed (one event)."""
        if self._waiting:
            assert self._event is not None
            event = self._event()
            event.record()
            event.synchronize()
            self._waiting = False
