"""Which of a graph module's inputs an op changes in place (ReLU(inplace=True), add_, +=)."""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn as nn

__all__: list[str] = []


def inplace_inputs(module: nn.Module) -> set[int]:
    """Positions of the stage's inputs that an op modifies in place (ReLU(inplace=True), add_)."""
    if not isinstance(module, fx.GraphModule):
        return set()
    mutated = set()
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    for index, node in enumerate(placeholders):
        for user in node.users:
            if user.args and user.args[0] is node and _is_inplace(module, user):
                mutated.add(index)
    return mutated


def _is_inplace(module: fx.GraphModule, node: fx.Node) -> bool:
    if node.kwargs.get("inplace"):
        return True
    if isinstance(node.target, torch._ops.OpOverload):  # an aten op from a torch.export capture
        return any(a.alias_info is not None and a.alias_info.is_write
                   for a in node.target._schema.arguments)
    if node.op == "call_module":
        return bool(getattr(module.get_submodule(str(node.target)), "inplace", False))
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return isinstance(name, str) and name.endswith("_") and not name.startswith("__") or \
        node.target in (operator.iadd, operator.isub, operator.imul, operator.itruediv)


# Ops whose schema does not say they update their running statistics (CompositeImplicit):
# op -> (the argument turning the update on, the statistics it updates).
_RUNNING_STATISTICS = {
    torch.ops.aten.batch_norm.default: ("training", ("running_mean", "running_var")),
    torch.ops.aten.instance_norm.default: ("use_input_stats", ("running_mean", "running_var")),
}


def written_attributes(graph: fx.Graph) -> set[str]:
    """The get_attr targets (buffers) an aten op of a captured graph changes in place: what the
    schema marks written (num_batches_tracked.add_), and batch_norm's running statistics in
    training."""
    written: set[str | None] = set()
    for node in graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        schema = node.target._schema.arguments
        given = arguments(node)
        written.update(_attribute_of(given.get(a.name)) for a in schema
                       if a.alias_info is not None and a.alias_info.is_write)
        switch, statistics = _RUNNING_STATISTICS.get(node.target, (None, ()))
        if given.get(switch) is True:
            written.update(_attribute_of(given.get(name)) for name in statistics)
    written.discard(None)
    return written  # type: ignore[return-value]


def arguments(node: fx.Node) -> dict[str, object]:
    """An aten op node's arguments by their schema's names."""
    names = (a.name for a in node.target._schema.arguments)  # type: ignore[union-attr]
    return {**dict(zip(names, node.args)), **node.kwargs}


def _attribute_of(value: object) -> str | None:
    """The get_attr target `value` reads, directly or through views of it; else None."""
    while isinstance(value, fx.Node):
        if value.op == "get_attr":
            return str(value.target)
        target = value.target
        if not (value.op == "call_function" and isinstance(target, torch._ops.OpOverload)
                and value.args and target._schema.arguments
                and target._schema.arguments[0].alias_info is not None):
            return None
        value = value.args[0]
    return None
