"""Stage modules that pickle their graph node by node, so workers run exactly that graph.

A plain fx.GraphModule pickles its generated Python code and re-traces it when unpickled.
Re-tracing runs, eagerly and once, every op whose arguments hold no traced value (an
in-place update of a buffer, such as BatchNorm's `num_batches_tracked += 1` in a torch.export
graph) and drops it from the graph: the worker's copy would never update that buffer.
`graph_nodes` / `build_graph` are that node-by-node form, also used by the capture cache.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

__all__: list[str] = []

NodeRecord = tuple[str, str, Any, Any, Any]  # op, name, target, args, kwargs


@dataclass(frozen=True)
class _Ref:
    """A node argument naming an earlier node."""

    name: str


@dataclass(frozen=True)
class _Op:
    """A torch operator overload by name (the objects themselves do not pickle)."""

    namespace: str
    name: str
    overload: str

    def resolve(self) -> Any:
        return getattr(getattr(getattr(torch.ops, self.namespace), self.name), self.overload)


def _target(target: fx.node.Target) -> fx.node.Target | _Op:
    if isinstance(target, torch._ops.OpOverload):
        return _Op(target.namespace, target._schema.name.split("::")[-1], target._overloadname)
    return target


def graph_nodes(graph: fx.Graph) -> list[NodeRecord]:
    """The graph as picklable records: operators by name, node arguments by node name."""
    def refs(value: fx.node.Argument) -> object:
        return fx.node.map_arg(value, lambda node: _Ref(node.name))  # type: ignore[arg-type, return-value]  # _Ref for a Node

    return [(n.op, n.name, _target(n.target), refs(n.args), refs(n.kwargs)) for n in graph.nodes]


def build_graph(records: list[NodeRecord]) -> fx.Graph:
    """The graph `graph_nodes` recorded."""
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}

    def resolve(value: fx.node.Argument) -> fx.node.Argument:
        return env[value.name] if isinstance(value, _Ref) else value

    for op, name, target, args, kwargs in records:
        target = target.resolve() if isinstance(target, _Op) else target
        env[name] = graph.create_node(op, target, fx.node.map_aggregate(args, resolve),
                                      fx.node.map_aggregate(kwargs, resolve), name)
    return graph


def attribute(module: nn.Module, dotted: str) -> Any:
    """`module.a.b.c` for "a.b.c"."""
    value: Any = module
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


class StageModule(fx.GraphModule):
    """An fx.GraphModule whose pickle holds its nodes and attributes, not its code."""

    def __reduce__(self) -> tuple[Any, ...]:
        attrs = {str(n.target): attribute(self, str(n.target)) for n in self.graph.nodes
                 if n.op in ("get_attr", "call_module")}
        return _rebuild, (attrs, graph_nodes(self.graph), type(self).__name__, self.training)


def _rebuild(attrs: dict[str, object], records: list[NodeRecord], class_name: str,
             training: bool) -> StageModule:
    module = StageModule(attrs, build_graph(records), class_name=class_name)
    module.train(training)
    return module
