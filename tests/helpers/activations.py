"""Bytes autograd keeps for backward: how the recomputation tests see what checkpointing saves."""
from __future__ import annotations

import itertools

import torch
from torch import nn

from pipetorch import ops
from pipetorch.partition.probe import preserved


def saved_activation_bytes(module: nn.Module, args: tuple, *, training: bool = True) -> int:
    """Bytes autograd keeps for backward during one forward of `module(*args)`.

    Counts each storage a saved tensor lives in once, leaving out the module's parameters and
    buffers (model state, resident anyway). The forward runs with gradients on, `module` in
    train (`training=True`) or eval mode; its modes, buffers and the RNG are restored after.
    """
    state = {_storage_key(t) for t in itertools.chain(module.parameters(), module.buffers())}
    kept: dict[tuple[torch.device, int], int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = _storage_key(tensor)
        if key not in state:
            kept[key] = tensor.untyped_storage().nbytes()
        return tensor

    modes = [(m, m.training) for m in module.modules()]
    try:
        module.train(training)
        with preserved(module), torch.enable_grad(), ops.running_on_device(), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            module(*args)
    finally:
        for submodule, mode in modes:  # parents first: each call fixes its own subtree
            submodule.train(mode)
    return sum(kept.values())


def _storage_key(tensor: torch.Tensor) -> tuple[torch.device, int]:
    return tensor.device, tensor.untyped_storage().data_ptr()
