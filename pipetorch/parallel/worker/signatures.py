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
from typing import TYPE_CHECKING, Mapping, Sequence

import torch
import torch.nn as nn

from pipetorch.errors import CompileError
from pipetorch.parallel.comm import messages as m
from pipetorch.parallel.layout.routes import Route
from pipetorch.parallel.comm.payloads import DeviceStage
from pipetorch.partition.split import StagedModel

if TYPE_CHECKING:
    from pipetorch.parallel.host.engine import ProcessEngine

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


Signature = tuple[StagedModel, list[Route], m.Specs]


class Signatures:
    """A process engine's input signatures: the first's stages carry the weights, the others
    go as skeletons; `engine.staged`, `routes` and `specs` are the current one's."""

    def __init__(self, engine: ProcessEngine, first: Signature) -> None:
        self.engine = engine
        self.all: list[Signature] = [first]
        self.current = 0

    def add(self, staged: StagedModel, routes: Sequence[Route], specs: m.Specs) -> int:
        """Send every worker another signature's stages, as graphs bound there to the
        weights it holds (no weights cross); its number for `use`."""
        check_same_stages(self.all[0][0], staged)
        self.all.append((staged, list(routes), specs))
        self.send(len(self.all) - 1)
        return len(self.all) - 1

    def send(self, key: int) -> None:
        staged, routes, specs = self.all[key]
        workers = self.engine.workers
        # no peers once stopped after a failure: the gather below says what happened
        for peer, placement in zip(workers.peers, workers.placements, strict=False):
            stages = tuple(DeviceStage(skeleton(staged.modules[s]), routes[s],
                                       staged.io[s].inputs) for s in placement.stages)
            workers.send(peer, m.AddSignature(key, stages, specs))
        workers.gather("adding an input signature")

    def use(self, key: int) -> None:
        """Run signature `key`'s stages from the next call on (one round trip)."""
        e = self.engine
        e.workers.broadcast(m.Use(key), "a change of input signature")
        self.current = key
        e.staged, e.routes, e.specs = self.all[key]
        e.workers.staged = e.staged

    def relaunched(self) -> None:
        """New workers: every signature again, and the one in use."""
        for key in range(1, len(self.all)):
            self.send(key)
        if self.current:
            self.use(self.current)
