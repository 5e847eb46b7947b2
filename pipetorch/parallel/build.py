"""From a probed model to running device workers: split, route, measure shapes, place, start."""
from __future__ import annotations

import dataclasses
import logging

import torch
import torch.nn as nn

from pipetorch.parallel import mapped, pool
from pipetorch.parallel.engine import ProcessEngine
from pipetorch.parallel.placement import place
from pipetorch.parallel.routes import Route, routes_of, value_specs
from pipetorch.partition.split import CaptureOnce, StagedModel
from pipetorch.partition.strategies import StageSpec
from pipetorch.partition.probe import preserved
from pipetorch.parallel.compiled import CompiledStage
from pipetorch.parallel.recompute import stage_module
from pipetorch.parallel.local import Batching
from pipetorch.schedule.devices import engine_kind

__all__: list[str] = []

logger = logging.getLogger(__name__)


def process_engine(model: nn.Module, first: tuple[tuple, dict], stages: list[StageSpec], *,
                   batching: Batching, optimizer: torch.optim.Optimizer | None, pipelined: bool,
                   training: bool, recomputation: bool,
                   process: tuple[int, int] = (0, 1), seed: int | None = None,
                   capture: CaptureOnce | None = None,
                   compile_backend: str | None = None,
                   loss_index: int | None = None,
                   pipeline_schedule: str = "1f1b",
                   writer: mapped.Writer | None = None) -> ProcessEngine:
    """Split `model` (the host copy, on the CPU) into `stages` and start one worker per logical
    device and replica, running the stages on that device. `process` is (this process's id,
    the number of host processes);
    `recomputation` checkpoints every stage's activations (Training.setRecomputation).

    `first` is one micro-batch, used to learn the shapes of the values crossing stages;
    `capture` is the compilation's capture of forward and what is derived from it
    (captured here when None);
    `compile_backend` runs every stage through torch.compile with that backend;
    `loss_index` is the loss's position among forward's tensor outputs (training);
    `pipeline_schedule` is Training.pipelineSchedule ("1f1b", "zero_bubble", "interleaved",
    "interleaved_zero_bubble" or "auto");
    `writer` takes copies to the host of a mapped model's weights (runtime.weight_files).
    """
    pool.prestart()  # the workers' zygote imports torch while this process splits the model
    staged, routes, specs = stage_graphs(
        model, first, stages, training=training, recomputation=recomputation,
        capture=capture, compile_backend=compile_backend, loss_index=loss_index)
    return ProcessEngine(model, staged, routes, specs, batching=batching, optimizer=optimizer,
                         schedule=engine_kind(pipelined, pipeline_schedule),
                         placements=place(stages, replicas=batching.replication_factor),
                         process=process, seed=seed, writer=writer)


def stage_graphs(model: nn.Module, first: tuple[tuple, dict], stages: list[StageSpec], *,
                 training: bool, recomputation: bool, capture: CaptureOnce | None = None,
                 compile_backend: str | None = None, loss_index: int | None = None
                 ) -> tuple[StagedModel, list[Route], dict]:
    """`model` split into `stages` for the input signature of `first` (one micro-batch): the
    stage modules as workers run them, their routes, and the specs of the values crossing
    stages (see `process_engine` for the arguments)."""
    args, kwargs = first
    capture = capture if capture is not None else CaptureOnce(model, first)
    staged = capture.split(stages)
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
    return staged, routes, specs


