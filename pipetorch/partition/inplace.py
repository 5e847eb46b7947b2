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
