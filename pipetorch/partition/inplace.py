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
    training; also inside the subgraphs higher-order ops call (a `with torch.no_grad():`
    block's `buf += x` is one in torch.export's graph)."""
    return {str(node.target) for node in _written_roots(graph) if node.op == "get_attr"}


def _written_roots(graph: fx.Graph) -> set[fx.Node]:
    """The get_attr and placeholder nodes whose tensors `graph` changes in place."""
    written: set[fx.Node | None] = set()
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if not isinstance(node.target, torch._ops.OpOverload):
            written.update(_written_by_subgraph(graph, node))
            continue
        schema = node.target._schema.arguments
        given = arguments(node)
        written.update(_root(given.get(a.name)) for a in schema
                       if a.alias_info is not None and a.alias_info.is_write)
        switch, statistics = _RUNNING_STATISTICS.get(node.target, (None, ()))
        if switch is not None and given.get(switch) is True:
            written.update(_root(given.get(name)) for name in statistics)
    return {node for node in written if node is not None}


def _written_by_subgraph(graph: fx.Graph, node: fx.Node) -> set[fx.Node | None]:
    """What a higher-order op (wrap_with_set_grad_enabled(False, body, *args), ...) changes:
    the arguments passed after its body that the body writes to."""
    owner = graph.owning_module
    for index, arg in enumerate(node.args):
        if isinstance(arg, fx.Node) and arg.op == "get_attr" and owner is not None:
            body = getattr(owner, str(arg.target), None)
            if isinstance(body, fx.GraphModule):
                passed = node.args[index + 1:]
                inputs = [n for n in body.graph.nodes if n.op == "placeholder"]
                return {_root(passed[inputs.index(n)]) for n in _written_roots(body.graph)
                        if n in inputs and inputs.index(n) < len(passed)}
    return set()


def arguments(node: fx.Node) -> dict[str, fx.node.Argument]:
    """An aten op node's arguments by their schema's names."""
    assert isinstance(node.target, torch._ops.OpOverload)
    names = (a.name for a in node.target._schema.arguments)
    return {**dict(zip(names, node.args, strict=False)), **node.kwargs}


def _root(value: fx.node.Argument) -> fx.Node | None:
    """The get_attr or placeholder node `value` is, directly or through views of it."""
    while isinstance(value, fx.Node):
        if value.op in ("get_attr", "placeholder"):
            return value
        target = value.target
        if not (value.op == "call_function" and isinstance(target, torch._ops.OpOverload)
                and value.args and target._schema.arguments
                and target._schema.arguments[0].alias_info is not None):
            return None
        value = value.args[0]
    return None
