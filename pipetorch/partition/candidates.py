"""Candidate cut points for balancing: the user's blocks, else the model's layer containers."""
from __future__ import annotations

import torch
from torch import nn

from pipetorch.partition.blocks import begin_blocks, recording

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


def ordered_candidates(model: nn.Module, args: tuple,
                       kwargs: dict[str, object]) -> tuple[list[str], bool]:
    """The candidates in the order one forward on `args` first reaches them, and whether they
    are block ids rather than module names.

    When forward opens `Block` scopes (`with Block`, `Block.start`, `BlockFunction`), the
    candidates are all the blocks it enters, BeginBlock modules' blocks included: a placement
    of blocks is a grouping of block ids into stages. Otherwise they are `candidates(model)`,
    those never called dropped.
    """
    names = candidates(model)
    modules = dict(model.named_modules())
    order: list[str] = []
    handles = [modules[n].register_forward_pre_hook(
        lambda m, a, n=n: order.append(n) if n not in order else None) for n in names]
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]), recording() as recorder:
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    marked = {user_id for user_id, _ in begin_blocks(model).values()}
    blocks = [b.user_id for b in recorder.ordered()]
    if any(b not in marked for b in blocks):
        return blocks, True
    if not order:
        raise ValueError(
            f"{type(model).__name__} has no candidate cut points: balancing needs blocks "
            "(BeginBlock, Block scopes) or children in an nn.Sequential / nn.ModuleList")
    return order, False


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
