"""Early replica all-reduce: a gradient bucket's sum starts in the step's last backward.

Without it, every bucket is summed over the replicas at ALL_REDUCE, after the whole
backward. With it, a stage's weights' post-accumulate-grad hooks are armed during the
stage's last weight-gradient action of the step (the last micro-batch's B), and a bucket's
all-reduce starts (async) as soon as each of its gradients is final; ALL_REDUCE starts what
is left and waits for all of them, just before STEP:

    stage 1     ... F3 B2 [ B3 ............................ ] AR........ STEP
    buckets                     k0 starts  k1 starts  k2 starts  wait all

Every replica starts the buckets in one fixed order (bucket k only after 0..k-1), derived
from the parameters' order: later stages first, a stage's parameters backwards, as backward
finishes them. NCCL matches collectives by order, so the order must not depend on timing.

Weights tied across devices (summed over those devices first, parallel/worker/tied.py) and weights
two held stages share stay out: they are summed at ALL_REDUCE as before. A stage whose hooks
could fire before its gradient is final, or would not fire at all, is only swept: its buckets
become ready at the end of its last weight-gradient action (a recomputed stage, whose
checkpoints may accumulate a weight twice in one backward; a compiled one; a zero-bubble W,
which assigns `.grad` itself).

Memory: a bucket that is one slice of one gradient is reduced where it lies; any other
bucket in flight holds its own buffer until ALL_REDUCE, so up to 1x the gradients more at
the end of the step (as DistributedDataParallel's buckets), where summing at the step reuses
one bucket's buffer.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn as nn

from pipetorch.parallel.comm.buckets import Piece, buckets
from pipetorch.parallel.comm.transport import InFlight, PeerLink
from pipetorch.schedule.actions import Action, Kind

__all__: list[str] = []


def arming(actions: Sequence[Action]) -> dict[int, int]:
    """Action index -> stage, for each stage's last weight-gradient action (B or W) before
    the step: after it, none of the stage's gradients changes until the step."""
    step = next(n for n, a in enumerate(actions) if a.kind is Kind.STEP)
    last: dict[int, int] = {}
    for n, action in enumerate(actions[:step]):
        if action.kind in (Kind.BACKWARD, Kind.BACKWARD_WEIGHT):
            last[action.stage] = n
    return {n: stage for stage, n in last.items()}


@dataclass(frozen=True)
class Started:
    """One bucket's all-reduce as it started: inside action `at` ("hook"), at its end
    ("sweep") or at ALL_REDUCE ("step"); `start` in monotonic ns."""

    bucket: int
    at: int
    by: str
    start: int
    nbytes: int


class EarlyReduce:
    """The buckets of one device's early path, their hooks, and the all-reduces in flight.

    `stages` maps each held stage (pipeline index) to the parameters that take the early
    path, in the stage's order.
    """

    def __init__(self, stages: dict[int, list[nn.Parameter]], link: PeerLink) -> None:
        self.link = link
        order = [p for s in sorted(stages, reverse=True) for p in reversed(stages[s])]
        self.stage_of = {id(p): s for s, params in stages.items() for p in params}
        self.params = {id(p): p for p in order}
        self.layout = buckets(order, link.bucket_bytes)  # Pieces over the parameters
        self.member: dict[int, list[int]] = {}  # parameter -> the buckets holding part of it
        for k, bucket in enumerate(self.layout):
            for piece in bucket:
                self.member.setdefault(id(piece.tensor), []).append(k)
        self.hooked: set[int] = set()  # stages whose hooks are armed now
        self.started: list[Started] = []  # this step's starts, in order
        self._at, self._by = -1, "step"
        self._lock = threading.Lock()  # autograd may run a CPU and a GPU weight's hooks at once
        # kept for the executor's life: a hook does nothing unless its stage is armed
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for p in order]
        self.begin()

    def begin(self) -> None:
        """A new optimiser step: no gradient final, nothing in flight."""
        self._final: set[int] = set()
        self._waiting = [len({id(piece.tensor) for piece in bucket}) for bucket in self.layout]
        self._next = 0
        self._flights: list[InFlight] = []
        self.hooked.clear()
        self.started.clear()

    def arm(self, stage: int, at: int, *, hooks: bool) -> None:
        """The stage's last weight-gradient action (index `at`) starts: its hooks may start
        buckets."""
        self._at, self._by = at, "hook"
        if hooks:
            self.hooked.add(stage)

    def sweep(self, stage: int) -> None:
        """The stage's last weight-gradient action ended: all its gradients are final."""
        self.hooked.discard(stage)
        self._by = "sweep"
        for key, param in self.params.items():
            if self.stage_of[key] == stage:
                self._ready(param)

    def finish(self) -> None:
        """At ALL_REDUCE: start whatever is left (in order), then wait for every bucket."""
        self.hooked.clear()
        self._by = "step"
        for param in self.params.values():
            self._ready(param)
        flights, self._flights = self._flights, []
        for flight in flights:
            self.link.finish_all_reduce(flight)

    def _hook(self, param: torch.Tensor) -> None:
        if self.hooked and self.stage_of[id(param)] in self.hooked:
            with self._lock:
                self._ready(param)

    def _ready(self, param: torch.Tensor) -> None:
        key = id(param)
        if key in self._final:
            return
        self._final.add(key)
        grad = param.grad
        if grad is not None and param.is_contiguous() and not grad.is_contiguous():
            param.grad = grad.contiguous()  # its buckets may hold slices of it (rare)
        for k in self.member[key]:
            self._waiting[k] -= 1
        while self._next < len(self.layout) and self._waiting[self._next] == 0:
            self._start(self._next)
            self._next += 1

    def _start(self, k: int) -> None:
        # A weight without a gradient has none on every replica (as at ALL_REDUCE today):
        # leaving it out keeps the replicas' buckets alike.
        pieces = [Piece(piece.tensor.grad, piece.start, piece.stop)
                  for piece in self.layout[k] if piece.tensor.grad is not None]
        if pieces:
            flight = self.link.start_all_reduce(pieces)
            self._flights.append(flight)
            self.started.append(Started(k, self._at, self._by, time.monotonic_ns(),
                                        flight.flat.numel() * flight.flat.element_size()))
