"""Saved executables: `compileAndExport(path)` / `save(path)` and `poptorch.load(path)`.

The file holds what compiling captured, not the model's Python: the whole forward as a
torch.export graph (aten operators, stored node by node as the executable cache stores it)
with the block of each node, the weights as the graph's attributes, the wrapper's options,
whether it trains and, for training, its optimiser (a pipetorch.optim or torch.optim class,
its groups and state by parameter name). A fresh process loads it with pipetorch alone and
gets a wrapper that runs the same stages on the same devices. It is written behind the
executable cache's checked header; a file written by another pipetorch, torch or Python
version is refused with the versions named, before anything is unpickled.

    PIPETORCH-EXECUTABLE\\n
    {"format": 1, "pipetorch": ..., "torch": ..., "python": ..., "sha256": ...}\\n
    <pickled payload>
"""
from __future__ import annotations

import inspect
import logging
import pickle
import platform
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, TypedDict

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils import _pytree as pytree

from pipetorch.version import __version__
from pipetorch import ops
from pipetorch.enums import ConnectionType
from pipetorch.errors import ConfigError, Error
from pipetorch.optim.attributes import VariableAttributes
from pipetorch.partition import blocks
from pipetorch.partition.cache import read_checked, unpickle, write_checked
from pipetorch.partition.export import Tree
from pipetorch.partition.stage_module import StageModule, attribute
from pipetorch.partition.trace import BLOCK_KEY, InputLayout, Traced
from pipetorch.runtime.batching import Signature

if TYPE_CHECKING:
    from pipetorch.options import Options
    from pipetorch.runtime.compile import Compiled

__all__ = ["ExecutableError"]


logger = logging.getLogger(__name__)

MAGIC = b"PIPETORCH-EXECUTABLE\n"
FORMAT = 1


class ExecutableError(Error, RuntimeError):
    """A saved executable that cannot be loaded here (another version, a damaged file)."""


# A training executable's optimiser: its class, defaults, groups (parameters by name) and
# state_dict, rebuilt over the loaded graph's parameters.
OptimizerRecord = TypedDict("OptimizerRecord", {
    "class": type[torch.optim.Optimizer], "defaults": dict[str, Any],
    "groups": list[dict[str, Any]], "state": dict[str, Any],
    "variable_attrs": VariableAttributes | None})


def _versions() -> dict[str, Any]:
    return {"format": FORMAT, "pipetorch": __version__, "torch": torch.__version__,
            "python": platform.python_version()}


def begin_block(user_id: str, ipu_id: int | None) -> None:
    """A graph node's way of starting its block (the saved graph has no `with Block`)."""
    recorder = blocks.active_recorder()
    if recorder is not None:
        recorder.begin(user_id, ipu_id, scoped=False)


class LoadedModel(nn.Module):
    """A saved forward: the call's tensors in, the graph run, the outputs rebuilt."""

    def __init__(self, graph: fx.GraphModule, layout: InputLayout,
                 output_spec: pytree.TreeSpec | None) -> None:
        super().__init__()
        self.net, self.layout = graph, layout
        # As text where it can be: copies of the model (one per device) then copy no pytree
        # objects (whose copying warns on some torch versions).
        self._spec: pytree.TreeSpec | str | None = output_spec
        try:
            self._spec = None if output_spec is None else pytree.treespec_dumps(output_spec)
        except Exception:  # a node type without serialisation (a ModelOutput): keep it
            pass

    def forward(self, *args: Tree, **kwargs: Tree) -> Any:
        leaves = self.net(*self.layout.flatten(args, kwargs))
        if self._spec is None:
            return leaves
        spec = pytree.treespec_loads(self._spec) if isinstance(self._spec, str) else self._spec
        return pytree.tree_unflatten(list(leaves), spec)


def _model_class(layout: InputLayout) -> type:
    """LoadedModel with forward's signature the saved model's (splitting binds by name)."""
    def forward(self: LoadedModel, *args: Tree, **kwargs: Tree) -> Any:
        return LoadedModel.forward(self, *args, **kwargs)

    me = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    forward.__signature__ = layout.signature.replace(  # type: ignore[attr-defined]  # for inspect
        parameters=[me, *layout.signature.parameters.values()])
    return type(LoadedModel.__name__, (LoadedModel,), {"forward": forward,
                                                       "__module__": __name__})


def save(path: str | Path, compiled: Compiled, *, model: nn.Module, options: Options,
         training: bool, signature: Signature | None,
         optimizer: torch.optim.Optimizer | None) -> None:
    """Write the executable of `compiled` (a wrapper's, `model` its user model holding the
    latest weights, `signature` the first call's) to `path`."""
    whole = compiled.graph
    assert whole is not None  # compile_model makes it
    traced: Traced = whole()
    whole.save()  # a capture made here serves the executable cache too
    graph = _with_blocks_and_losses(traced, compiled.capture.loss_index if training else None)
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    attrs: dict[str, Any] = {}
    for node in graph.find_nodes(op="get_attr"):
        target = str(node.target)  # the user's latest weights; constants made by forward
        if target in params:
            attrs[target] = nn.Parameter(params[target].detach().clone(),
                                         requires_grad=params[target].requires_grad)
        elif target in buffers:
            attrs[target] = buffers[target].detach().clone()
        else:
            attrs[target] = attribute(traced.module, target)
    module = StageModule(attrs, graph, class_name=f"Saved{type(model).__name__}")
    payload = {
        "graph": module, "layout": _portable(traced.layout), "output_spec": traced.output_spec,
        "options": options, "training": training, "signature": signature,
        "optimizer": _optimizer_record(optimizer, model) if training else None,
    }
    try:
        data = pickle.dumps(payload)
    except Exception as error:
        raise ExecutableError(
            f"The compiled {type(model).__name__} cannot be saved: {error}. The graph "
            "must hold only torch operators and the optimiser must be a poptorch.optim or "
            "torch.optim one") from error
    write_checked(_file(path), MAGIC, _versions(), data)


def _file(path: str | Path) -> Path:
    """`path`, or `path`/model.poptorch when it is a folder (as PopTorch does)."""
    target = Path(path)
    if target.is_dir():
        logger.warning("compileAndExport: %s is a directory, saving the model to %s",
                       target, target / "model.poptorch")
        return target / "model.poptorch"
    return target


def _with_blocks_and_losses(traced: Traced, loss_index: int | None) -> fx.Graph:
    """A copy of the graph that starts each block where its first node is, and (training)
    passes the loss through identity_loss, so a probe of the loaded model finds it."""
    graph = fx.Graph()
    mapping: dict[fx.Node, fx.Node] = {}
    infos = {b.user_id: b for b in traced.blocks}
    current = None
    for node in traced.module.graph.nodes:
        block = node.meta.get(BLOCK_KEY)
        if block is not None and block != current and node.op not in ("placeholder", "get_attr"):
            graph.call_function(begin_block, (block, infos[block].ipu_id))
            current = block
        if node.op == "output" and loss_index is not None:
            graph.output(_mark_loss(graph, node.args[0], mapping, loss_index))
            continue
        mapping[node] = graph.node_copy(node, lambda n: mapping[n])
    return graph


def _mark_loss(graph: fx.Graph, outputs: fx.node.Argument, mapping: dict[fx.Node, fx.Node],
               loss_index: int) -> fx.node.Argument:
    """The output with the loss (tensor output `loss_index`) passed through identity_loss."""
    leaves, flat_spec = pytree.tree_flatten(fx.node.map_arg(outputs, lambda n: mapping[n]))
    tensors = [i for i, leaf in enumerate(leaves) if isinstance(leaf, fx.Node)]
    position = tensors[loss_index]
    leaves[position] = graph.call_function(ops.identity_loss, (leaves[position], "none"))
    return pytree.tree_unflatten(leaves, flat_spec)


def _portable(layout: InputLayout) -> InputLayout:
    """The layout without annotations or default objects of the user's code."""
    empty = inspect.Parameter.empty
    params = [p.replace(annotation=empty,
                        default=p.default if p.name in layout.constants else empty)
              for p in layout.signature.parameters.values()]
    return InputLayout(inspect.Signature(params), layout.tensors, dict(layout.constants),
                       dict(layout.nested))


def _optimizer_record(optimizer: torch.optim.Optimizer | None, model: nn.Module
                      ) -> OptimizerRecord:
    assert optimizer is not None  # a trainingModel's
    names = {id(p): n for n, p in model.named_parameters()}
    state = optimizer.state_dict()
    state.pop("ipu_state", None)
    state.pop("ipu_param", None)  # PopTorch-named copies of the groups and state above
    groups = [{**{k: v for k, v in g.items() if k != "params"},
               "params": [names[id(p)] for p in g["params"]]} for g in optimizer.param_groups]
    return {"class": type(optimizer).__dict__.get("_pipetorch_base", type(optimizer)),
            "defaults": dict(optimizer.defaults), "groups": groups, "state": state,
            "variable_attrs": optimizer.__dict__.get("variable_attrs")}


def read_executable(path: str | Path, edit_opts_fn: Callable[[Options], object] | None = None
                    ) -> dict[str, Any]:
    """What a wrapper for the executable saved at `path` is built from (`executor.load`):
    model, options, training, optimizer; `edit_opts_fn(options)` may change its (unfrozen
    copy of the) options first."""
    payload = _read(path)
    model = _model_class(payload["layout"])(payload["graph"], payload["layout"],
                                            payload["output_spec"])
    optimizer = None
    if payload["training"]:
        optimizer = _rebuild_optimizer(payload["optimizer"], model.net)
    options = payload["options"]
    if options.connection_type == ConnectionType.Never:
        # compiled offline (useOfflineIpuTarget) to be loaded and run: now it may run
        options = options.clone().connectionType(ConnectionType.Always)
    if edit_opts_fn is not None:
        options = options.clone()
        edit_opts_fn(options)
    return {"model": model, "options": options, "training": payload["training"],
            "optimizer": optimizer}


def saved_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The weights (parameters and buffers, by the model's names) saved at `path`."""
    graph = _read(path)["graph"]
    return {**dict(graph.named_parameters()), **dict(graph.named_buffers())}


def saved_inputs(path: str | Path) -> tuple[tuple, dict]:
    """Inputs shaped as those the executable at `path` was compiled for (zeros)."""
    signature: Signature = _read(path)["signature"]
    leaves = [torch.zeros(leaf.shape, dtype=leaf.dtype) if leaf.shape is not None
              else leaf.constant for leaf in signature.leaves]
    return pytree.tree_unflatten(leaves, signature.spec)


_WRITTEN_BY = "write one with wrapper.compileAndExport(path, *inputs) or wrapper.save(path)"


def _what_it_is(head: bytes) -> str:
    """What a file that is not an executable looks like, from its first bytes."""
    if not head:
        return "an empty file"
    if head.startswith(b"PK\x03\x04"):
        return "a torch.save file (a zip archive): load it with torch.load(path)"
    if head.startswith(b"\x80"):
        return "a pickle (torch.save's legacy format or pickle.dump): load it with torch.load(path)"
    return f"a file starting with {head[:16]!r}"


def _read(path: str | Path) -> dict[str, Any]:
    target = Path(path)
    if target.is_dir() and (target / "model.poptorch").is_file():
        target = target / "model.poptorch"  # where save(folder) wrote it
    if not target.is_file():
        raise ExecutableError(
            f"poptorch.load: there is no file {str(path)!r} (expected a pipetorch executable; "
            f"{_WRITTEN_BY})")
    with open(target, "rb") as file:
        head = file.read(len(MAGIC))
    if head != MAGIC:
        raise ExecutableError(
            f"poptorch.load: {str(path)!r} is not a pipetorch executable (those start with "
            f"{MAGIC.strip().decode()!r}); it is {_what_it_is(head)}. To make an executable, "
            f"{_WRITTEN_BY.split('; ')[0]}")
    try:
        header, data = read_checked(target, MAGIC, "a pipetorch executable")
    except (OSError, ValueError) as error:
        raise ExecutableError(
            f"poptorch.load: the executable {str(path)!r} is truncated or damaged ({error}): "
            f"{_WRITTEN_BY} again") from error
    here = _versions()
    saved = {k: header.get(k) for k in here}
    if saved != here:
        raise ExecutableError(
            f"The executable {path} was saved by pipetorch {saved['pipetorch']} with torch "
            f"{saved['torch']} and Python {saved['python']} (format {saved['format']}); this "
            f"is pipetorch {here['pipetorch']} with torch {here['torch']} and Python "
            f"{here['python']}: export it again with these versions")
    return unpickle(data)


def _rebuild_optimizer(record: OptimizerRecord, graph: nn.Module) -> torch.optim.Optimizer:
    groups = [{**g, "params": [graph.get_parameter(n) for n in g["params"]]}
              for g in record["groups"]]
    optimizer = record["class"](groups, **record["defaults"])
    optimizer.load_state_dict(record["state"])
    if record["variable_attrs"] is not None:
        optimizer.__dict__["variable_attrs"] = record["variable_attrs"]
    return optimizer


def inputs_for(filename: str, model: nn.Module) -> tuple[tuple, dict]:
    """loadExecutable: the inputs the executable at `filename` was saved for, checked to
    come from `model`'s class (weights of the same names and shapes)."""
    saved = saved_weights(filename)
    own = dict(model.state_dict())
    wrong = [n for n, t in saved.items() if n not in own or own[n].shape != t.shape]
    if wrong:
        raise ConfigError(
            f"The executable {filename} was saved from another model: its weights "
            f"{wrong[:4]} are missing here or have other shapes")
    return saved_inputs(filename)
