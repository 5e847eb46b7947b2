"""Global-norm gradient clipping computed bucket by bucket, with torch's numbers.

A 16-bit step holds float32 copies of one bucket of gradients at a time (see
`swap_buckets`), but clipping needs the norm of all of them first. So the norm is summed
from per-tensor terms gathered bucket after bucket (`terms`), combined once
(`coefficient`), and each bucket is then scaled (`scale`). Locally the terms are the
per-tensor norms `torch.nn.utils.clip_grad_norm_` computes, combined in its order, so the
numbers are its numbers bit for bit; on a stage worker they are squared norms summed over
every peer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype, _has_foreach_support

from pipetorch.optim import peers

__all__: list[str] = []

_NORM = 2.0


@dataclass
class Terms:
    """The per-tensor parts of the norm gathered so far, each under its (device, dtype): a
    tensor's norm locally, its weighted squared norm on a stage worker (`across` its peers)."""

    across: peers.Peers | None
    parts: list[tuple[tuple[torch.device, torch.dtype], torch.Tensor]] = field(
        default_factory=list)

    def add(self, grads: Sequence[torch.Tensor], weight: float = 1.0) -> None:
        """Add the terms of `grads` (the gradients the update sees; a weight tied across
        devices is stepped, so counted, on its first device only), each `weight` times on a
        stage worker (a slice of a sharded weight, see `peers.Peers.weight`)."""
        if self.across is not None:
            self.parts.extend(((g.device, g.dtype), g.detach().float().pow(2).sum() * weight)
                              for g in grads)
            return
        for (device, dtype), tensors in _grouped(grads).items():
            if _has_foreach_support(tensors, device):
                norms = list(torch._foreach_norm(tensors, _NORM))
            else:
                norms = [torch.linalg.vector_norm(g, _NORM) for g in tensors]
            self.parts.extend(((device, dtype), norm) for norm in norms)

    def coefficient(self, max_norm: float) -> torch.Tensor:
        """The factor every gradient is multiplied by: min(1, max_norm / (norm + 1e-6))."""
        if self.across is not None:
            local = torch.stack([t for _, t in self.parts]).sum() if self.parts else torch.zeros(())
            total = self.across.reduce(local).sqrt()
            return (max_norm / (total + 1e-6)).clamp(max=1.0)
        if not self.parts:
            return torch.tensor(1.0)
        # torch stacks the norms grouped by (device, dtype) in order of first appearance.
        order = list(dict.fromkeys(key for key, _ in self.parts))
        ranked = sorted(range(len(self.parts)), key=lambda i: order.index(self.parts[i][0]))
        first_device = self.parts[0][0][0]
        total = torch.linalg.vector_norm(
            torch.stack([self.parts[i][1].to(first_device) for i in ranked]), _NORM)
        return torch.clamp(max_norm / (total + 1e-6), max=1.0)


def _grouped(grads: Sequence[torch.Tensor]
             ) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    """`grads` by (device, dtype) as torch's clipping groups them (torch's result allows
    None entries; `grads` has none)."""
    grouped = _group_tensors_by_device_and_dtype([list(grads)])
    return {key: [g for g in tensors if g is not None] for key, ([tensors], _) in grouped.items()}


def scale(grads: Sequence[torch.Tensor], coefficient: torch.Tensor, *, local: bool) -> None:
    """Multiply `grads` in place by `coefficient`, as torch's clipping (`local`) or a stage
    worker's does."""
    if not local:
        for grad in grads:
            grad.mul_(coefficient.to(grad.dtype))
        return
    for (device, _), tensors in _grouped(grads).items():
        if _has_foreach_support(tensors, device):
            torch._foreach_mul_(tensors, coefficient.to(device))
        else:
            on_device = coefficient.to(device)
            for grad in tensors:
                grad.mul_(on_device)
