"""Weights tied across devices: a copy on each device using it, stepped on the first one.

GPT-2's lm_head reads wte's weight on the last device while wte runs on the first. As
DeepSpeed's tied layers do, each device's worker holds its own copy of the weight; after the
step's last backward each copy's gradient becomes the sum over the devices holding it (then
over the replicas, as every gradient does). Only the first of those devices steps the weight
and keeps its optimiser state (Adam's two moments would otherwise sit on every device), then
sends the stepped weight to the others, so the copies stay equal:

    device 0: F0 F1 .. B0 B1 | TR (wte.weight with device 1) | AR (replicas) | STEP | send wte
    device 1: F0 F1 .. B0 B1 | TR (wte.weight with device 0) | AR (replicas) | STEP | take wte
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from pipetorch.parallel.comm.rendezvous import Rendezvous
from pipetorch.parallel.comm.transport import PeerLink
from pipetorch.parallel.layout.ties import DeviceSet, Tie, device_sets

__all__: list[str] = []

def new_groups(ties: Sequence[Tie], meeting: Rendezvous
               ) -> dict[tuple[int, DeviceSet], dist.ProcessGroup]:
    """A process group per replica and device set sharing a weight. Collective: every worker
    calls it with the same ties (no ties: no group, no wait)."""
    return {(replica, devices): dist.new_group([meeting.rank(replica, d) for d in devices])
            for replica in range(meeting.replicas) for devices in device_sets(ties)}


class TiedGrads:
    """One worker's copies of the weights tied across devices, grouped by the devices holding
    them, each group with its process group (within the worker's replica)."""

    def __init__(self, ties: Sequence[Tie], modules: dict[int, nn.Module], *, device: int,
                 groups: dict[DeviceSet, dist.ProcessGroup]) -> None:
        self.device = device
        self.sets: list[tuple[DeviceSet, dist.ProcessGroup, list[nn.Parameter]]] = []
        for devices in device_sets(ties):
            if device in devices:
                params = [_local(t, modules) for t in ties if t.devices == devices]
                self.sets.append((devices, groups[devices], params))

    def __bool__(self) -> bool:
        return bool(self.sets)

    def copies(self) -> set[int]:
        """id() of this worker's copies of tied weights."""
        return {id(p) for _, _, params in self.sets for p in params}

    def followers(self) -> frozenset[int]:
        """id() of the copies this worker holds but does not step: the stepping device's
        copy is the one the host takes."""
        return frozenset(id(p) for devices, _, params in self.sets
                         if devices[0] != self.device for p in params)

    @torch.no_grad()
    def sum(self, link: PeerLink) -> None:
        """Each copy's gradient becomes the sum over the devices holding the weight, for the
        first of them to step (the others drop theirs: they do not step it). A copy its device
        did not use this step adds zeros (every holder must join the collective); one no device
        used keeps no gradient, as in plain PyTorch."""
        for devices, group, params in self.sets:  # in the same order on every device
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            used = [torch.full((1,), float(p.grad is not None), dtype=g.dtype, device=g.device)
                    for p, g in zip(params, grads, strict=True)]
            link.all_reduce([*grads, *used], group=group,
                            who=f"the workers of devices {', '.join(map(str, devices))}")
            steps = devices[0] == self.device
            for param, grad, flag in zip(params, grads, used, strict=True):
                param.grad = grad if steps and flag.item() > 0 else None

    @torch.no_grad()
    def share_updates(self, link: PeerLink) -> None:
        """After the step: every copy takes the first device's stepped weight (a sum to which
        the other devices add zeros, so it is that weight exactly)."""
        for devices, group, params in self.sets:
            values = [p.detach() if devices[0] == self.device else p.detach().zero_()
                      for p in params]
            link.all_reduce(values, group=group,
                            who=f"the workers of devices {', '.join(map(str, devices))}")


def _local(tie: Tie, modules: dict[int, nn.Module]) -> nn.Parameter:
    """This worker's copy of `tie` (stages of one device share it: the first one found)."""
    stage, name = next((s, n) for s, n in tie.held if s in modules)
    return modules[stage].get_parameter(name)
