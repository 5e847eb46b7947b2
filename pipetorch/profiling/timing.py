"""Where time went: per-device compute, transfer, step and idle time, and the pipeline bubble.

A host call's window on the devices runs from the first span any stage starts to the last one
any stage ends. Within it each device computes (forwards and backwards), transfers (sends and
receives, including the wait for the peer's half), steps the optimiser, or sits idle. The
measured bubble is the share of device-time not spent computing, the quantity the schedule's
simulation calls the bubble with free transfers:

    bubble = 1 - sum(compute of each device) / (devices x window)

For 1F1B and fill-drain with balanced stages it is (S-1)/(G+S-1); for sharded execution
(S-1)/S.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence, TypedDict

if TYPE_CHECKING:
    from pipetorch.parallel.comm.payloads import Trace
    from pipetorch.schedule.plans import Batching

__all__: list[str] = []

COMPUTE = frozenset({"F", "B", "W"})  # W: the weight-gradient part a zero-bubble B defers
# Sends and receives between stages; the host's inputs arriving (H2D) and outputs leaving
# (D2H); the all-reduce of gradients with the other replicas (AR), and of a tied weight's
# gradients with the other devices holding it (TR).
TRANSFER = frozenset({"S>F", "R<F", "S<B", "R>B", "S<D", "R>D", "H2D", "D2H", "AR", "TR"})
STEP = "STEP"


@dataclass(frozen=True)
class CallRecord:
    """One host call: its host-side start and end (monotonic ns), its items, its stages' traces."""

    index: int
    start: int
    end: int
    items: int
    traces: tuple[Trace, ...] = ()  # (stage, spans) per stage

    def window(self) -> tuple[int, int] | None:
        """First span start and last span end over every stage, or None without spans."""
        spans = [s for t in self.traces for s in t.spans]
        if not spans:
            return None
        return min(s.start for s in spans), max(s.end for s in spans)


class DeviceRow(TypedDict):
    """One device's row of summary.json's timing.per_device: milliseconds over the calls."""

    stage: int
    window_ms: float
    compute_ms: float
    transfer_ms: float
    step_ms: float
    untracked_ms: float
    idle_ms: float
    idle_fraction: float | None
    utilisation: float | None


class Bubble(TypedDict):
    """The measured and theoretical bubble of summary.json's timing section."""

    measured: float | None
    theoretical: float | None
    formula: str | None
    stages: int
    micro_batches_per_plan: int


class Timing(TypedDict):
    """The `timing` section of summary.json (`timing_summary`)."""

    calls_analysed: int
    first_call_analysed: int | None
    spans: bool
    note: str | None
    host_call_ms: float
    device_window_ms: float | None
    host_overhead_ms: float | None
    per_device: list[DeviceRow]
    bubble: Bubble
    concurrency: float | None


@dataclass(frozen=True)
class DeviceTime:
    """Nanoseconds one stage's device spent on each kind of work, summed over calls."""

    stage: int
    window: int
    compute: int
    transfer: int
    step: int

    @property
    def idle(self) -> int:
        """Everything but computing: transfers and waits, the optimiser step, gaps."""
        return self.window - self.compute

    @property
    def untracked(self) -> int:
        """Time between this device's actions (bookkeeping, waiting for the host)."""
        return max(self.window - self.compute - self.transfer - self.step, 0)

    @property
    def utilisation(self) -> float:
        return self.compute / self.window if self.window else 0.0

    def as_dict(self) -> DeviceRow:
        ms = 1e-6
        return {"stage": self.stage, "window_ms": self.window * ms,
                "compute_ms": self.compute * ms, "transfer_ms": self.transfer * ms,
                "step_ms": self.step * ms, "untracked_ms": self.untracked * ms,
                "idle_ms": self.idle * ms,
                "idle_fraction": self.idle / self.window if self.window else None,
                "utilisation": self.utilisation if self.window else None}


def device_times(calls: Sequence[CallRecord], stages: int) -> list[DeviceTime]:
    """Per stage, the time of each kind of work over `calls` and the calls' windows."""
    totals = {s: {"window": 0, "compute": 0, "transfer": 0, "step": 0} for s in range(stages)}
    for call in calls:
        window = call.window()
        if window is None:
            continue
        for s in totals:
            totals[s]["window"] += window[1] - window[0]
        for trace in call.traces:
            row = totals[trace.stage]
            for span in trace.spans:
                row[_category(span.kind)] += span.end - span.start
    return [DeviceTime(s, **row) for s, row in totals.items()]


def _category(kind: str) -> str:
    if kind in COMPUTE:
        return "compute"
    if kind in TRANSFER:
        return "transfer"
    if kind == STEP:
        return "step"
    raise ValueError(f"Unknown span kind {kind!r}: expected one of "
                     f"{sorted(COMPUTE | TRANSFER | {STEP})}")


def measured_bubble(times: Sequence[DeviceTime]) -> float | None:
    """1 - compute / (devices x window) over every device, or None without spans."""
    total = sum(t.window for t in times)
    return 1.0 - sum(t.compute for t in times) / total if total else None


def concurrency(calls: Sequence[CallRecord]) -> float | None:
    """Share of the calls' windows during which at least two devices compute at once."""
    both = total = 0
    for call in calls:
        window = call.window()
        if window is None:
            continue
        total += window[1] - window[0]
        edges = sorted((edge, step) for t in call.traces for s in t.spans if s.kind in COMPUTE
                       for edge, step in ((s.start, 1), (s.end, -1)))
        running, since = 0, 0
        for time, step in edges:  # ends sort before starts at the same instant
            if running >= 2:
                both += time - since
            running, since = running + step, time
    return both / total if total else None


def theoretical_bubble(schedule: str, stages: int, micro_batches: int, *, training: bool,
                       owners: Sequence[int] | None = None) -> tuple[float, str] | None:
    """The bubble of `schedule` with balanced stages and free transfers, and its formula.

    Simulates the same plan the workers run (backward costing twice a forward; split into
    an input and a weight part of one forward each by zero_bubble); an interleaved one on the
    stages' devices `owners`. None for the local engine, whose stages run one after another
    in one process.
    """
    from pipetorch.schedule import device_plans, plans
    from pipetorch.schedule.simulator import simulate

    if schedule not in plans.KINDS + device_plans.INTERLEAVED or schedule == "fill_drain" \
            or stages < 1 or micro_batches < 1:
        return None
    split = "zero_bubble" in schedule and training
    costs = dict(forward=1, backward=1 if split else 2, weight=1)
    if schedule in device_plans.INTERLEAVED and owners is not None:
        fraction = device_plans.simulate_devices(device_plans.device_plan(
            schedule, stages, micro_batches, owners, training=training), owners,
            buffered=True, **costs).bubble_fraction
        n = max(owners) + 1
        return fraction, (f"(N-1)/(VG+N-1) = {n - 1}/{stages // n * micro_batches + n - 1} "
                          "without the split")
    kind = "zero_bubble" if split else "sharded" if schedule == "sharded" else "pipelined"
    fraction = simulate(plans.plan(kind, stages, micro_batches, training=training),
                        **costs).bubble_fraction
    if split:
        formula = (f"(S-1)(f+b)/(G(f+b+w)+(S-1)(f+b)) = {2 * (stages - 1)}/"
                   f"{3 * micro_batches + 2 * (stages - 1)}")
    elif kind == "pipelined":
        formula = f"(S-1)/(G+S-1) = {stages - 1}/{micro_batches + stages - 1}"
    else:
        formula = f"(S-1)/S = {stages - 1}/{stages}"
    return fraction, formula


def plan_micro_batches(batching: Batching, *, training: bool) -> int:
    """Micro-batches one run of the plan covers: G x R per step in training, D x R otherwise."""
    if training:
        return batching.gradient_accumulation * batching.replication_factor
    return batching.device_iterations * batching.replication_factor


def timing_summary(calls: Sequence[CallRecord], *, stages: int, schedule: str,
                   batching: Batching, training: bool,
                   owners: Sequence[int] | None = None) -> Timing:
    """The `timing` section of summary.json: per-device times, measured and ideal bubble."""
    times = device_times(calls, stages)
    per_plan = plan_micro_batches(batching, training=training)
    ideal = theoretical_bubble(schedule, stages, per_plan, training=training, owners=owners)
    spans = any(t.spans for c in calls for t in c.traces)
    host = sum(c.end - c.start for c in calls)
    windows = [w for w in (c.window() for c in calls) if w is not None]
    on_devices = sum(end - start for start, end in windows)
    return {
        "calls_analysed": len(calls),
        "first_call_analysed": calls[0].index if calls else None,
        "spans": spans,
        "note": None if spans else (
            "Only host calls were recorded: per-stage spans need the stages on several "
            "devices (stages with different ipu_id run in worker processes)"),
        "host_call_ms": host * 1e-6,
        "device_window_ms": on_devices * 1e-6 if windows else None,
        "host_overhead_ms": (host - on_devices) * 1e-6 if windows else None,
        "per_device": [t.as_dict() for t in times] if spans else [],
        "bubble": {
            "measured": measured_bubble(times) if spans else None,
            "theoretical": ideal[0] if ideal else None,
            "formula": ideal[1] if ideal else None,
            "stages": stages,
            "micro_batches_per_plan": per_plan,
        },
        "concurrency": concurrency(calls) if spans else None,
    }
