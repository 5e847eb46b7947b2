"""Stage modules that pickle their graph node by node, so workers run exactly that graph.

A plain fx.GraphModule pickles its generated Python code and re-traces it when unpickled.
Re-tracing runs, eagerly and once, every op whose arguments hold no traced value (an
in-place update of a buffer, such as BatchNorm's `num_batches_tracked += 1` in a torch.export
graph) and drops it from the graph: the worker's copy would never update that buffer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

__all__: list[str] = []


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


def _target(target: Any) -> Any:
    if isinstance(target, torch._ops.OpOverload):
        return _Op(target.namespace, target._schema.name.split("::")[-1], target._overloadname)
    return target


class StageModule(fx.GraphModule):
    """An fx.GraphModule whose pickle holds its nodes and attributes, not its code."""

    def __reduce__(self) -> tuple[Any, ...]:  # type: ignore[override]
        attrs = {str(n.target): _attr(self, str(n.target)) for n in self.graph.nodes
                 if n.op in ("get_attr", "call_module")}
        nodes = [(n.op, n.name, _target(n.target), _refs(n.args), _refs(n.kwargs))
                 for n in self.graph.nodes]
        return _rebuild, (attrs, nodes, type(self).__name__, self.training)


def _attr(module: nn.Module, dotted: str) -> Any:
    value: Any = module
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def _refs(value: Any) -> Any:
    return fx.node.map_arg(value, lambda node: _Ref(node.name))


def _rebuild(attrs: dict[str, Any], nodes: list[tuple], class_name: str,
             training: bool) -> StageModule:
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}

    def resolve(value: Any) -> Any:
        if isinstance(value, _Ref):
            return env[value.name]
        if isinstance(value, (tuple, list)):
            return type(value)(resolve(v) for v in value)
        if isinstance(value, dict):
            return {k: resolve(v) for k, v in value.items()}
        if isinstance(value, slice):
            return slice(resolve(value.start), resolve(value.stop), resolve(value.step))
        return value

    for op, name, target, args, kwargs in nodes:
        target = target.resolve() if isinstance(target, _Op) else target
        node = graph.create_node(op, target, resolve(args), resolve(kwargs), name)
        env[name] = node
    module = StageModule(attrs, graph, class_name=class_name)
    module.train(training)
    return module
