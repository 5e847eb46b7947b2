"""PopTorch's half/float casting: an op mixing float16 and float32 tensors casts them to one.

`Options.Precision.halfFloatCasting` picks the dtype: `Default` and `HalfUpcastToFloat` cast
the operands to float32 (PyTorch's scheme, which PopTorch's dispatcher follows, extended to
the ops PyTorch refuses such as `F.linear(float32_x, half_weight)`); `FloatDowncastToHalf`
casts them to the 16-bit dtype. In-place ops keep the output's dtype, as in PyTorch.

The casts are made by a TorchFunctionMode around the user's forward, so the split capture
(torch.export, non-strict, runs forward as Python) records them as ordinary graph nodes and
the stages in worker processes make them too.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Callable, ContextManager

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from pipetorch.enums import HalfFloatCastingBehavior
from pipetorch.losses import tensor_leaves

__all__: list[str] = []

SIXTEEN_BIT = (torch.float16, torch.bfloat16)
# What a call of forward is wrapped in: a fresh casting mode each time.
Casting = Callable[[], ContextManager[object]]
# Casts themselves, and reads of a tensor's dtype: never cast their operands.
_CASTS = frozenset({"to", "type", "type_as", "half", "float", "bfloat16", "double"})


def _in_place(name: str, kwargs: dict) -> bool:
    """`x.add_(y)`, `x += y`, `x[i] = y` and `out=` calls write into an existing tensor."""
    dunder = name.startswith("__") and name.endswith("__")
    return (kwargs.get("out") is not None or name == "__setitem__"
            or (dunder and name.startswith("__i") and name not in ("__index__", "__int__"))
            or (not dunder and name.endswith("_")))


def target_dtype(tensors: list[torch.Tensor], *, downcast: bool) -> torch.dtype | None:
    """The dtype an op's floating-point operands are cast to, or None to leave them.

    Upcasting decides by the operands with dimensions, as PyTorch's promotion does: a 0-dim
    float32 with a float16 tensor already gives float16 and is left alone.
    """
    counted = tensors if downcast else [t for t in tensors if t.dim() > 0]
    dtypes = {t.dtype for t in counted if t.is_floating_point()}
    half = dtypes & set(SIXTEEN_BIT)
    if len(half) != 1 or dtypes != half | {torch.float32}:
        return None
    return half.pop() if downcast else torch.float32


def _cast(dtype: torch.dtype, t: torch.Tensor) -> torch.Tensor:
    return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t


class HalfFloatCasting(TorchFunctionMode):
    """Casts the floating-point operands of an op that mixes 16-bit and float32 tensors."""

    def __init__(self, behaviour: HalfFloatCastingBehavior) -> None:
        super().__init__()
        self.behaviour = behaviour
        self.downcast = behaviour == HalfFloatCastingBehavior.FloatDowncastToHalf

    def __torch_function__(self, func: Callable[..., object], types: tuple[type, ...],
                           args: tuple = (), kwargs: dict[str, object] | None = None) -> object:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _CASTS or _in_place(name, kwargs):
            return func(*args, **kwargs)
        tensors = tensor_leaves((args, kwargs))
        dtype = target_dtype(tensors, downcast=self.downcast) if len(tensors) > 1 else None
        if dtype is not None:
            args, kwargs = pytree.tree_map_only(torch.Tensor, functools.partial(_cast, dtype),
                                                (args, kwargs))
        return func(*args, **kwargs)


def _has_sixteen_bit(model: nn.Module, args: tuple, kwargs: dict) -> bool:
    tensors = [*model.parameters(), *model.buffers(), *pytree.tree_leaves((args, kwargs))]
    return any(isinstance(t, torch.Tensor) and t.dtype in SIXTEEN_BIT for t in tensors)


def for_forward(model: nn.Module, args: tuple, kwargs: dict,
                chosen: HalfFloatCastingBehavior | None) -> Casting | None:
    """The casting forward runs under (`chosen`: Precision.halfFloatCasting, None when unset),
    or None where it cannot matter: a model without a 16-bit parameter, buffer or input, whose
    options leave halfFloatCasting unset."""
    if chosen is not None or _has_sixteen_bit(model, args, kwargs):
        return functools.partial(HalfFloatCasting, HalfFloatCastingBehavior.Default
                                 if chosen is None else chosen)
    return None


def within(casting: Casting | None) -> ContextManager[object]:
    """`casting`'s mode, to run a call of forward in (nothing for None)."""
    return casting() if casting is not None else contextlib.nullcontext()
