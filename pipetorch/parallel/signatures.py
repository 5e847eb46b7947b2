"""Several input signatures on one set of workers: a signature's stage graphs travel without
weights and are bound, in the worker, to the weights its first signature's stages hold.

    host                                        worker of device d
    signature 0: Setup(stages with weights) --> modules[s] (the weights), optimiser over them
    signature 1: stages as graphs, weights  --> bind: graph 1's parameters and buffers ARE
                 on the meta device               modules[s]'s; its own executor and link
    ("use", 1) before a call of signature 1 --> runs graph 1 on the same weights and state

So every signature trains the one set of weights and optimiser state (Options.inputSignatures).
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

from pipetorch.errors import CompileError
from pipetorch.partition.split import StagedModel

__all__: list[str] = []


def skeleton(module: nn.Module) -> nn.Module:
    """A copy of `module` (a stage: its graph and constants) whose parameters and buffers
    are meta tensors of the same shapes: what crosses to a worker that holds the weights."""
    memo: dict[int, torch.Tensor] = {}
    for _, p in module.named_parameters(remove_duplicate=False):
        memo.setdefault(id(p), nn.Parameter(torch.empty_like(p, device="meta"),
                                            requires_grad=p.requires_grad))
    for _, b in module.named_buffers(remove_duplicate=False):
        memo.setdefault(id(b), torch.empty_like(b, device="meta"))
    return copy.deepcopy(module, memo)  # type: ignore[arg-type]


def bind(module: nn.Module, holder: nn.Module) -> nn.Module:
    """`module` (a skeleton) with every parameter and buffer replaced by `holder`'s tensor of
    the same name: the two modules then share their weights (no copy)."""
    for kind, registry, mine, held in (
            ("parameter", "_parameters", list(module.named_parameters(remove_duplicate=False)),
             dict(holder.named_parameters(remove_duplicate=False))),
            ("buffer", "_buffers", list(module.named_buffers(remove_duplicate=False)),
             dict(holder.named_buffers(remove_duplicate=False)))):
        for name, _ in mine:
            if name not in held:
                raise CompileError(f"The stage graph of a new input signature uses {kind} "
                                   f"{name!r}, which its worker does not hold")
            owner, _, attr = name.rpartition(".")
            getattr(module.get_submodule(owner), registry)[attr] = held[name]
    return module


def check_same_stages(first: StagedModel, new: StagedModel) -> None:
    """CompileError unless `new` (a new signature's split) puts every weight in the stages
    `first` put it in: a worker can only run graphs over the weights it holds."""
    if len(new.modules) != len(first.modules) or new.owners != first.owners:
        moved = sorted(n for n in set(first.owners) | set(new.owners)
                       if first.owners.get(n) != new.owners.get(n))
        raise CompileError(
            f"A new input signature splits the model differently ({len(new.modules)} stages "
            f"where the first signature has {len(first.modules)}; weights in other stages: "
            f"{moved[:4]}): its stages cannot run on the first signature's workers. Make the "
            "blocks independent of the input's shape, or build a wrapper per signature")
