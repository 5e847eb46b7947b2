"""Which schedule the workers run: the one asked for where the stages allow it, and for
pipelineSchedule("auto") the simulator's pick, chosen again from the first call's times."""
from __future__ import annotations

import logging
import statistics
from typing import Sequence

from pipetorch.parallel.comm import messages as m
from pipetorch.parallel.comm.payloads import Trace
from pipetorch.parallel.host.workers import WorkerSet
from pipetorch.schedule.device_plans import choose as choose_schedule, runs

__all__: list[str] = []

logger = logging.getLogger(__name__)

# Ticks per micro-batch for "auto": forward, input gradient and weight gradient alike, and a
# whole backward 8 where the two parts take 10 (benchmarks/pipeline.py, seed CNN on CPU:
# B + W ran about 1.2x 1F1B's backward, as a convolution's two gradients share work).
SPLIT_COSTS = dict(forward=5, backward=5, weight=5, whole=8)

Costs = dict[str, tuple[int, ...]]


class ScheduleChoice:
    """The schedule of `stages` stages on devices `owners` with G = `accumulation`."""

    def __init__(self, schedule: str, *, stages: int, owners: tuple[int, ...],
                 accumulation: int) -> None:
        self.stages, self.owners, self.accumulation = stages, owners, accumulation
        self.auto = schedule == "auto"  # Training.pipelineSchedule("auto"): the simulator
        self.predicted_bubble: float | None = None  # picks, again after the first call
        self._measured = False
        if self.auto:
            schedule = self._choose(SPLIT_COSTS)
        elif runs(schedule, owners, accumulation) != schedule:
            logger.warning(
                "pipelineSchedule(%r) needs the stages round-robin over the devices, several "
                "each (ipus 0,1,0,1), and G a multiple of G // devices; stage devices %s, G %d: "
                "running %s", schedule, list(owners), accumulation,
                runs(schedule, owners, accumulation))
            schedule = runs(schedule, owners, accumulation)
        self.schedule = schedule

    def _choose(self, costs: dict[str, int] | Costs) -> str:
        """The schedule the simulator finishes first with these tick costs (logged)."""
        schedule, self.predicted_bubble = choose_schedule(
            self.stages, self.accumulation, self.owners, **costs)
        logger.info("pipelineSchedule('auto') chose %s: predicted bubble %.1f%% of a step "
                    "(ticks %s)", schedule, 100 * self.predicted_bubble, costs)
        return schedule

    def called(self, traces: Sequence[Trace], workers: WorkerSet) -> None:
        """After a training call: with "auto", the first call's measured forward and backward
        times choose again; the workers switch plans for the next calls (every schedule
        computes the same numbers)."""
        if not self.auto or self._measured:
            return
        self._measured = True
        costs = measured_costs(traces)
        schedule = self._choose(costs) if costs else self.schedule
        if schedule != self.schedule:
            self.schedule = schedule
            workers.broadcast(m.Schedule(schedule), "a change of schedule")


def measured_costs(traces: Sequence[Trace]) -> Costs | None:
    """Per-stage tick costs for `choose_schedule` from one call's spans (medians over the
    micro-batches), the stages' median forward being 10 ticks. A whole backward's split parts
    are priced as `SPLIT_COSTS` prices them, a split one's whole likewise; None without
    every stage's forward and backward spans."""
    stages = max((t.stage for t in traces), default=-1) + 1

    def median(kind: str, stage: int) -> float | None:
        times = sorted(s.end - s.start for t in traces if t.stage == stage
                       for s in t.spans if s.kind == kind)
        return times[len(times) // 2] if times else None

    measured = {k: [median(k, s) for s in range(stages)] for k in "FBW"}
    forward, backward = ([t for t in measured[k] if t] for k in "FB")
    if not stages or len(forward) + len(backward) < 2 * stages:
        return None
    split = SPLIT_COSTS["backward"] + SPLIT_COSTS["weight"]
    whole: list[float] = []
    parts: list[tuple[float, float]] = []
    for b, w in zip(backward, measured["W"], strict=True):
        if w is None:  # a whole backward: its parts as SPLIT_COSTS shares them
            whole.append(b)
            parts.append((b * split / SPLIT_COSTS["whole"] / 2,) * 2)
        else:
            whole.append((b + w) * SPLIT_COSTS["whole"] / split)
            parts.append((b, w))
    unit = statistics.median(forward) / 10

    def ticks(values: Sequence[float]) -> tuple[int, ...]:
        return tuple(max(1, round(v / unit)) for v in values)
    return dict(forward=ticks(forward), backward=ticks([b for b, _ in parts]),
                weight=ticks([w for _, w in parts]), whole=ticks(whole))
