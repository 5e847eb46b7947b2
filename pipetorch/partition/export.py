"""Capturing a model's forward with torch.export, every graph node stamped with its block.

Non-strict export runs forward as Python on fake tensors, so hooks (BeginBlock, forward hooks
that replace outputs), `with Block(...)` scopes and shape-dependent Python control flow all
run as in eager mode. While it runs, each block change is written into fx's "custom" node
metadata, which export copies onto every node it creates.
"""
from __future__ import annotations

import contextlib
import logging
import operator
import re
import sys
import traceback
from typing import TYPE_CHECKING, Any, Callable, Iterator, TypeGuard

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
import torch.nn as nn
from torch.utils import _pytree as pytree

from pipetorch import losses, ops, tracebacks
from pipetorch.errors import CompileError, Error
from pipetorch.partition import blocks
from pipetorch.partition.casting import Casting
from pipetorch.partition.stage_module import attribute
if TYPE_CHECKING:  # the library never imports transformers: a model brings it
    from transformers.cache_utils import Cache

from pipetorch.partition.trace import (BLOCK_KEY, InputLayout, Traced, Tree, input_layout,
                                       quoted_frame, user_line)

__all__: list[str] = []

logger = logging.getLogger(__name__)

_CHECKPOINT_KEY = "pipetorch_checkpoint"  # custom meta of a recomputationCheckpoint marker
# Reading an item or a size is not an op: outside any block it goes with the value it reads.
_STRUCTURAL = (operator.getitem, torch.ops.aten.sym_size.int)


def available() -> bool:
    """Whether this torch can export with custom node metadata (torch >= 2.5)."""
    return hasattr(torch, "export") and "custom" in getattr(fx.proxy, "_COPY_META_FIELDS", ())


Watch = Callable[[Callable[[], Tree]], Tree]  # runs forward (the thunk), returns its output


class _Bound(nn.Module):
    """Calls the model with the constants of the captured call and the tensors it is given,
    under `casting` when given, through `watch`."""

    def __init__(self, model: nn.Module, layout: InputLayout, args: tuple, kwargs: dict,
                 casting: Casting | None = None, watch: Watch | None = None) -> None:
        super().__init__()
        self.model = model
        self._casting = casting or contextlib.nullcontext
        self._watch: Watch = watch or (lambda run: run())
        self._bound = layout.signature.bind(*args, **kwargs)
        self._bound.apply_defaults()
        self._layout = layout

    def forward(self, *tensors: torch.Tensor) -> Tree:
        bound = self._bound
        arguments = dict(bound.arguments)
        arguments.update(self._layout.arguments(tensors))
        call = bound.signature.bind_partial()
        call.arguments.update(arguments)

        def run() -> Tree:
            with self._casting():
                return without_caches(self.model, self.model(*call.args, **call.kwargs))

        return self._watch(run)


def is_cache(value: object) -> TypeGuard[Cache]:
    """Whether `value` is a HuggingFace key/value cache (transformers' `Cache` classes)."""
    cache_utils = sys.modules.get("transformers.cache_utils")
    return cache_utils is not None and isinstance(value, getattr(cache_utils, "Cache", ()))


def without_caches(model: nn.Module, output: Tree) -> Tree:
    """`output` without the key/value caches a HuggingFace model returns by default
    (`use_cache=True`: `past_key_values` is a `DynamicCache`).

    In training no later step reads a cache, so it is dropped (its entry becomes None, which a
    ModelOutput leaves out). In inference a cache is what generation reads next, and its
    tensors cannot be split across devices: CompileError saying to turn it off.
    """
    caches = [leaf for leaf in pytree.tree_leaves(output) if is_cache(leaf)]
    if not caches:
        return output
    name = type(model).__name__
    kind = type(caches[0]).__name__
    if not model.training:
        raise CompileError(
            f"{name}'s forward returns a {kind} (its key/value cache, `past_key_values`), "
            "which cannot be split into stages: set `model.config.use_cache = False` (or pass "
            "use_cache=False to forward), or run the model on one device without blocks "
            "(poptorch.removeBlocks). To generate text, call the inferenceModel's generate(): "
            "it runs in the stages, each keeping the cache of its own layers")
    logger.info("%s returns its key/value cache, %s (config.use_cache=True); training never "
                "reads it, so the split model returns None in its place", name, kind)
    return pytree.tree_map(lambda leaf: None if is_cache(leaf) else leaf, output)


@contextlib.contextmanager
def _stamping(recorder: blocks.BlockRecorder) -> Iterator[None]:
    """Write the active block into the metadata export copies onto each new node."""
    def stamp() -> None:
        fx_traceback.current_meta.setdefault("custom", {})[BLOCK_KEY] = recorder.current()

    had = "custom" in fx_traceback.current_meta
    saved = dict(fx_traceback.current_meta.get("custom", {}))
    recorder.on_change = stamp
    token = ops.CHECKPOINT_MARKER.set(checkpoint_marker)
    try:
        with fx_traceback.preserve_node_meta():
            stamp()
            yield
    finally:
        ops.CHECKPOINT_MARKER.reset(token)
        recorder.on_change = None
        if had:
            fx_traceback.current_meta["custom"] = saved
        else:
            fx_traceback.current_meta.pop("custom", None)


def checkpoint_marker(tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """recomputationCheckpoint under export: aliases whose nodes say they are checkpoints."""
    with fx_traceback.annotate({_CHECKPOINT_KEY: True}):
        return tuple(torch.ops.aten.alias.default(t) for t in tensors)


def export_blocks(model: nn.Module, args: tuple, kwargs: dict, *,
                  casting: Casting | None = None, watch: Watch | None = None) -> Traced:
    """Capture `model(*args, **kwargs)` with torch.export (non-strict) for splitting.

    The result's graph takes the call's tensor arguments, in forward's signature order, and
    returns the flat leaves of forward's output; `Traced.output_spec` rebuilds the structure
    (tuples, dicts, dataclasses such as HuggingFace's ModelOutput). Parameters and buffers
    are the model's own objects under their names in the model. `casting` (partition.casting)
    is the mode forward runs under: the casts it makes are nodes of the graph. `watch(run)`
    runs forward (on fake tensors) and returns its output, to observe it (partition.probe).
    """
    layout = input_layout(model, args, kwargs)
    bound = _Bound(model, layout, args, kwargs, casting, watch)
    tensors = tuple(layout.flatten(args, kwargs))
    with blocks.recording() as recorder:
        try:
            with _stamping(recorder), _meta_errors_unlogged():
                program = torch.export.export(bound, tensors, strict=False)
        except Error:
            raise
        except Exception as error:
            raise CompileError(_failure_message(model, error)) from error
    unlifted = program.module()
    graph = unlifted.graph
    _drop_guards(graph)
    out_spec = graph._codegen.pytree_info.out_spec if hasattr(graph._codegen, "pytree_info") else None
    graph._codegen = fx.graph.CodeGen()
    _mark_blocks(graph)
    _restore_checkpoints(graph)
    attrs = _attributes(graph, model, unlifted)
    module = fx.GraphModule(attrs, graph, class_name=f"Exported{type(model).__name__}")
    return Traced(module, recorder.ordered(), layout, output_spec=out_spec)


@contextlib.contextmanager
def _meta_errors_unlogged() -> Iterator[None]:
    """Keep torch's fake tensors from logging a failing op's traceback: the error says it."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


def _drop_guards(graph: fx.Graph) -> None:
    """Remove the input guards and metadata asserts export adds: the host checks the shapes
    of every call against the captured ones."""
    for node in list(graph.nodes):
        if node.op == "call_module" and str(node.target).startswith("_guards") or \
                node.target is torch.ops.aten._assert_tensor_metadata.default:
            graph.erase_node(node)
    graph.lint()


def _mark_blocks(graph: fx.Graph) -> None:
    """Copy each node's block into `meta[BLOCK_KEY]`.

    Nodes export makes without the user's code running (buffer write-backs, views of a
    result) carry no block once blocks are in use: they go with the latest-placed value they
    read, or the node before them.
    """
    seen_block = False
    previous: str | None = None
    order: dict[str, int] = {}
    for node in graph.nodes:
        block = node.meta.get("custom", {}).get(BLOCK_KEY)
        if node.op in ("placeholder", "get_attr"):
            node.meta[BLOCK_KEY] = None
            continue
        if block is None and seen_block:
            where = _user_frame(node)
            if where and node.target not in _STRUCTURAL:
                raise CompileError(
                    f"No active Block: '{_op_name(node)}'{where} runs after block "
                    f"{previous!r} ended, outside any block. Once a model uses blocks every op after the "
                    "first block must be in one: move it inside a `with poptorch.Block(...)`, "
                    "or start a block with poptorch.Block.start(...) / BeginBlock")
            reads = [n.meta[BLOCK_KEY] for n in node.all_input_nodes
                     if n.meta.get(BLOCK_KEY) is not None]
            block = max(reads, key=order.__getitem__) if reads else previous
        if block is not None:
            seen_block = True
            order.setdefault(block, len(order))
            previous = block
        node.meta[BLOCK_KEY] = block


def _user_frame(node: fx.Node) -> str:
    """' at file:line in function: `code`' of the user's line that made `node`, or ''."""
    frames = tracebacks.frames_in(node.meta.get("stack_trace") or "")
    return quoted_frame(tracebacks.user_frame(frames))


def _op_name(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::")[-1]
    return getattr(target, "__name__", str(target))


def _restore_checkpoints(graph: fx.Graph) -> None:
    """Turn the marker aliases back into recomputationCheckpoint calls the recompute pass finds."""
    for node in list(graph.nodes):
        if node.meta.get("custom", {}).get(_CHECKPOINT_KEY):
            with graph.inserting_after(node):
                call = graph.call_function(ops.recomputationCheckpoint, node.args)
            call.meta = dict(node.meta)
            node.replace_all_uses_with(call)
            graph.erase_node(node)


def _attributes(graph: fx.Graph, model: nn.Module, unlifted: nn.Module) -> dict[str, Any]:
    """Every get_attr target as the model's own object, named as in the model.

    Export prefixes the names with `model.` (the bound wrapper); constants that forward made
    (torch.tensor(...)) live only on the exported module and keep its names.
    """
    first_name: dict[int, str] = {}  # a tied weight goes by its first name, as in the model
    for named in (model.named_parameters(remove_duplicate=False),
                  model.named_buffers(remove_duplicate=False)):
        for name, tensor in named:
            first_name.setdefault(id(tensor), name)
    attrs: dict[str, Any] = {}
    for node in graph.find_nodes(op="get_attr"):
        target = str(node.target)
        name = target.removeprefix("model.")
        try:
            value = attribute(model, name)
            name = first_name.get(id(value), name)
        except AttributeError:
            name, value = target.replace(".", "_"), attribute(unlifted, target)
        node.target = name
        attrs[name] = value
    return attrs


def _failure_message(model: nn.Module, error: Exception) -> str:
    where = user_line(traceback.extract_tb(error.__traceback__))
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    construct = _construct(error)
    return (
        f"Cannot split {type(model).__name__} into stages: torch.export could not capture its "
        f"forward{where}: {construct} ({type(error).__name__}: {first[:300]}). The stages are "
        "cut from one captured graph: forward may branch on shapes and Python values, but not "
        "on the values inside tensors. Compute the branch with torch.where / poptorch.cond, "
        "or run the model as a single stage: remove its Block / BeginBlock annotations "
        "(poptorch.removeBlocks)."
    )


def _construct(error: Exception) -> str:
    text = f"{type(error).__name__} {error}"
    unknown = re.search(r"Found (<class '[^']+'>) in output, which is not a known type", text)
    if unknown:
        return (f"{losses.unregistered(unknown.group(1))} (HuggingFace models: "
                "config.use_cache=False, so no cache object is returned)")
    if "data-dependent" in text or "GuardOnDataDependent" in text:
        return "Python control flow or a Python number read from a tensor's values"
    if "Unsupported" in text or "not supported" in text:
        return "an operation torch.export does not support"
    return "an operation that could not be captured"
