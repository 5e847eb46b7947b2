"""Python values holding tensors, sent from one worker to another through torch.distributed
(gloo between CPU workers, NCCL between GPUs): the values a stage hands the next one when
their shapes change from call to call (generation), where the links' fixed-size rings cannot.

A value goes as three kinds of message, in order on the pair's channel: its pickle's length,
the pickle (tensors replaced by their shape and dtype), then each tensor's bytes.
"""
from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist

__all__: list[str] = []


@dataclass(frozen=True)
class _TensorRef:
    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype


class _Pickler(cloudpickle.Pickler):
    """Tensors by shape and dtype (their bytes follow), the user's `__main__` code by value
    (as parallel.stream sends it)."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[torch.Tensor] = []

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            self.tensors.append(obj)
            return _TensorRef(len(self.tensors) - 1, tuple(obj.shape), obj.dtype)
        return None


class _Unpickler(pickle.Unpickler):
    """Receives each tensor when the pickle reaches it: the order the sender pickled them."""

    def __init__(self, file: io.BytesIO, receive: Any) -> None:
        super().__init__(file)
        self.receive = receive

    def persistent_load(self, pid: Any) -> Any:
        return self.receive(pid)


class Hops:
    """Sends and receives between this worker and its peers (global ranks), staging every
    message on `device` (the CPU for gloo, the worker's GPU for NCCL)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pending: list[tuple[Any, torch.Tensor]] = []  # (work, the buffer it reads)

    def send(self, value: Any, to: int) -> None:
        """Start sending `value` to rank `to` (finished by `wait`)."""
        file = io.BytesIO()
        pickler = _Pickler(file)
        pickler.dump(value)
        body = torch.frombuffer(bytearray(file.getvalue()), dtype=torch.uint8).to(self.device)
        length = torch.tensor([body.numel()], dtype=torch.int64, device=self.device)
        for buffer in (length, body, *(_bytes(t, self.device) for t in pickler.tensors)):
            if buffer.numel():
                self._pending.append((dist.isend(buffer, to), buffer))

    def receive(self, source: int, device: torch.device) -> Any:
        """The next value rank `source` sent, its tensors on `device`."""
        length = torch.empty(1, dtype=torch.int64, device=self.device)
        dist.recv(length, source)
        body = torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
        dist.recv(body, source)

        def tensor(ref: _TensorRef) -> torch.Tensor:
            size = torch.Size(ref.shape).numel() * torch.empty((), dtype=ref.dtype).element_size()
            raw = torch.empty(size, dtype=torch.uint8, device=self.device)
            if size:
                dist.recv(raw, source)
            return raw.view(ref.dtype).reshape(ref.shape).to(device)

        return _Unpickler(io.BytesIO(body.cpu().numpy().tobytes()), tensor).load()

    def reap(self) -> None:
        """Forget the sends that finished (their buffers are free again)."""
        self._pending = [(work, buffer) for work, buffer in self._pending
                         if not work.is_completed()]

    def wait(self) -> None:
        """Finish every send started."""
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()


def _bytes(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    flat = tensor.detach().to(device).contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)
