"""What a process engine runs, frozen: the stages, where each runs, what crosses between them;
a new input signature, or a launch sharing out the cores, swaps the record as one value."""
from __future__ import annotations

from dataclasses import dataclass

from pipetorch.parallel.comm.messages import Specs
from pipetorch.parallel.host.cross_process import Spread
from pipetorch.parallel.layout.placement import Placement
from pipetorch.parallel.layout.routes import Route
from pipetorch.parallel.layout.ties import Tie
from pipetorch.partition.split import StagedModel

__all__: list[str] = []


@dataclass(frozen=True)
class Pipeline:
    """The input signature in use (`staged`, `routes`, `specs`) on this process's workers."""

    staged: StagedModel
    routes: tuple[Route, ...]
    specs: Specs
    placements: tuple[Placement, ...]  # this process's workers, replica-major
    owners: tuple[int, ...]            # each stage's device: its place among a replica's
    ties: tuple[Tie, ...]              # weights held on several devices
    replicas: int                      # this process's replicas
    spread: Spread | None              # Distributed.stagesAcrossProcesses' devices, else None


class Current:
    """The Pipeline in use (`now`): the parts read it at each use, so one swap reaches all."""

    def __init__(self, now: Pipeline) -> None:
        self.now = now
