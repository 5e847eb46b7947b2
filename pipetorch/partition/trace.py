"""Symbolic tracing of a model's forward with every graph node stamped with its block."""
from __future__ import annotations

import inspect
import operator
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, TypeAlias

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx._symbolic_trace import _assert_is_none
from torch.utils import _pytree as pytree

from pipetorch import tracebacks
from pipetorch.errors import CompileError, Error
from pipetorch.partition import blocks
from pipetorch.partition.blocks import BlockInfo, BlockRecorder

__all__: list[str] = []

# A call's arguments or forward's output, as torch's pytree opens it: tensors and other leaves
# (None, numbers, a HuggingFace cache) in tuples, lists, dicts and dataclasses such as
# ModelOutput. Its leaves are the user's values, so it can be any object: the code opens it
# with pytree (or map_leaves) and narrows the leaves with isinstance.
Tree: TypeAlias = object

BLOCK_KEY = "pipetorch_block"  # node.meta key: the id of the block that created the node, or None

_CONSTANT_TYPES = (type(None), bool, int, float, str)
# Reading a shape or an item of a tuple is not an op (the eager probe lets them pass too):
# outside any block such a node goes with the value it reads.
_STRUCTURAL = {("call_function", getattr), ("call_function", operator.getitem),
               ("call_method", "size"), ("call_method", "dim")}
# What fx adds to check an argument traced as a constant (the stages check it on the host).
_CHECKS = (operator.eq, torch._assert, _assert_is_none)


@dataclass(frozen=True, eq=False)
class InputLayout:
    """Which of forward's arguments are traced tensors and which were baked in as constants."""

    signature: inspect.Signature
    tensors: tuple[str, ...]  # forward's parameter names of tensor arguments, signature order
    constants: dict[str, Any]  # parameter name -> the value the trace was specialised for
    # parameter name -> the structure of an argument holding several tensors (a dict, list or
    # tuple of them): each of its tensors is an input of the graph, in pytree order
    nested: dict[str, Any] = field(default_factory=dict)

    def flatten(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        """The tensor arguments of a call, in forward's signature order (x, then labels)."""
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        for name, traced in self.constants.items():
            value = bound.arguments[name]
            if isinstance(value, torch.Tensor) or not _same_constant(value, traced):
                raise ValueError(
                    f"forward was called with {name}={_describe(value)} but its stages were "
                    f"traced with {name}={traced!r}, which is baked into them; split the model "
                    f"again for calls with this {name}"
                )
        tensors: list[torch.Tensor] = []
        for name in self.tensors:
            value = bound.arguments[name]
            spec = self.nested.get(name)
            if spec is not None:
                leaves, got = pytree.tree_flatten(value)
                if got != spec or not all(isinstance(leaf, torch.Tensor) for leaf in leaves):
                    raise ValueError(
                        f"forward was called with {name}={_describe(value)} but its stages were "
                        f"traced with {name} holding tensors as {spec}; pass the same structure "
                        "or split the model again")
                tensors.extend(leaves)
            elif not isinstance(value, torch.Tensor):
                raise ValueError(
                    f"forward was called with {name}={_describe(value)} but its stages were "
                    f"traced with a tensor {name}; pass a tensor or split the model again"
                )
            else:
                tensors.append(value)
        return tensors

    def arguments(self, tensors: Sequence[torch.Tensor]) -> dict[str, Any]:
        """Forward's tensor arguments rebuilt from the list `flatten` makes."""
        out: dict[str, Any] = {}
        at = 0
        for name in self.tensors:
            spec = self.nested.get(name)
            count = 1 if spec is None else spec.num_leaves
            part = list(tensors[at:at + count])
            out[name] = part[0] if spec is None else pytree.tree_unflatten(part, spec)
            at += count
        return out


@dataclass(frozen=True, eq=False)
class Traced:
    """A model's forward as one graph whose nodes carry their block in `meta[BLOCK_KEY]`."""

    module: fx.GraphModule
    blocks: list[BlockInfo]
    layout: InputLayout
    # How forward's output is rebuilt from the graph's flat output (torch.export captures);
    # None when the graph returns forward's structure itself (torch.fx captures).
    output_spec: pytree.TreeSpec | None = None


def _same_constant(value: Tree, traced: Tree) -> bool:
    try:
        return type(value) is type(traced) and bool(value == traced)
    except Exception:  # a constant whose == does not give a bool is not the same constant
        return False


def _describe(value: Tree) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return repr(value)


class _BlockTracer(fx.Tracer):
    """Traces forward inside a block recording, so `with Block(...)` scopes run as usual.

    torch.fx turns calls of leaf modules (nn.Linear, nn.Conv2d, ...) into nodes without
    running their hooks, so BeginBlock's pre-hook would not fire: `call_module` starts the
    block itself before the module's node is created.
    """

    def __init__(self, recorder: BlockRecorder, begins: dict[int, tuple[str, int | None]]) -> None:
        super().__init__()
        self.recorder = recorder
        self.begins = begins  # id(module) -> (user_id, ipu_id) of the block it begins

    def call_module(self, m: nn.Module, forward: Callable[..., object], args: tuple,
                    kwargs: dict) -> Any:
        ids = self.begins.get(id(m))
        if ids is not None:
            self.recorder.begin(*ids, scoped=False)
        return super().call_module(m, forward, args, kwargs)

    def create_node(self, kind: str, target: fx.node.Target, args: tuple, kwargs: dict,
                    name: str | None = None, type_expr: object = None) -> fx.Node:
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        node.meta[BLOCK_KEY] = self._block_of(node)
        return node

    def _block_of(self, node: fx.Node) -> str | None:
        rec = self.recorder
        current = rec.current()
        if current is not None or not rec.used or node.op in ("placeholder", "get_attr", "output"):
            return current  # None before the first block: those nodes go to the first stage
        if (node.op, node.target) in _STRUCTURAL and isinstance(node.args[0], fx.Node):
            return node.args[0].meta.get(BLOCK_KEY)
        raise CompileError(
            f"No active Block: '{_op_name(node)}'{user_line(traceback.extract_stack())} runs "
            f"after block {rec.last_ended!r} ended, outside any block. Once a model uses blocks "
            "every op after the first block must be in one: move it inside a "
            "`with poptorch.Block(...)`, or start a block with poptorch.Block.start(...) / "
            "BeginBlock"
        )


def _op_name(node: fx.Node) -> str:
    if node.op == "call_function":
        return getattr(node.target, "__name__", str(node.target))
    return str(node.target)


def user_line(frames: list[traceback.FrameSummary]) -> str:
    """' at file:line in function: `code`' for the innermost frame of the user's code."""
    return quoted_frame(tracebacks.user_frame(
        [(f.filename, f.lineno or 0, f.name, f.line) for f in frames]))


def quoted_frame(frame: tracebacks.Frame | None) -> str:
    """' at file:line in function: `code`', or '' for no frame."""
    if frame is None:
        return ""
    filename, line, name, code = frame
    return f" at {filename}:{line} in {name}: `{(code or '').strip()}`"


FX_RULES = ("torch.fx rules: no Python `if`/`while`/`for` on tensor values, no "
            ".item()/bool()/int() of tensors (see 'Limitations of Symbolic Tracing' in the "
            "torch.fx docs)")


def trace_blocks(model: nn.Module, args: tuple, kwargs: dict) -> Traced:
    """Trace `model(*args, **kwargs)` symbolically; tensors become inputs, constants are baked in.

    Raises CompileError when forward cannot be traced (data-dependent Python control flow) or
    runs an op outside every block once blocks are in use.
    """
    layout = input_layout(model, args, kwargs)
    if layout.nested:
        raise CompileError(
            f"Cannot split {type(model).__name__} with torch.fx: its arguments "
            f"{sorted(layout.nested)} hold several tensors; pass each tensor as an argument "
            "of its own, or use torch >= 2.5 (torch.export takes them)")
    begins = {id(model.get_submodule(name)): ids
              for name, ids in blocks.begin_blocks(model).items()}
    before = set(vars(model))
    with blocks.recording() as recorder:
        tracer = _BlockTracer(recorder, begins)
        try:
            graph = tracer.trace(model, concrete_args=layout.constants)
        except Error:
            raise
        except Exception as error:  # any failure of symbolic tracing is the same user problem
            raise CompileError(_failure_message(model, error)) from error
    try:
        _drop_constant_inputs(graph, layout)
        module = fx.GraphModule(model, graph, class_name=f"Traced{type(model).__name__}")
    finally:
        # fx stores tensor constants on the traced root; the GraphModule holds its own
        # references by now, so the user's module is left as it was.
        for name in set(vars(model)) - before:
            delattr(model, name)
    return Traced(module, recorder.ordered(), layout)


def input_layout(model: nn.Module, args: tuple, kwargs: dict) -> InputLayout:
    signature = inspect.signature(model.forward)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as error:
        raise TypeError(f"{type(model).__name__}.forward{signature} does not accept the "
                        f"arguments given for splitting: {error}") from error
    bound.apply_defaults()
    tensors: list[str] = []
    constants: dict[str, Any] = {}
    nested: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        leaves, spec = pytree.tree_flatten(value)
        if isinstance(value, torch.Tensor):
            tensors.append(name)
        elif all(isinstance(leaf, _CONSTANT_TYPES) for leaf in leaves):
            constants[name] = value
        elif all(isinstance(leaf, torch.Tensor) for leaf in leaves):
            tensors.append(name)  # a dict or list of tensors: each is a graph input
            nested[name] = spec
        else:
            raise CompileError(
                f"Cannot split {type(model).__name__}: its forward argument {name!r} is "
                f"{type(value).__name__} {_describe(value)}; stages take tensors, None or Python "
                "numbers/strings as arguments: pass each tensor as an argument of its own"
            )
    return InputLayout(signature, tuple(tensors), constants, nested)


def _drop_constant_inputs(graph: fx.Graph, layout: InputLayout) -> None:
    """Remove the placeholders fx keeps for constant arguments, with its checks of them."""
    for placeholder in list(graph.find_nodes(op="placeholder")):
        if placeholder.target in layout.tensors:
            continue
        checks = _users_closure(placeholder)
        if any(node.op != "call_function" or node.target not in _CHECKS for node in checks):
            name = str(placeholder.target).lstrip("*")
            raise CompileError(
                f"forward reads its argument {name!r} in a way that cannot be split into "
                "stages; pass tensors as named arguments (no *args / **kwargs in forward)"
            )
        for node in reversed(checks):
            graph.erase_node(node)
        graph.erase_node(placeholder)


def _users_closure(node: fx.Node) -> list[fx.Node]:
    """Every node reading `node`, directly or not, in graph order."""
    found: dict[fx.Node, None] = {}
    pending = list(node.users)
    while pending:
        user = pending.pop()
        if user not in found:
            found[user] = None
            pending.extend(user.users)
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return sorted(found, key=order.__getitem__)


def _failure_message(model: nn.Module, error: Exception) -> str:
    where = user_line(traceback.extract_tb(error.__traceback__))
    return (
        f"Cannot split {type(model).__name__} into stages: torch.fx could not trace its "
        f"forward{where} ({type(error).__name__}: {error}). The stages are cut from one traced "
        f"graph, so forward must be traceable under {FX_RULES}. Otherwise run the model as a single stage: remove its "
        "Block / BeginBlock annotations (poptorch.removeBlocks)."
    )
