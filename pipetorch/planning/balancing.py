"""Automatic stage balancing: profile the candidate segments, plan, and place the stages."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Sequence

import torch
from torch import nn

from pipetorch.partition.balance import Placement, plan
from pipetorch.partition.blocks import BeginBlock, removeBlocks
from pipetorch.partition.candidates import ordered_candidates
from pipetorch.partition.probe import preserved
from pipetorch.partition.strategies import ExecutionStrategy
from pipetorch.planning.costs import cost_table
from pipetorch.schedule.device_plans import engine_kind

if TYPE_CHECKING:
    from pipetorch.options.options import Options

__all__ = ["balance"]

logger = logging.getLogger(__name__)


def balance(model: nn.Module, *sample_inputs: object, devices: int,
            sample_kwargs: dict[str, object] | None = None,
            memory_budget: int | Sequence[int] | None = None, repeats: int = 5,
            optimizer_slots: int = 2, threads: int | None = None,
            link_bytes_per_s: float | None = None, apply: bool = True,
            options: Options | None = None) -> Placement:
    """Split `model` over `devices` pipeline stages by measured time and memory.

    `sample_inputs` (and `sample_kwargs`, for models called by keyword) is one micro-batch.
    Each candidate segment (the user's blocks, else the model's layers) is profiled here for
    forward+backward time, activations and parameter + optimiser bytes; the plan minimises the
    slowest stage, transfers included, under `memory_budget` bytes per device. Raises
    `OutOfMemoryError` when nothing fits.

    With `apply` (default) the placement is written on the model as `BeginBlock(..., ipu_id=d)`
    annotations, replacing any there, so that `poptorch.trainingModel(model, opts)` runs it.
    When forward opens `Block` scopes (`with Block`, `Block.start`, `BlockFunction`), the
    candidates are all its blocks and the placement groups them into stages: it is set as
    `options`' execution strategy (`placement.strategy()`, printed by `strategy_lines()`).
    """
    kwargs = sample_kwargs or {}
    names, scopes = _ordered(model, sample_inputs, kwargs)
    if scopes and apply and options is None:
        raise ValueError(
            f"{type(model).__name__}'s blocks are Block scopes {names}: their placement is an "
            "execution strategy, not BeginBlock annotations; pass options=opts to set it there, "
            "or apply=False and opts.setExecutionStrategy(placement.strategy())")
    schedule, micro_batches = _schedule_of(options)
    placement = _plan(model, names, sample_inputs, kwargs, devices=devices, scopes=scopes,
                      memory_budget=memory_budget, repeats=repeats, threads=threads,
                      optimizer_slots=optimizer_slots, link_bytes_per_s=link_bytes_per_s,
                      schedule=schedule, micro_batches=micro_batches)
    if apply and scopes:
        assert options is not None
        options.setExecutionStrategy(placement.strategy(type(options.execution_strategy)))
    elif apply:
        apply_placement(model, placement)
    return placement


def balanced_strategy(model: nn.Module, args: tuple, kwargs: dict[str, object], *,
                      devices: int, strategy: ExecutionStrategy,
                      memory_budget: int | None = None, schedule: str = "pipelined",
                      micro_batches: int | None = None) -> ExecutionStrategy:
    """opts.autoBalance inside compile: balance `model`, and the strategy to run it with.

    A model with BeginBlock modules or none gets BeginBlock annotations and keeps `strategy`;
    a model with Block scopes keeps its scopes and gets `strategy`'s kind over the new stages.
    """
    names, scopes = _ordered(model, args, kwargs)
    placement = _plan(model, names, args, kwargs, devices=devices, scopes=scopes,
                      memory_budget=memory_budget, schedule=schedule,
                      micro_batches=micro_batches)
    if scopes:
        return placement.strategy(type(strategy))
    apply_placement(model, placement)
    return strategy


def apply_placement(model: nn.Module, placement: Placement) -> nn.Module:
    """Replace the model's BeginBlock annotations with one per stage of `placement`."""
    removeBlocks(model)
    modules = dict(model.named_modules())
    for stage in placement.stages:
        BeginBlock(modules[stage.segments[0]], f"stage{stage.device}", ipu_id=stage.device)
    return model


def _schedule_of(options: Options | None) -> tuple[str, int | None]:
    """The plan kind and G that `options` train with, for the activations in flight; without
    options (or with G unset: 1 cannot train pipelined) 1F1B over the smallest G it allows."""
    if options is None:
        return "pipelined", None
    training = options.Training
    kind = engine_kind(options.execution_strategy.pipelined, training.pipeline_schedule)
    return kind, training.gradient_accumulation if training.gradient_accumulation > 1 else None


def _ordered(model: nn.Module, args: tuple,
             kwargs: dict[str, object]) -> tuple[list[str], bool]:
    """The candidates in execution order, and whether they are block ids; the forward that
    finds them must not change the model (BatchNorm statistics)."""
    with preserved(model):
        return ordered_candidates(model, args, kwargs)


def _plan(model: nn.Module, names: list[str], args: tuple, kwargs: dict[str, object], *,
          devices: int, scopes: bool, memory_budget: int | Sequence[int] | None,
          repeats: int = 5, threads: int | None = None, optimizer_slots: int = 2,
          link_bytes_per_s: float | None = None, schedule: str = "pipelined",
          micro_batches: int | None = None) -> Placement:
    """Profile the candidates and plan; the profiling steps leave the model as it was."""
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        # Profiling steps must not change the model: restore buffers (BatchNorm statistics)
        # and the random state (dropout) they consume.
        with preserved(model):
            table = cost_table(model, names, args, kwargs, repeats=repeats,
                               optimizer_slots=optimizer_slots,
                               link_bytes_per_s=link_bytes_per_s, scopes=scopes)
    finally:
        torch.set_num_threads(previous)
    placement = plan(table, devices, budgets=memory_budget, schedule=schedule,
                     micro_batches=micro_batches)
    lines = placement.strategy_lines() if scopes else placement.begin_block_lines()
    logger.info("Balanced placement:\n%s\nEquivalent %s lines:\n%s", placement.table(),
                "execution strategy" if scopes else "BeginBlock", "\n".join(lines))
    return placement
