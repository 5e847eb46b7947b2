"""PopTorch's functional ops (losses, recomputation points, printing, loops) on plain PyTorch."""
from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import functools
import logging
import sys
from typing import Any, Callable, ContextManager, Iterator, Sequence, TypeVar, Union

import numpy as np
import torch
import torch.fx
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from pipetorch.losses import LossGraph


__all__ = [
    "identity_loss", "recomputationCheckpoint", "ipu_print_tensor", "set_available_memory",
    "nop", "for_loop", "cond", "isRunningOnIpu",
]

_REDUCTIONS = ("sum", "mean", "none")
_FLOAT_FORMATS = ("auto", "fixed", "scientific", "none")
# torch.nn.functional losses whose call means "the model computed a loss" (nn.*Loss modules
# call these too). Looked up by name so the set reads like the documentation.
_LOSS_FUNCTION_NAMES = (
    "cross_entropy", "nll_loss", "mse_loss", "l1_loss", "binary_cross_entropy",
    "binary_cross_entropy_with_logits", "kl_div", "smooth_l1_loss", "huber_loss", "ctc_loss",
    "poisson_nll_loss", "cosine_embedding_loss", "margin_ranking_loss", "hinge_embedding_loss",
    "multilabel_margin_loss", "soft_margin_loss", "multilabel_soft_margin_loss",
    "multi_margin_loss", "triplet_margin_loss", "gaussian_nll_loss",
)
_LOSS_FUNCTIONS = frozenset(getattr(F, name) for name in _LOSS_FUNCTION_NAMES)

_ON_DEVICE: contextvars.ContextVar[bool] = contextvars.ContextVar("pipetorch_on_device",
                                                                  default=False)
_RECORDER: contextvars.ContextVar[CallCounts | None] = contextvars.ContextVar(
    "pipetorch_recorder", default=None)
_RECOMPUTING: contextvars.ContextVar[bool] = contextvars.ContextVar("pipetorch_recomputing",
                                                                    default=False)
_QUIET: contextvars.ContextVar[bool] = contextvars.ContextVar("pipetorch_quiet", default=False)
# Set while torch.export captures forward: turns checkpointed tensors into marked graph nodes.
CHECKPOINT_MARKER: contextvars.ContextVar[Callable[[tuple], tuple] | None] = \
    contextvars.ContextVar("pipetorch_checkpoint_marker", default=None)

print_logger = logging.getLogger("pipetorch.print")
print_logger.setLevel(logging.INFO)
# ipu_print_tensor must show something without any logging setup, as PopTorch's does; users who
# configure logging themselves can remove this handler.
print_logger.addHandler(logging.StreamHandler(sys.stderr))
print_logger.propagate = False

_Fn = TypeVar("_Fn", bound=Callable[..., Any])


# ---------------------------------------------------------------------------------------------
# Hooks for the executor (not public).
# ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _setting(flag: contextvars.ContextVar[bool]) -> Iterator[None]:
    token = flag.set(True)
    try:
        yield
    finally:
        flag.reset(token)


def running_on_device() -> ContextManager[None]:
    """While active, `isRunningOnIpu()` is True (the executor wraps the model's run in it)."""
    return _setting(_ON_DEVICE)


def quiet() -> ContextManager[None]:
    """While active, ipu_print_tensor prints nothing (a capture runs forward on fake tensors)."""
    return _setting(_QUIET)


def recomputing() -> ContextManager[None]:
    """Marks a recomputation of the forward: ops neither record calls nor print again."""
    return _setting(_RECOMPUTING)


class CallCounts(collections.Counter[str]):
    """record_calls' counts of op calls, with the `losses` those calls made."""

    def __init__(self) -> None:
        super().__init__()
        self.losses = LossGraph()


class _LossCallCounter(TorchFunctionMode):
    """Counts calls of torch.nn.functional losses under the key "loss" and follows, in the
    counter's `losses` graph, which tensors each loss depends on."""

    def __init__(self, counts: CallCounts) -> None:
        super().__init__()
        self._counts = counts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if _RECOMPUTING.get():
            return out
        graph = self._counts.losses
        graph.propagate(args, kwargs, out)
        if func in _LOSS_FUNCTIONS and isinstance(out, torch.Tensor):
            self._counts["loss"] += 1
            graph.add(out, func.__name__)
        return out


@contextlib.contextmanager
def record_calls() -> Iterator[CallCounts]:
    """Count, while active, calls of identity_loss, recomputationCheckpoint and torch losses.

    Yields a Counter keyed "identity_loss", "recomputationCheckpoint" and "loss" (any
    torch.nn.functional loss, which nn.*Loss modules call); its `losses` (a
    `losses.LossGraph`) holds the tensors those losses returned and which of them later
    losses read (to find PopTorch's final loss). Counting is per thread/context: run the
    forward to inspect in the thread that entered this manager.
    """
    counts = CallCounts()
    token = _RECORDER.set(counts)
    try:
        with _LossCallCounter(counts):
            yield counts
    finally:
        _RECORDER.reset(token)


def _record(op_name: str, loss: torch.Tensor | None = None) -> None:
    counts = _RECORDER.get()
    if counts is not None and not _RECOMPUTING.get():
        counts[op_name] += 1
        if loss is not None:
            counts.losses.add(loss, op_name)


def _fx_leaf(fn: _Fn) -> _Fn:
    """Make `fn` a single call node when torch.fx traces it, however the model refers to it.

    torch.fx.wrap only patches names in the traced module's globals, which misses
    `poptorch.recomputationCheckpoint(...)` attribute calls; checking for proxies here catches
    every spelling. The node's target is the public function, so the traced graph runs it.
    """
    @functools.wraps(fn)
    def wrapper(*args: torch.fx.node.Argument, **kwargs: torch.fx.node.Argument) -> Any:
        proxy = _first_proxy((args, kwargs))
        if proxy is not None:
            return proxy.tracer.create_proxy("call_function", wrapper, args, kwargs)
        return fn(*args, **kwargs)
    return wrapper  # type: ignore[return-value]  # wraps() keeps fn's signature


def _first_proxy(structure: torch.fx.node.Argument) -> torch.fx.Proxy | None:
    found: list[torch.fx.Proxy] = []
    torch.fx.node.map_aggregate(
        structure, lambda x: found.append(x) if isinstance(x, torch.fx.Proxy) else None)
    return found[0] if found else None


def _require_tensor(op: str, value: object, what: str = "tensor") -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"poptorch.{op} expects {what} to be a torch.Tensor, got "
                        f"{type(value).__name__}; pass the tensor itself.")


# ---------------------------------------------------------------------------------------------
# Public PopTorch ops.
# ---------------------------------------------------------------------------------------------
def isRunningOnIpu() -> bool:
    """True while pipetorch's executor runs the model (the "device"), False in plain PyTorch."""
    return _ON_DEVICE.get()


@_fx_leaf
def identity_loss(x: torch.Tensor, reduction: str) -> torch.Tensor:
    """Mark `x` as the loss and reduce it: "sum", "mean" or "none" (PyTorch loss semantics)."""
    _require_tensor("identity_loss", x, "x")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"poptorch.identity_loss got reduction={reduction!r}; use one of "
                         f"{', '.join(repr(r) for r in _REDUCTIONS)}.")
    loss = x.sum() if reduction == "sum" else x.mean() if reduction == "mean" else x
    _record("identity_loss", loss)
    return loss


@_fx_leaf
def recomputationCheckpoint(*tensors: torch.Tensor | Sequence[torch.Tensor]) -> Any:
    """Mark a recomputation point: these values are kept, activations between points recomputed.

    Returns the input unchanged: one tensor for one argument, a tuple for several, and a
    list/tuple of the same type when called with a single list/tuple (as PopTorch does).
    """
    if len(tensors) == 1 and isinstance(tensors[0], (list, tuple)):
        return type(tensors[0])(recomputationCheckpoint(*tensors[0]))
    for index, tensor in enumerate(tensors):
        _require_tensor("recomputationCheckpoint", tensor, f"argument {index}")
    _record("recomputationCheckpoint")
    marker = CHECKPOINT_MARKER.get()
    if marker is not None:
        tensors = marker(tensors)
    return tensors[0] if len(tensors) == 1 else tuple(tensors)


@dataclasses.dataclass(frozen=True)
class _PrintFormat:
    """How ipu_print_tensor lays a tensor out (PopTorch's print options)."""

    summarise_threshold: int
    edge_items: int
    max_line_width: int
    digits: int
    float_format: str
    separator: str
    open_bracket: str
    close_bracket: str

    def render(self, tensor: torch.Tensor) -> str:
        values = tensor.detach().cpu()
        if values.dtype == torch.bfloat16:  # numpy has no bfloat16
            values = values.float()
        text = np.array2string(
            values.numpy(), separator=self.separator, edgeitems=self.edge_items,
            threshold=self.summarise_threshold or sys.maxsize,
            max_line_width=self.max_line_width or sys.maxsize, **self._float_options())
        return text.replace("[", self.open_bracket).replace("]", self.close_bracket)

    def _float_options(self) -> dict[str, Any]:
        if self.digits == 0 or self.float_format == "none":
            return {"formatter": {"float_kind": repr}}
        if self.float_format == "scientific":
            return {"formatter": {"float_kind": lambda v: f"{v:.{self.digits}e}"}}
        if self.float_format == "fixed":
            return {"precision": self.digits, "floatmode": "fixed", "suppress_small": True}
        return {"precision": self.digits}


def _log_tensor(label: str, tensor: torch.Tensor, layout: _PrintFormat) -> None:
    if print_logger.isEnabledFor(logging.INFO):
        print_logger.info("%s: %s", label, layout.render(tensor))


@_fx_leaf
def ipu_print_tensor(tensor: torch.Tensor, title: str = "", print_gradient: bool = True,
                     summarise_threshold: int = 1000, edge_items: int = 3,
                     max_line_width: int = 80, digits: int = 4, float_format: str = "auto",
                     separator: str = ", ", open_bracket: str = "(",
                     close_bracket: str = ")") -> torch.Tensor:
    """Show `tensor` (and its gradient in backward) on the "pipetorch.print" logger; return it.

    The gradient is shown under "<title>_gradient". Use the returned tensor in the rest of the
    model, as PopTorch requires, so the gradient print sits on the backward path.
    """
    _require_tensor("ipu_print_tensor", tensor)
    if float_format not in _FLOAT_FORMATS:
        raise ValueError(f"poptorch.ipu_print_tensor got float_format={float_format!r}; use one "
                         f"of {', '.join(repr(f) for f in _FLOAT_FORMATS)}.")
    layout = _PrintFormat(summarise_threshold, edge_items, max_line_width, digits, float_format,
                          separator, open_bracket, close_bracket)
    if _RECOMPUTING.get() or _QUIET.get():
        return tensor
    _log_tensor(title or "tensor", tensor, layout)
    if print_gradient and tensor.requires_grad and torch.is_grad_enabled():
        # A view gives the print its own place on the backward path, like PopTorch's op.
        tensor = tensor.view_as(tensor)
        gradient_label = f"{title}_gradient" if title else "gradient"
        tensor.register_hook(functools.partial(_log_tensor, gradient_label, layout=layout))
    return tensor


@_fx_leaf
def set_available_memory(tensor: torch.Tensor,
                         available_memory_proportion: float) -> torch.Tensor:
    """Validate an IPU temporary-memory proportion (0, 1] and return `tensor` (no-op here)."""
    _require_tensor("set_available_memory", tensor)
    proportion = available_memory_proportion
    if isinstance(proportion, bool) or not isinstance(proportion, (int, float)):
        raise TypeError("poptorch.set_available_memory expects available_memory_proportion to be "
                        f"a float, got {type(proportion).__name__}; pass e.g. 0.6.")
    if not 0 < proportion <= 1:
        raise ValueError(f"poptorch.set_available_memory got available_memory_proportion="
                         f"{proportion}; it must be in (0, 1], e.g. 0.6 (the IPU default).")
    return tensor


@_fx_leaf
def nop(tensor: torch.Tensor) -> torch.Tensor:
    """An identity that PopTorch never optimises away; returns `tensor`."""
    _require_tensor("nop", tensor)
    return tensor


def _as_tensor_list(op: str, what: str,
                    values: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """A tensor or a list/tuple of tensors, as a list (PopTorch accepts either)."""
    values = [values] if isinstance(values, torch.Tensor) else values
    if not isinstance(values, (list, tuple)):
        raise TypeError(f"poptorch.{op} expects {what} to be a tensor or a list of tensors, got "
                        f"{type(values).__name__}.")
    for index, value in enumerate(values):
        _require_tensor(op, value, f"{what}[{index}]")
    return list(values)


class _LoopInputError(TypeError, ValueError):
    """PopTorch's ValueError for for_loop's inputs, a TypeError too (what it is)."""


def _loop_inputs(inputs: torch.Tensor | list[torch.Tensor]) -> list[torch.Tensor]:
    """for_loop's inputs as a list, refused with PopTorch's ValueErrors (a single tensor is
    accepted too, as a list of one)."""
    if isinstance(inputs, torch.Tensor):
        return [inputs]
    if not isinstance(inputs, (list, tuple)):
        raise _LoopInputError("poptorch.for_loop expects input tensors (inputs) to be a list of "
                         f"tensors. (Object is not list) Got {type(inputs).__name__}.")
    for index, value in enumerate(inputs):
        if not isinstance(value, torch.Tensor):
            raise _LoopInputError(
                "poptorch.for_loop expects input tensors (inputs) to be a list of tensors. "
                f"(Object contained in list at index {index} is not torch.tensor) Got "
                f"{type(value).__name__}.")
    return list(inputs)


def for_loop(count: int, body: Callable[..., Union[torch.Tensor, Sequence[torch.Tensor]]],
             inputs: torch.Tensor | list[torch.Tensor]) -> list[torch.Tensor]:
    """Run `body(*inputs)` `count` times, each time on the previous outputs.

    `inputs` is a tensor or a list of tensors (constants made in forward are fine); `body`
    returns as many tensors as it takes (a single tensor for one), with the same shapes.
    Returns the last outputs as a list (the inputs, copied, when `count` is 0). Gradients
    flow through every iteration, so a trainingModel can train through the loop.
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"poptorch.for_loop expects count to be an int >= 0, got {count!r}.")
    values = _loop_inputs(inputs)
    # Inputs are passed by value in PopTorch: the body must not see the caller's tensors.
    values = [t.clone() for t in values]
    shapes = [tuple(t.shape) for t in values]
    for _ in range(count):
        values = _as_tensor_list("for_loop", "the body's outputs", body(*values))
        new_shapes = [tuple(t.shape) for t in values]
        if new_shapes != shapes:
            raise ValueError(
                "poptorch.for_loop's body must return as many tensors as it takes, with the "
                f"same shapes: inputs have shapes {shapes}, the body returned {new_shapes}.")
    return values


def cond(condition: torch.Tensor | bool,
         then_body: Callable[..., Union[torch.Tensor, Sequence[torch.Tensor]]],
         then_inps: torch.Tensor | list[torch.Tensor],
         else_body: Callable[..., Union[torch.Tensor, Sequence[torch.Tensor]]],
         else_inps: torch.Tensor | list[torch.Tensor]) -> list[torch.Tensor]:
    """Run `then_body(*then_inps)` if `condition` else `else_body(*else_inps)`.

    The inputs are a tensor or a list of tensors; returns the chosen branch's outputs as a
    list. Gradients flow through the branch taken. While a model's stages are being captured
    (torch.export), both branches are kept and a tensor condition selects at run time.
    """
    if isinstance(condition, torch.Tensor) and condition.numel() != 1:
        raise ValueError("poptorch.cond expects a one-element condition tensor, got shape "
                         f"{tuple(condition.shape)}; reduce it first, e.g. with .any().")
    then_values = _as_tensor_list("cond", "then_inps", then_inps)
    else_values = _as_tensor_list("cond", "else_inps", else_inps)
    if isinstance(condition, torch.Tensor) and torch.compiler.is_exporting():
        # Captured stages hold no data: both branches run and the condition picks, per output,
        # at run time (as an IPU compiles both). The branch not taken gets zero gradients.
        taken = _as_tensor_list("cond", "the then branch's outputs", then_body(*then_values))
        other = _as_tensor_list("cond", "the else branch's outputs", else_body(*else_values))
        if [(t.shape, t.dtype) for t in taken] != [(t.shape, t.dtype) for t in other]:
            raise ValueError(
                "poptorch.cond's branches must return tensors of the same shapes and dtypes: "
                f"then gives {[(tuple(t.shape), t.dtype) for t in taken]}, else gives "
                f"{[(tuple(t.shape), t.dtype) for t in other]}.")
        pick = condition.reshape(()).bool()
        return [torch.where(pick, t, e) for t, e in zip(taken, other, strict=True)]
    body, inps = (then_body, then_values) if bool(condition) else (else_body, else_values)
    return _as_tensor_list("cond", "the branch's outputs", body(*inps))
