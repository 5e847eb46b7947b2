"""What a compiled model runs, as the reports show it: its lanes (a stage on its device worker,
or this process) and each stage's module."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch
import torch.nn as nn

from pipetorch.parallel.layout.compile_plan import CompilePlan

if TYPE_CHECKING:
    from pipetorch.partition.split import StagedModel
    from pipetorch.profiling.compiled import Compiled

__all__: list[str] = []


@dataclass(frozen=True)
class Lane:
    """One lane of the report: a stage on its device worker, or this process (local engine)."""

    stage: int | None  # None: every stage, run in this process
    ipu: int
    device: str
    threads: int

    @property
    def label(self) -> str:
        where = "all stages" if self.stage is None else f"stage {self.stage}"
        return f"IPU {self.ipu} · {where} · {self.device}"


@runtime_checkable
class InWorkers(Protocol):
    """An engine running its stages in worker processes (ProcessEngine): the stages in use."""

    staged: StagedModel


def lanes_of(compiled: Compiled) -> list[Lane]:
    """The lanes of `compiled`'s plan: one per stage (on its device worker), or a single one
    for the local engine."""
    plan: CompilePlan = compiled.plan
    if plan.local:
        device = getattr(compiled.engine, "input_device", torch.device("cpu"))
        return [Lane(None, plan.stages[0].ipu_id if plan.stages else 0, str(device),
                     torch.get_num_threads())]
    placed = sorted(((s, p) for p in plan.placements if p.replica == 0 for s in p.stages),
                    key=lambda sp: sp[0])
    return [Lane(s, p.ipu, p.device, p.threads) for s, p in placed]


def stage_modules(compiled: Compiled) -> list[nn.Module] | None:
    """Each stage's module (owning its parameters), or None when the stages share one model."""
    engine, plan = compiled.engine, compiled.plan
    if not plan.local:
        assert isinstance(engine, InWorkers)
        return list(engine.staged.modules)
    return [engine.model] if len(plan.stages) == 1 else None
