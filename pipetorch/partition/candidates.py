"""Candidate cut points for balancing: the user's blocks, else the model's layer containers."""
from __future__ import annotations

from torch import nn

from pipetorch.partition.blocks import begin_blocks

__all__: list[str] = []

_CONTAINERS = (nn.Sequential, nn.ModuleList)


def candidates(model: nn.Module) -> list[str]:
    """Qualified names of the modules a stage may begin at, in definition order.

    With `BeginBlock` annotations these are the user's blocks (balancing decides which share a
    device). Otherwise they are the model's children, with every Sequential or ModuleList (and
    any module holding one, such as an HF encoder or a ResNet stage, and a wrapper's only child
    with weights, such as a model inside a loss wrapper) opened into its children,
    so that BERT gives embeddings, layer.0 .. layer.N-1, pooler and a ResNet gives its blocks.
    """
    marked = list(begin_blocks(model))
    if marked:
        return [name for name in marked if name]
    names = _open(model, "")
    return names if len(names) > 1 else []


def _open(module: nn.Module, prefix: str) -> list[str]:
    out: list[str] = []
    children = list(module.named_children())
    weighted = [c for _, c in children if any(True for _ in c.parameters())]
    for name, child in children:
        qualified = f"{prefix}.{name}" if prefix else name
        only_weights = weighted == [child] and len(list(child.children())) > 1
        if _holds_layers(child) or only_weights:
            out.extend(_open(child, qualified))
        else:
            out.append(qualified)
    return out


def _holds_layers(module: nn.Module) -> bool:
    """A container of several layers, or a module that has one somewhere inside."""
    return any(isinstance(m, _CONTAINERS) and len(m) > 1 for m in module.modules())
