"""A stage graph without its weights, and in the worker bound to the weights it holds: how a
new input signature's stages, and generate()'s model, cross to a worker (no weights cross)."""
from __future__ import annotations

import copy
from typing import Mapping

import torch
import torch.nn as nn

from pipetorch.errors import CompileError

__all__: list[str] = []


def skeleton(module: nn.Module, *, buffers: bool = True) -> nn.Module:
    """A copy of `module` (its graph or code and constants) whose parameters, and with
    `buffers` its buffers, are meta tensors of the same shapes: what crosses to a worker
    that holds the weights."""
    memo: dict[int, torch.Tensor] = {}
    for _, p in module.named_parameters(remove_duplicate=False):
        memo.setdefault(id(p), nn.Parameter(torch.empty_like(p, device="meta"),
                                            requires_grad=p.requires_grad))
    for _, b in module.named_buffers(remove_duplicate=False) if buffers else ():
        memo.setdefault(id(b), torch.empty_like(b, device="meta"))
    return copy.deepcopy(module, memo)


def tensors_of(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of `module` under each of its names: what `bind` takes."""
    return dict([*module.named_parameters(remove_duplicate=False),
                 *module.named_buffers(remove_duplicate=False)])


def bind(module: nn.Module, held: Mapping[str, torch.Tensor], *,
         first: Mapping[str, str] | None = None, device: torch.device | None = None
         ) -> nn.Module:
    """`module` (a skeleton) with every parameter and buffer replaced by the tensor of `held`
    under its name (for a weight with several names, under its `first` name): the two then
    share their weights (no copy). Without `device` a tensor not held is refused; with it,
    a tensor not held (a buffer the skeleton kept) moves to `device`."""
    first = first or {}
    for prefix, owner in module.named_modules(remove_duplicate=False):
        for kind, registry in (("parameter", owner._parameters), ("buffer", owner._buffers)):
            for name, value in registry.items():
                full = f"{prefix}.{name}" if prefix else name
                tensor = held.get(first.get(full, full))
                if tensor is not None:
                    registry[name] = tensor
                elif value is None or value.device.type == "meta" and device is not None:
                    continue
                elif device is None:
                    raise CompileError(f"The stage graph of a new input signature uses {kind} "
                                       f"{full!r}, which its worker does not hold")
                else:
                    registry[name] = value.to(device)
    return module
