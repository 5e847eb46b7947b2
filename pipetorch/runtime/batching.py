"""Host-call inputs: their signature, and their split into [D][G][R] micro-batches."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch.utils import _pytree as pytree

__all__: list[str] = []


@dataclass(frozen=True)
class LeafSpec:
    """What a call's input leaf looks like: a tensor's shape and dtype, or a constant."""

    shape: tuple[int, ...] | None
    dtype: torch.dtype | None
    constant: Any = None


@dataclass(frozen=True)
class Signature:
    """The structure, shapes and dtypes of one host call's arguments."""

    spec: pytree.TreeSpec
    leaves: tuple[LeafSpec, ...]

    @staticmethod
    def of(args: tuple, kwargs: dict) -> "Signature":
        flat, spec = pytree.tree_flatten((args, kwargs))
        return Signature(spec, tuple(
            LeafSpec(tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else LeafSpec(None, None, x)
            for x in flat))

    def mismatch(self, other: "Signature") -> str | None:
        """A sentence naming the first difference from `other`, or None when they agree."""
        if self.spec != other.spec:
            return (f"the inputs' structure changed (compiled with {self.spec}, called with "
                    f"{other.spec}): the number of arguments, keywords or nesting differ")
        for i, (old, new) in enumerate(zip(self.leaves, other.leaves)):
            if old.shape is None and new.shape is None:
                if not _same_constant(old.constant, new.constant):
                    return f"input {i} changed value from {old.constant!r} to {new.constant!r}"
            elif old.shape is None or new.shape is None:
                return f"input {i} changed between a tensor and {old.constant if new.shape else new.constant!r}"
            elif old.shape != new.shape:
                return f"input {i} changed shape from {list(old.shape)} to {list(new.shape)}"
            elif old.dtype != new.dtype:
                return f"input {i} changed dtype from {old.dtype} to {new.dtype}"
        return None


def _same_constant(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # objects whose == is not a bool (arrays): compare identity
        return a is b


def split_micro_batches(args: tuple, kwargs: dict, *, device_iterations: int,
                        gradient_accumulation: int, replication_factor: int
                        ) -> list[tuple[tuple, dict]]:
    """Cut every tensor input along dim 0 into D*G*R micro-batches, in [D][G][R] order."""
    count = device_iterations * gradient_accumulation * replication_factor
    flat, spec = pytree.tree_flatten((args, kwargs))
    tensors = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
    if not tensors:
        raise ValueError("The model was called without any tensor input: pass at least one tensor")
    pieces: dict[int, tuple[torch.Tensor, ...]] = {}
    for i in tensors:
        x = flat[i]
        if x.dim() == 0 or x.shape[0] == 0 or x.shape[0] % count:
            raise ValueError(
                f"Input {i} has shape {list(x.shape)}, but dim 0 must be a multiple of "
                f"deviceIterations ({device_iterations}) x gradientAccumulation "
                f"({gradient_accumulation}) x replicationFactor ({replication_factor}) = {count}: "
                f"each host call takes {count} micro-batches of size B, i.e. dim 0 = {count}*B. "
                "Use a poptorch.DataLoader to build batches of the right size"
            )
        pieces[i] = x.split(x.shape[0] // count)
    result = []
    for m in range(count):
        leaves = [pieces[i][m] if i in pieces else x for i, x in enumerate(flat)]
        result.append(pytree.tree_unflatten(leaves, spec))
    return result


def to_device(tree: Any, device: torch.device) -> Any:
    """Move every tensor of a nested structure to `device` (no copy if already there)."""
    return pytree.tree_map(
        lambda x: x.to(device, non_blocking=True) if isinstance(x, torch.Tensor) else x, tree)


def half_dtype(parameters: Iterable[torch.Tensor]) -> torch.dtype | None:
    """float16 (or bfloat16) when every floating-point parameter has that dtype."""
    dtypes = {p.dtype for p in parameters if p.is_floating_point()}
    return dtypes.pop() if len(dtypes) == 1 and dtypes <= {torch.float16, torch.bfloat16} else None


def cast_float_inputs(args: tuple, kwargs: dict, dtype: torch.dtype | None) -> tuple[tuple, dict]:
    """PopTorch's input casting: float32 input tensors of a half model become `dtype`."""
    if dtype is None:
        return args, kwargs
    return pytree.tree_map_only(
        torch.Tensor, lambda x: x.to(dtype) if x.dtype == torch.float32 else x, (args, kwargs))
