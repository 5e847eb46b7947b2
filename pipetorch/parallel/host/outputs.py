"""What a host call returns: per-micro-batch outputs combined as the OutputMode says."""
from __future__ import annotations

from typing import Protocol

import torch
from torch.utils import _pytree as pytree

from pipetorch.enums import OutputMode
from pipetorch.errors import BackwardError
from pipetorch.partition.export import Tree

__all__: list[str] = []


def resolve_mode(mode: OutputMode, *, training: bool) -> OutputMode:
    """Default means Final when training, All for inference."""
    if mode == OutputMode.Default:
        return OutputMode.Final if training else OutputMode.All
    return OutputMode(mode)


class Collector(Protocol):
    """What an engine hands a call's outputs to: an OutputCollector, or a collector wrapping
    one (runtime.anchors)."""

    def wants(self, step: int) -> bool: ...

    def add(self, step: int, replica: int, output: Tree) -> None: ...


class OutputCollector:
    """Keeps only the micro-batch outputs a host call returns, then lays them out.

    Micro-batches are numbered by step k = d*G + g (0 .. D*G-1) and replica r. With
    N = output_return_period:

        All      every step              -> [D*G*R*B, ...]
        EveryN   steps N-1, 2N-1, ...    -> [D*G*R*B/N, ...]
        Final    step D*G-1              -> [R*B, ...]
        Sum      sum over all steps      -> [R*B, ...]

    Scalars (a loss per micro-batch) stack instead of concatenating; a stack of one is 0-dim.
    """

    def __init__(self, mode: OutputMode, *, steps: int, replicas: int, period: int = 1) -> None:
        assert mode != OutputMode.Default, "resolve the Default mode first"
        self.mode, self.steps, self.replicas, self.period = mode, steps, replicas, max(period, 1)
        self._kept: dict[tuple[int, int], Tree] = {}

    def wants(self, step: int) -> bool:
        """Whether outputs of step `step` are part of the result."""
        if self.mode == OutputMode.Final:
            return step == self.steps - 1
        if self.mode == OutputMode.EveryN:
            return step % self.period == self.period - 1
        return True

    def add(self, step: int, replica: int, output: Tree) -> None:
        """Record micro-batch (step, replica)'s output (already detached)."""
        if not self.wants(step):
            return
        if self.mode == OutputMode.Sum and (0, replica) in self._kept:
            self._kept[(0, replica)] = pytree.tree_map(
                lambda a, b: a + b if isinstance(a, torch.Tensor) else b,
                self._kept[(0, replica)], output)
        else:
            self._kept[(0 if self.mode == OutputMode.Sum else step, replica)] = output

    def result(self) -> Tree:
        """The call's outputs, in forward's structure."""
        ordered = [self._kept[key] for key in sorted(self._kept)]
        if not ordered:
            return None
        flats = [pytree.tree_flatten(o)[0] for o in ordered]
        spec = pytree.tree_flatten(ordered[0])[1]
        leaves = [_combine([f[i] for f in flats]) for i in range(len(flats[0]))]
        return pytree.tree_unflatten(leaves, spec)


def _combine(values: list[object]) -> object:
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if len(tensors) < len(values):  # forward's other values: the last call's
        return values[-1]
    if len(tensors) == 1:
        return tensors[0]
    if tensors[0].dim() == 0:
        return torch.stack(tensors)
    return torch.cat(tensors)


class TrainingOutput(torch.Tensor):
    """A returned tensor whose `.backward()` explains that training already happened."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]  # C, unbound

    def __repr__(self, **kwargs: object) -> str:  # type: ignore[override]  # torch's is untyped
        return repr(self.as_subclass(torch.Tensor))  # print like the tensor it is

    def backward(self, *args: object, **kwargs: object) -> None:
        # PopTorch 3.x raises a poptorch.Error in these words; PopTorch 2.x returned plain
        # tensors, so torch's message follows for scripts matching that one.
        raise BackwardError(
            "backward() cannot be called explicitly on outputs of a PopTorch model. If you're "
            "using a trainingModel, the backwards pass is performed automatically when invoking "
            "the model. If you're using an inferenceModel, you should use a trainingModel "
            "instead. (torch: element 0 of tensors does not require grad and does not have a "
            "grad_fn: forward, backward and the optimiser step already ran inside the call; "
            "use the returned loss for logging only)")


def mark_training_output(x: torch.Tensor) -> torch.Tensor:
    """`x` as a training call returns it: a TrainingOutput."""
    return torch.Tensor._make_subclass(TrainingOutput, x)
