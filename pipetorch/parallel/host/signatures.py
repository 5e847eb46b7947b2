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

import dataclasses
from typing import Sequence

from pipetorch.errors import CompileError
from pipetorch.parallel.comm import messages as m
from pipetorch.parallel.comm.payloads import DeviceStage
from pipetorch.parallel.host.pipeline import Current
from pipetorch.parallel.host.workers import WorkerSet
from pipetorch.parallel.layout.routes import Route
from pipetorch.parallel.worker.skeletons import skeleton
from pipetorch.partition.split import StagedModel

__all__: list[str] = []


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
    """The input signatures of `pipeline`'s workers: the first's stages carry the weights, the
    others go as skeletons; `pipeline.now` holds the current one's."""

    def __init__(self, pipeline: Current, workers: WorkerSet) -> None:
        self.pipeline, self.workers = pipeline, workers
        now = pipeline.now
        self.all: list[Signature] = [(now.staged, list(now.routes), now.specs)]
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
        workers = self.workers
        # no peers once stopped after a failure: the gather below says what happened
        for peer, placement in zip(workers.peers, self.pipeline.now.placements, strict=False):
            stages = tuple(DeviceStage(skeleton(staged.modules[s]), routes[s],
                                       staged.io[s].inputs) for s in placement.stages)
            workers.send(peer, m.AddSignature(key, stages, specs))
        workers.gather("adding an input signature")

    def use(self, key: int) -> None:
        """Run signature `key`'s stages from the next call on (one round trip)."""
        self.workers.broadcast(m.Use(key), "a change of input signature")
        self.current = key
        staged, routes, specs = self.all[key]
        self.pipeline.now = dataclasses.replace(self.pipeline.now, staged=staged,
                                                routes=tuple(routes), specs=specs)

    def relaunched(self) -> None:
        """New workers: every signature again, and the one in use."""
        for key in range(1, len(self.all)):
            self.send(key)
        if self.current:
            self.use(self.current)
