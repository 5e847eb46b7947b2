"""From stages to the plan an engine starts from: place, split, route, measure shapes."""
from __future__ import annotations

import dataclasses
import logging
from typing import Sequence

import torch.nn as nn

from pipetorch.parallel.host import pool
from pipetorch.parallel.layout.compile_plan import CompilePlan, StageGraphs
from pipetorch.parallel.layout.placement import place
from pipetorch.parallel.layout.routes import routes_of, value_specs
from pipetorch.partition.split import CaptureOnce
from pipetorch.partition.strategies import StageSpec
from pipetorch.partition.probe import preserved
from pipetorch.parallel.worker.compiled import CompiledStage
from pipetorch.parallel.worker.recompute import stage_module
from pipetorch.schedule.device_plans import engine_kind

__all__: list[str] = []

logger = logging.getLogger(__name__)


def plan_stages(model: nn.Module, first: tuple[tuple, dict], stages: Sequence[StageSpec], *,
                devices: int, in_processes: bool, replicas: int, pipelined: bool,
                pipeline_schedule: str, training: bool, recomputation: bool,
                capture: CaptureOnce | None = None, compile_backend: str | None = None,
                loss_index: int | None = None) -> CompilePlan:
    """The plan running `stages` on `devices` logical devices: in this process unless
    `in_processes`; else one worker per logical device and each of `replicas` replicas
    (`placement.place`), running the plan kind of `pipelined` and `pipeline_schedule`
    (Training.pipelineSchedule: "1f1b", "zero_bubble", "interleaved",
    "interleaved_zero_bubble" or "auto") on the stages' graphs (`stage_graphs`)."""
    stages = tuple(stages)
    if not in_processes:
        return CompilePlan(stages, devices)
    pool.prestart()  # the workers' zygote imports torch while this process splits the model
    graphs = stage_graphs(model, first, stages, training=training, recomputation=recomputation,
                          capture=capture, compile_backend=compile_backend,
                          loss_index=loss_index)
    return CompilePlan(stages, devices, engine_kind(pipelined, pipeline_schedule),
                       tuple(place(stages, replicas=replicas)), graphs)


def stage_graphs(model: nn.Module, first: tuple[tuple, dict], stages: Sequence[StageSpec], *,
                 training: bool, recomputation: bool, capture: CaptureOnce | None = None,
                 compile_backend: str | None = None, loss_index: int | None = None
                 ) -> StageGraphs:
    """`model` (the host copy, on the CPU) split into `stages` for the input signature of
    `first` (one micro-batch, whose shapes the values crossing stages take): the stage modules
    as workers run them, their routes, and the specs of the values crossing stages.

    `capture` is the compilation's capture of forward and what is derived from it (captured
    here when None); `recomputation` checkpoints every stage's activations
    (Training.setRecomputation); `compile_backend` runs every stage through torch.compile with
    that backend; `loss_index` is the loss's position among forward's tensor outputs
    (training)."""
    args, kwargs = first
    capture = capture if capture is not None else CaptureOnce(model, first)
    staged = capture.split(list(stages))
    routes = routes_of(staged, loss_index=loss_index if training else None)

    def specs_of() -> dict:
        with preserved(model):
            return value_specs(staged, args, kwargs, training=training)

    specs = capture.remember(("value specs", tuple(stages), training), specs_of)
    if training:  # recomputationCheckpoint segments, or the whole stage with `recomputation`
        staged = dataclasses.replace(
            staged, modules=[stage_module(m, checkpoint=recomputation) for m in staged.modules])
    if compile_backend is not None:
        staged = dataclasses.replace(
            staged, modules=[CompiledStage(m, compile_backend) for m in staged.modules])
    return StageGraphs(staged, tuple(routes), specs)
