"""Probes that watch a profiled step per candidate segment: a module's hooks or a Block scope's
start mark where a segment begins, and each segment's output tells when its backward begins."""
from __future__ import annotations

import abc
import contextlib
import time
from typing import Iterator, Sequence

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from pipetorch.partition.blocks import recording
from pipetorch.losses import tensor_leaves
from pipetorch.planning.memory import bytes_of

__all__: list[str] = []


class Probe(abc.ABC):
    """Timestamps each segment's forward start and the gradient reaching its output, and sizes
    the activations it keeps for backward and the output it sends to the next segment.

    Subclasses call `enter(k)` when segment k starts and `sends(k, tensors, timing)` with its
    output; the first gradient to reach one of the `timing` tensors starts k's backward.
    """

    def __init__(self, names: Sequence[str]) -> None:
        self.names = list(names)
        self.index = {n: k for k, n in enumerate(names)}
        self.reset()

    def reset(self) -> None:
        self.current = 0
        self.fwd_start: dict[int, float] = {}
        self.grad_at: dict[int, float] = {}
        self.saved = [0] * len(self.names)
        self.out_bytes = [0] * len(self.names)

    def enter(self, k: int) -> None:
        self.fwd_start.setdefault(k, time.perf_counter())
        self.current = max(self.current, k)

    def sends(self, k: int, tensors: Sequence[torch.Tensor],
              timing: Sequence[torch.Tensor]) -> None:
        self.out_bytes[k] = bytes_of(tensors)
        for t in timing:
            if t.requires_grad:
                t.register_hook(self._grad(k))

    def _grad(self, k: int):
        def hook(grad: torch.Tensor) -> None:
            self.grad_at.setdefault(k, time.perf_counter())
        return hook

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.saved[self.current] += tensor.numel() * tensor.element_size()
        return tensor

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Active around one forward pass."""
        yield

    @abc.abstractmethod
    def parameters(self, k: int) -> list[nn.Parameter]:
        """The parameters segment k holds."""

    @abc.abstractmethod
    def close(self) -> None:
        """Remove whatever the probe attached to the model."""


class ModuleProbe(Probe):
    """Segments are submodules: forward hooks mark their start and give their output."""

    def __init__(self, model: nn.Module, names: Sequence[str]) -> None:
        super().__init__(names)
        self.modules = dict(model.named_modules())
        self.handles = []
        for k, name in enumerate(names):
            module = self.modules[name]
            self.handles.append(module.register_forward_pre_hook(
                lambda m, a, k=k: self.enter(k)))
            self.handles.append(module.register_forward_hook(
                lambda m, a, out, k=k: self._left(k, tensor_leaves(out))))

    def _left(self, k: int, out: list[torch.Tensor]) -> None:
        self.sends(k, out, [t for t in out if t.requires_grad][:1])

    def parameters(self, k: int) -> list[nn.Parameter]:
        return list(self.modules[self.names[k]].parameters())

    def close(self) -> None:
        for h in self.handles:
            h.remove()


class BlockProbe(Probe):
    """Segments are `Block` scopes (with-statements, `Block.start`, `BlockFunction`), named by
    user_id: the block recorder tells when one starts, and a torch-function mode sees every op.

    A segment's output is what crosses its cut: the tensors made in blocks up to it and read
    in later blocks; the ones made in the segment itself time its backward. Its parameters are
    those first used inside its scope (ops before the first block count in the first).
    """

    def __init__(self, names: Sequence[str]) -> None:
        super().__init__(names)
        self.owner: dict[nn.Parameter, int] = {}

    def parameters(self, k: int) -> list[nn.Parameter]:
        return [p for p, owner in self.owner.items() if owner == k]

    def close(self) -> None:
        """Nothing stays attached: the recorder and the op watch end with `watching`."""

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        made: dict[int, tuple[torch.Tensor, int]] = {}  # id -> (tensor, block that made it)
        read_until: dict[int, int] = {}  # id -> last block that read it
        with recording() as recorder, _OpWatch(self, made, read_until):
            recorder.on_change = lambda: self._changed(recorder.current())
            self.enter(0)
            yield
        self._cuts(made, read_until)

    def _changed(self, block: str | None) -> None:
        k = self.index.get(block) if block is not None else None
        if k is not None:
            self.enter(k)

    def saw(self, inputs: list[torch.Tensor], outputs: list[torch.Tensor],
            made: dict[int, tuple[torch.Tensor, int]], read_until: dict[int, int]) -> None:
        """One op ran in the current segment: note its parameters, reads and results."""
        k = self.current
        for t in inputs:
            if isinstance(t, nn.Parameter):
                self.owner.setdefault(t, k)
            elif id(t) in made and made[id(t)][1] < k:
                read_until[id(t)] = max(read_until.get(id(t), k), k)
        for t in outputs:
            made.setdefault(id(t), (t, k))

    def _cuts(self, made: dict[int, tuple[torch.Tensor, int]],
              read_until: dict[int, int]) -> None:
        """Cut k carries every tensor made at or before segment k and read after it."""
        for k in range(len(self.names)):
            crossing = [(t, src) for i, (t, src) in made.items()
                        if src <= k < read_until.get(i, -1)]
            self.sends(k, [t for t, _ in crossing], [t for t, src in crossing if src == k])


class _OpWatch(TorchFunctionMode):
    """Reports each torch op's tensor inputs and outputs to a BlockProbe."""

    def __init__(self, probe: BlockProbe, made: dict, read_until: dict) -> None:
        super().__init__()
        self.probe, self.made, self.read_until = probe, made, read_until

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.probe.saw(tensor_leaves((args, kwargs)), tensor_leaves(out), self.made, self.read_until)
        return out
