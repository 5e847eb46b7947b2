"""Automatic stage balancing: profile the candidate segments, plan, and place BeginBlocks."""
from __future__ import annotations

import logging
from typing import Any, Sequence

import torch
from torch import nn

from pipetorch.partition.balance import Placement, default_in_flight, plan
from pipetorch.partition.blocks import BeginBlock, removeBlocks
from pipetorch.partition.candidates import candidates
from pipetorch.profiling.costs import cost_table

__all__ = ["balance"]

logger = logging.getLogger(__name__)


def balance(model: nn.Module, *sample_inputs: Any, devices: int,
            sample_kwargs: dict[str, Any] | None = None,
            memory_budget: int | Sequence[int] | None = None, repeats: int = 5,
            optimizer_slots: int = 2, threads: int | None = None,
            link_bytes_per_s: float | None = None, apply: bool = True) -> Placement:
    """Split `model` over `devices` pipeline stages by measured time and memory.

    `sample_inputs` (and `sample_kwargs`, for models called by keyword) is one micro-batch. Each candidate segment (the user's blocks, else the
    model's layers) is profiled here for forward+backward time, activations and parameter +
    optimiser bytes; the plan minimises the slowest stage, transfers included, under
    `memory_budget` bytes per device. With `apply` (default) the placement is written on the
    model as `BeginBlock(..., ipu_id=d)` annotations, replacing any there, so that
    `poptorch.trainingModel(model, opts)` runs it. Raises `OutOfMemoryError` when nothing fits.
    """
    names = candidates(model)
    if not names:
        raise ValueError(
            f"{type(model).__name__} has no candidate cut points: balancing needs BeginBlock "
            "annotations or children in an nn.Sequential / nn.ModuleList")
    kwargs = sample_kwargs or {}
    names = _execution_order(model, names, sample_inputs, kwargs)
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    # Profiling steps must not change the model: restore buffers (BatchNorm statistics) and
    # the random state (dropout) they consume.
    buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
    try:
        with torch.random.fork_rng(devices=[]):
            table = cost_table(model, names, sample_inputs, kwargs, repeats=repeats,
                               optimizer_slots=optimizer_slots,
                               link_bytes_per_s=link_bytes_per_s)
    finally:
        torch.set_num_threads(previous)
        with torch.no_grad():
            for k, v in model.named_buffers():
                v.copy_(buffers[k])
    placement = plan(table, devices, budgets=memory_budget, in_flight=default_in_flight)
    logger.info("Balanced placement:\n%s\nEquivalent BeginBlock lines:\n%s",
                placement.table(), "\n".join(placement.begin_block_lines()))
    if apply:
        apply_placement(model, placement)
    return placement


def apply_placement(model: nn.Module, placement: Placement) -> nn.Module:
    """Replace the model's BeginBlock annotations with one per stage of `placement`."""
    removeBlocks(model)
    modules = dict(model.named_modules())
    for stage in placement.stages:
        BeginBlock(modules[stage.segments[0]], f"stage{stage.device}", ipu_id=stage.device)
    return model


def _execution_order(model: nn.Module, names: list[str], args: tuple,
                     kwargs: dict[str, Any]) -> list[str]:
    """Candidates in the order the forward first calls them; ones never called are dropped."""
    modules = dict(model.named_modules())
    order: list[str] = []
    handles = [modules[n].register_forward_pre_hook(
        lambda m, a, n=n: order.append(n) if n not in order else None) for n in names]
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return order
