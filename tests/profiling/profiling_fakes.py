"""Stand-ins for the profiler's unit tests: compiled models and stage traces built from plans.

`ideal_traces` turns the schedule simulator's timeline into the Trace/Span records a worker
would send back, one tick lasting `tick` ns, so a recorded call behaves exactly like the plan.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn as nn

from pipetorch.parallel.layout.compile_plan import CompilePlan
from pipetorch.parallel.layout.placement import Placement
from pipetorch.parallel.comm.payloads import Span, Trace
from pipetorch.partition.strategies import StageSpec
from pipetorch.runtime.compile import Compiled
from pipetorch.schedule.plans import Batching
from pipetorch.schedule.simulator import simulate
from pipetorch.schedule.plans import plan

MS = 1_000_000


def ideal_traces(schedule: str, stages: int, micro_batches: int, *, iterations: int = 1,
                 start: int = 0, tick: int = MS, nbytes: int = 64) -> list[Trace]:
    """Each stage's spans for `iterations` runs of the plan, back to back, from `start` ns."""
    timeline = simulate(plan(schedule, stages, micro_batches, training=True),
                        forward=1, backward=2, transfer=0)
    traces = [Trace(s) for s in range(stages)]
    for d in range(iterations):
        offset = start + d * timeline.makespan * tick
        for s, row in enumerate(timeline.events):
            for event in row:
                action = event.action
                micro = (None if action.micro_batch is None
                         else d * micro_batches + action.micro_batch)
                traces[s].spans.append(Span(
                    action.kind.value, micro, offset + event.start * tick,
                    offset + event.end * tick, 0 if action.kind.is_compute else nbytes))
    return traces


class Linear2(nn.Module):
    """Two stages' worth of weights: 6x8 (+8) and 8x3 (+3)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 3)


def process_compiled(schedule: str = "pipelined", *, gradient_accumulation: int = 4,
                     device_iterations: int = 2, optimizer: str = "sgd") -> Compiled:
    """A Compiled whose engine looks like a two-stage ProcessEngine (no workers)."""
    model = Linear2()
    opt = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if optimizer == "sgd"
           else torch.optim.Adam(model.parameters(), lr=0.1))
    if optimizer == "sgd":  # as after a step (stepping here would cost the tests ~2 s)
        for p in model.parameters():
            opt.state[p] = {"momentum_buffer": torch.zeros_like(p)}
    engine = SimpleNamespace(
        model=model, optimizer=opt,
        batching=Batching(device_iterations, gradient_accumulation, 1),
        staged=SimpleNamespace(modules=[model.a, model.b]), schedule=schedule, last_trace=[],
        input_device=torch.device("cpu"), casting=None)
    stages = (StageSpec(0, 0, ("B1",)), StageSpec(1, 1, ("B2",)))
    placements = (Placement((0,), 0, "cpu", 1), Placement((1,), 1, "cpu", 1))
    return Compiled(engine, CompilePlan(stages, 2, schedule, placements), None, 1.25)


def local_compiled() -> Compiled:
    """A Compiled whose engine looks like the in-process LocalEngine (one stage)."""
    model = Linear2()
    engine = SimpleNamespace(
        model=model, forward=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        batching=Batching(1, 1, 1), schedule="local", last_trace=[],
        input_device=torch.device("cpu"), casting=None)
    return Compiled(engine, CompilePlan((StageSpec(0, 0, ("B1", "B2")),), 1), None, 0.5)


def options(strategy: object = None) -> SimpleNamespace:
    """Just what the profiler reads from the options."""
    locations = SimpleNamespace(optimizer_location=None)
    return SimpleNamespace(execution_strategy=strategy, TensorLocations=locations)


def run_calls(profiler: object, compiled: Compiled, *, calls: int, items: int = 16,
              gap: int = 5 * MS) -> None:
    """Record `calls` host calls, each running the engine's plan once per device iteration."""
    engine = compiled.engine
    b = engine.batching
    clock = 10 * MS
    for _ in range(calls):
        if engine.schedule == "local":  # the local engine records no spans
            end = clock + 3 * MS
        else:
            engine.last_trace = ideal_traces(engine.schedule, len(compiled.stages),
                                             b.gradient_accumulation, start=clock + MS,
                                             iterations=b.device_iterations)
            end = max(s.end for t in engine.last_trace for s in t.spans) + MS
        profiler.record_call(clock, end, items)
        clock = end + gap
