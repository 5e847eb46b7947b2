"""What the host and the workers hand each other besides tensors: a stage as its worker holds
it, a host call as a device sees it, the trace of what ran, and generate()'s model and steps."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import torch.nn as nn

from pipetorch.parallel.layout.routes import Route
from pipetorch.partition.export import Tree
from pipetorch.partition.split import Source

__all__: list[str] = []

LaneCall = tuple[tuple, dict]  # a lane's (args, kwargs) of a step, caches replaced by CacheSlot
Shapes = dict[str, tuple[tuple[int, ...], torch.dtype]]  # cache layer -> its keys' shape, dtype


@dataclass(frozen=True)
class Call:
    """One host call as a device sees it."""

    inputs: Mapping[int, torch.Tensor | list[torch.Tensor]]  # forward's tensor argument i (read
    # by a stage of the device) -> its micro-batches stacked (listed, in the local engine)
    iterations: int                  # times the plan runs (D when training, 1 for inference)
    micro_batches: int               # micro-batches per run of the plan
    wanted: frozenset[int]           # micro-batches whose outputs go back to the host
    scale: float = 1.0               # the loss's multiplier before loss scaling: 1/(G*R) for a mean
    overlap: bool = True             # replicas' all-reduce may start in the last backward


@dataclass
class Span:
    """One action as it ran: what, which micro-batch, when (monotonic ns), bytes moved."""

    kind: str
    micro_batch: int | None
    start: int
    end: int
    nbytes: int = 0


@dataclass
class Trace:
    """The spans of one host call on one stage (of one replica)."""

    stage: int
    spans: list[Span] = field(default_factory=list)
    replica: int = 0
    peak_memory: int | None = None  # the device's peak during the call: CUDA allocator / RSS
    transport: str = "gloo"  # how bundles crossed to the neighbours: "shm", "gloo" or "nccl"
    # replica all-reduces started before the step (parallel/worker/overlap.py), each as an "AR" span
    # from its start to the end of the step's AR that waited for it; micro_batch: that of the
    # backward it started in or after
    early_reduces: list[Span] = field(default_factory=list)
    snapshot: tuple[float, int] | None = None  # the state written after the call: (s, bytes)


@dataclass(frozen=True)
class DeviceStage:
    """A stage as its device's worker holds it: its module, its route, and where each of the
    module's arguments comes from."""

    module: nn.Module
    route: Route
    inputs: tuple[Source, ...]


@dataclass(frozen=True)
class Skeleton:
    """The model without its parameters (on the meta device; buffers kept), and every name of
    each parameter and buffer mapped to its first (a tied weight has several)."""

    model: nn.Module
    first_names: dict[str, str]
    stage_of_block: dict[str, int]


@dataclass(frozen=True)
class Step:
    """One host step: call the module at `path` on each lane's arguments (caches replaced by
    CacheSlot), with the cache layer shapes every worker reported after the last step."""

    session: int
    path: str
    lanes: dict[int, LaneCall]
    shapes: dict[int, Shapes]
    template: Any = None  # an empty cache to copy for each new lane (the step's first)
    batched: bool = False  # the lanes run as one batch (their shapes match)


@dataclass(frozen=True)
class StepResult:
    """The lanes a worker finished, and the cache layers it holds after the step."""

    outputs: dict[int, Tree] = field(default_factory=dict)
    shapes: dict[int, Shapes] = field(default_factory=dict)
