"""What compiling decided, frozen: the stages, and the engine that runs them, where and how."""
from __future__ import annotations

from dataclasses import dataclass

from pipetorch.parallel.layout.placement import Placement
from pipetorch.parallel.layout.routes import Constant, Route, TensorSpec
from pipetorch.partition.split import Source, StagedModel
from pipetorch.partition.strategies import StageSpec
from pipetorch.schedule.device_plans import peak_stash

__all__: list[str] = []

LOCAL = "local"
"""The schedule of the engine running every stage in this process, one after another."""


@dataclass(frozen=True)
class StageGraphs:
    """One input signature's stages as stage workers run them: the stage modules, the routes
    of their values and the specs of the values crossing stages."""

    staged: StagedModel
    routes: tuple[Route, ...]
    specs: dict[Source, TensorSpec | Constant]


@dataclass(frozen=True)
class CompilePlan:
    """The stages, the logical devices the run needs (devices per replica x replicas, rounded)
    and the engine: `schedule` LOCAL, or the plan kind stage workers run
    (`schedule.device_plans.engine_kind`) with one placement per worker, replica-major, and the
    stages' graphs for the first input signature."""

    stages: tuple[StageSpec, ...]
    devices: int
    schedule: str = LOCAL
    placements: tuple[Placement, ...] = ()
    graphs: StageGraphs | None = None

    @property
    def local(self) -> bool:
        """Whether every stage runs in this process (`parallel.host.local.LocalEngine`)."""
        return self.schedule == LOCAL

    @property
    def owners(self) -> tuple[int, ...]:
        """Each stage's device: its worker's place among a replica's workers (the one device
        of this process for every stage, when local)."""
        if self.local:
            return (0,) * len(self.stages)
        return tuple(next(d for d, p in enumerate(self.placements) if s in p.stages)
                     for s in range(len(self.stages)))

    def in_flight(self, micro_batches: int, *, training: bool,
                  schedule: str | None = None) -> tuple[int, ...]:
        """Most micro-batches each lane holds for backward at once over a plan of
        `micro_batches` (`schedule.device_plans.peak_stash`): each stage in its worker, running
        `schedule` (pipelineSchedule('auto') changes the engine's) or else the plan's; the
        one lane of this process, which runs each micro-batch's forward and backward in turn
        as one sharded stage."""
        if self.local:
            return peak_stash("sharded", 1, micro_batches, training=training)
        return peak_stash(schedule or self.schedule, len(self.stages), micro_batches,
                          self.owners, training=training)
