"""summary.json: devices, replicas, stages with blocks and parameters, batching, throughput."""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence, TypedDict, runtime_checkable

import torch.nn as nn

from pipetorch.profiling.lanes import lanes_of, stage_modules
from pipetorch.profiling.timing import CallRecord, Timing, timing_summary

if TYPE_CHECKING:
    from pipetorch.options.options import Options
    from pipetorch.profiling.memory import MemoryReport
    from pipetorch.profiling.compiled import Compiled

__all__: list[str] = []

FORMAT = "pipetorch-report/1"


class LaneRow(TypedDict):
    """A Lane as summary.json's `lanes` lists it."""

    stage: int | None
    ipu: int
    device: str
    threads: int
    label: str


class StageRow(TypedDict):
    """One stage of summary.json: its IPU, its blocks and its parameters (None: shared)."""

    index: int
    ipu: int
    blocks: list[str]
    parameters: int | None


class BatchRow(TypedDict):
    """summary.json's `batch`: D, G, R and the micro-batches and items of a call."""

    device_iterations: int
    gradient_accumulation: int
    replication_factor: int
    micro_batches_per_call: int
    items_per_call: int | None
    micro_batch_size: int | None


class Throughput(TypedDict):
    """summary.json's `throughput`, over every recorded call."""

    calls: int
    items: int
    seconds_in_calls: float
    items_per_second: float | None
    mean_call_ms: float | None
    steady_items_per_second: float | None


class ScheduleChoice(TypedDict):
    """What pipelineSchedule("auto") predicted for the schedule it chose."""

    predicted_bubble: float


class Summary(TypedDict):
    """summary.json (`build`), as written and as `recorder.load` reads it back."""

    format: str
    model: str
    mode: str
    engine: str
    schedule: str
    execution_strategy: str | None
    devices: int
    replicas: int
    lanes: list[LaneRow]
    stages: list[StageRow]
    parameters: int
    batch: BatchRow
    compile_seconds: float
    throughput: Throughput
    timing: Timing
    schedule_chosen: ScheduleChoice | None


@runtime_checkable
class _Chosen(Protocol):
    """An engine whose schedule pipelineSchedule("auto") chose, and the bubble it predicted."""

    auto: bool
    predicted_bubble: float


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def build(compiled: Compiled, calls: Sequence[CallRecord], *, training: bool,
          options: Options, totals: dict[str, int]) -> Summary:
    """The summary of a compiled model and its recorded calls.

    `totals` counts every call: calls, items, ns, and first_items / first_ns of the first one.
    """
    engine, batching, plan = compiled.engine, compiled.engine.batching, compiled.plan
    modules = stage_modules(compiled)
    stages: list[StageRow] = [{"index": s.index, "ipu": s.ipu_id, "blocks": list(s.block_ids),
                               "parameters": count_parameters(modules[i]) if modules else None}
                              for i, s in enumerate(plan.stages)]
    lanes = lanes_of(compiled)
    schedule = engine.schedule
    calls_total, items, seconds = totals["calls"], totals["items"], totals["ns"] * 1e-9
    micro = batching.micro_batches
    strategy = getattr(options, "execution_strategy", None)
    return {
        "format": FORMAT,
        "model": type(engine.model).__name__,
        "mode": "training" if training else "inference",
        "engine": "local" if plan.local else "processes",
        "schedule": schedule,
        "execution_strategy": type(strategy).__name__ if strategy is not None else None,
        "devices": plan.devices,
        "replicas": batching.replication_factor,
        "lanes": [{"stage": lane.stage, "ipu": lane.ipu, "device": lane.device,
                   "threads": lane.threads, "label": lane.label} for lane in lanes],
        "stages": stages,
        "parameters": count_parameters(engine.model),
        "batch": {
            "device_iterations": batching.device_iterations,
            "gradient_accumulation": batching.gradient_accumulation,
            "replication_factor": batching.replication_factor,
            "micro_batches_per_call": micro,
            "items_per_call": items // calls_total if calls_total else None,
            "micro_batch_size": items // (calls_total * micro) if calls_total else None,
        },
        "compile_seconds": compiled.seconds,
        "throughput": {
            "calls": calls_total,
            "items": items,
            "seconds_in_calls": seconds,
            "items_per_second": _rate(items, totals["ns"]),
            "mean_call_ms": seconds * 1e3 / calls_total if calls_total else None,
            # The first call also warms up (allocations, worker caches): left out here.
            "steady_items_per_second": _rate(items - totals["first_items"],
                                             totals["ns"] - totals["first_ns"]),
        },
        "timing": timing_summary(calls, stages=1 if plan.local else len(plan.stages),
                                 schedule=schedule, batching=batching, training=training,
                                 owners=None if plan.local else plan.owners),
        # Training.pipelineSchedule("auto"): the simulator's pick and the bubble it predicted
        "schedule_chosen": ({"predicted_bubble": engine.predicted_bubble}
                            if isinstance(engine, _Chosen) and engine.auto else None),
    }


def _chosen(chosen: ScheduleChoice | None) -> str:
    if not chosen:
        return ""
    return (f" (chosen by pipelineSchedule('auto'), predicted bubble "
            f"{100 * chosen['predicted_bubble']:.1f}% of a step)")


def _rate(items: int, ns: int) -> float | None:
    return items / (ns * 1e-9) if ns > 0 else None


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else f"{value:{spec}}"


def render_text(summary: Summary, memory: MemoryReport | None = None) -> str:
    """The summary as `pipetorch report DIR` prints it."""
    b, t = summary["batch"], summary["throughput"]
    timing = summary["timing"]
    lines = [
        f"{summary['model']} ({summary['mode']}), {summary['engine']} engine, "
        f"{summary['schedule']} schedule" + _chosen(summary.get("schedule_chosen")),
        f"devices {summary['devices']}, replicas {summary['replicas']}, "
        f"parameters {summary['parameters']:,}",
        f"batch: deviceIterations {b['device_iterations']}, gradientAccumulation "
        f"{b['gradient_accumulation']}, replicationFactor {b['replication_factor']}, "
        f"micro-batch size {_number(b['micro_batch_size'], 'd')}, "
        f"{b['micro_batches_per_call']} micro-batches per call",
        f"compile {summary['compile_seconds']:.2f} s; {t['calls']} call(s), {t['items']} items, "
        f"throughput {_number(t['items_per_second'], '.1f')} items/s (after the first call "
        f"{_number(t['steady_items_per_second'], '.1f')}), "
        f"mean call {_number(t['mean_call_ms'], '.1f')} ms",
        "stages:",
    ]
    for stage in summary["stages"]:
        params = _number(stage["parameters"], ",d")
        lines.append(f"  stage {stage['index']} on IPU {stage['ipu']}: blocks "
                     f"{', '.join(stage['blocks']) or '-'}; parameters {params}")
    bubble = timing["bubble"]
    if timing["spans"]:
        lines.append(f"bubble: measured {_number(bubble['measured'], '.1%')}, theoretical "
                     f"{_number(bubble['theoretical'], '.1%')} ({bubble['formula']}) over the "
                     f"last {timing['calls_analysed']} call(s)")
        for lane, row in zip(summary["lanes"], timing["per_device"], strict=True):
            lines.append(f"  {lane['label']}: utilisation {_number(row['utilisation'], '.1%')}, "
                         f"compute {row['compute_ms']:.1f} ms, idle {row['idle_ms']:.1f} ms "
                         f"(transfers and waits {row['transfer_ms']:.1f} ms, optimiser "
                         f"{row['step_ms']:.1f} ms)")
    else:
        lines.append(timing["note"] or "")
    if memory is not None:
        lines.append(f"memory per device, {memory['method']}:")
        for device in memory["devices"]:
            lines.append(f"  {device['label']}: total {mib(device['total'])}, parameters "
                         f"{mib(device['parameters'])}, gradients {mib(device['gradients'])}, "
                         f"optimiser {mib(device['optimiser_state'])}, activations "
                         f"{mib(device['activations'])}")
    return "\n".join(lines)


def mib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.2f} MiB"
