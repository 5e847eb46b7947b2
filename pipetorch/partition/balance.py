"""Stage balancing as a pure function: a cost table of segments -> the placement whose slowest
stage (transfers included) is fastest, under each device's memory budget."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Sequence

from pipetorch.errors import OutOfMemoryError
from pipetorch.partition.strategies import ExecutionStrategy, PipelinedExecution
from pipetorch.partition.strategies import Stage as BlockStage
from pipetorch.schedule.device_plans import peak_stash

__all__: list[str] = []


class NoPlacementFits(OutOfMemoryError):
    """No placement fits the budgets; `placement` is the one whose fullest device is least
    full against its budget."""

    def __init__(self, message: str, placement: Placement) -> None:
        super().__init__(message)
        self.placement = placement

    def __reduce__(self) -> tuple[type, tuple[str, Placement]]:
        return type(self), (self.args[0], self.placement)

# The bubble of a pipeline of S stages over G micro-batches is (S-1)/(G+S-1); stay under this.
BUBBLE_TARGET = 0.10
# Relative slack under which two plans' slowest stages count as equal (float sums).
TIE = 1e-9


@dataclass(frozen=True)
class Segment:
    """One candidate segment: measured costs of running it on one micro-batch.

    `seconds` is forward+backward compute, `activation_bytes` what it keeps per micro-batch for
    backward, `param_bytes` its parameters + gradients + optimiser state, and `transfer_seconds`
    the time to move its output (and, in training, the gradient back) to the next device.
    """

    name: str
    seconds: float
    activation_bytes: int = 0
    param_bytes: int = 0
    transfer_seconds: float = 0.0


@dataclass(frozen=True)
class Stage:
    """One device's share of a placement and its predicted cost."""

    device: int
    segments: tuple[str, ...]
    seconds: float
    peak_bytes: int


@dataclass(frozen=True)
class Placement:
    """The chosen split: `starts[d]` is the index of the first segment on device d."""

    starts: tuple[int, ...]
    stages: tuple[Stage, ...]

    @property
    def bottleneck_seconds(self) -> float:
        return max(s.seconds for s in self.stages)

    @property
    def throughput(self) -> float:
        """Predicted micro-batches per second once the pipeline is full."""
        return 1.0 / self.bottleneck_seconds if self.bottleneck_seconds > 0 else math.inf

    def begin_block_lines(self, prefix: str = "model") -> list[str]:
        """The `BeginBlock(...)` lines that reproduce this placement by hand."""
        lines = []
        for stage in self.stages:
            name = stage.segments[0]
            target = f"{prefix}.{name}" if name else prefix
            target = _attribute_path(target)
            lines.append(f"{target} = poptorch.BeginBlock({target}, "
                         f"\"stage{stage.device}\", ipu_id={stage.device})")
        return lines

    def strategy(self, kind: type[ExecutionStrategy] = PipelinedExecution) -> ExecutionStrategy:
        """The execution strategy grouping the segments, as block ids, into this placement's
        stages: how a placement of `Block` scopes is applied."""
        return kind(*(BlockStage(*s.segments).ipu(s.device) for s in self.stages))

    def strategy_lines(self, kind: type[ExecutionStrategy] = PipelinedExecution,
                       options: str = "opts") -> list[str]:
        """The `setExecutionStrategy(...)` lines that reproduce `strategy(kind)` by hand."""
        stages = self.strategy(kind).stages
        assert isinstance(stages, list)
        return ([f"{options}.setExecutionStrategy(poptorch.{kind.__name__}("]
                + [f"    poptorch.{stage!r}," for stage in stages] + ["))"])

    def table(self) -> str:
        """Device, segments (modules or block ids), predicted ms and MB, and predicted
        throughput, as text."""
        rows = [f"{'device':>6}  {'ms':>9}  {'MB':>9}  segments"]
        for s in self.stages:
            mods = _span(s.segments)
            rows.append(f"{s.device:>6}  {s.seconds * 1e3:>9.2f}  "
                        f"{s.peak_bytes / 2**20:>9.1f}  {mods}")
        rows.append(f"predicted throughput: {self.throughput:.2f} micro-batches/s "
                    f"(bottleneck {self.bottleneck_seconds * 1e3:.2f} ms); "
                    f"gradientAccumulation >= {propose_gradient_accumulation(len(self.stages))} "
                    "keeps the pipeline bubble under 10%")
        return "\n".join(rows)


def _span(names: tuple[str, ...]) -> str:
    return names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]} ({len(names)})"


def _attribute_path(dotted: str) -> str:
    """`model.layers.3` -> `model.layers[3]`, a path Python can assign to."""
    parts = dotted.split(".")
    out = parts[0]
    for p in parts[1:]:
        out += f"[{p}]" if p.isdigit() else f".{p}"
    return out


def _in_flight(devices: int, *, schedule: str = "pipelined", micro_batches: int | None = None,
               owners: Sequence[int] | None = None) -> tuple[int, ...]:
    """The micro-batches each stage holds for backward: the schedule's peak stash
    (`schedule.device_plans.peak_stash`) of plan kind `schedule` with stage s on device
    `owners[s]` (default one stage per device), over `micro_batches` (default: the smallest G
    `propose_gradient_accumulation` allows)."""
    count = micro_batches or propose_gradient_accumulation(devices)
    return peak_stash(schedule, devices, count, owners, training=True)


class _Costs:
    """Prefix sums over the table so a stage's cost is O(1)."""

    def __init__(self, segments: Sequence[Segment]) -> None:
        self.segments = segments
        self.time = _prefix([s.seconds for s in segments])
        self.act = _prefix([s.activation_bytes for s in segments])
        self.par = _prefix([s.param_bytes for s in segments])

    def seconds(self, i: int, j: int) -> float:
        """Compute of segments [i, j) plus the transfers across its two cuts."""
        n = len(self.segments)
        into = self.segments[i - 1].transfer_seconds if i > 0 else 0.0
        out = self.segments[j - 1].transfer_seconds if j < n else 0.0
        return self.time[j] - self.time[i] + into + out

    def peak(self, i: int, j: int, flight: int) -> int:
        return self.par[j] - self.par[i] + flight * (self.act[j] - self.act[i])


def _prefix(values: list) -> list:
    out = [0 * values[0] if values else 0]
    for v in values:
        out.append(out[-1] + v)
    return out


def plan(segments: Sequence[Segment], devices: int, *,
         budgets: int | Sequence[int] | None = None, schedule: str = "pipelined",
         micro_batches: int | None = None, owners: Sequence[int] | None = None) -> Placement:
    """The placement of contiguous segments on `devices` devices minimising the slowest stage.

    Every device gets at least one segment and holds its activations times its micro-batches
    in flight under plan kind `schedule` over `micro_batches` (the schedule's peak stash).
    Among optimal placements the one with the earliest cuts is returned, so the result is
    deterministic. Raises `OutOfMemoryError` when no placement fits `budgets` (bytes, one for
    all devices or one per device); its `placement` is the one whose fullest device is least
    full against its budget.

    `owners` puts the `devices` stages on fewer devices, stage s on device `owners[s]` (ipus
    0,1,0,1 for interleaved): the in-flight counts are the schedule's on them, a device's
    budget (one for all, or one per device) is shared evenly between its stages, so that
    whatever the cut their sum fits it, and of the placements whose slowest stage is fastest
    the one with the evenest stages is returned (a device's time is its stages' sum: the
    earliest cuts would pile the slack onto the last stages).
    """
    _check(segments, devices)
    costs = _Costs(segments)
    caps = _caps(budgets, devices, owners)
    flight = _in_flight(devices, schedule=schedule, micro_batches=micro_batches, owners=owners)
    starts = _solve(costs, devices, lambda d, i, j: (
        costs.seconds(i, j) if costs.peak(i, j, flight[d]) <= caps[d] else math.inf),
        even=owners is not None and len(set(owners)) < devices)
    if starts is None:
        best = _solve(costs, devices, lambda d, i, j: costs.peak(i, j, flight[d]) / caps[d])
        assert best is not None
        least_full = _placement(costs, best, flight)  # the smallest peak: the planner's
        raise NoPlacementFits(_oom_message(least_full, caps), least_full)
    return _placement(costs, starts, flight)


def evaluate(segments: Sequence[Segment], starts: Sequence[int], *,
             schedule: str = "pipelined", micro_batches: int | None = None) -> Placement:
    """The predicted costs of a given split (`starts[d]`: first segment on device d), its
    activations priced as in `plan`."""
    if list(starts) != sorted(set(starts)) or not starts or starts[0] != 0 \
            or starts[-1] >= len(segments):
        raise ValueError(f"starts {list(starts)} must rise from 0 and stay below the "
                         f"{len(segments)} segments")
    flight = _in_flight(len(starts), schedule=schedule, micro_batches=micro_batches)
    return _placement(_Costs(segments), tuple(starts), flight)


def _check(segments: Sequence[Segment], devices: int) -> None:
    if devices < 1:
        raise ValueError(f"devices ({devices}) must be >= 1")
    if len(segments) < devices:
        raise ValueError(
            f"Cannot balance {len(segments)} candidate segments over {devices} devices: every "
            "device needs at least one; use fewer devices or mark more blocks (BeginBlock)")


def _caps(budgets: int | Sequence[int] | None, devices: int,
          owners: Sequence[int] | None = None) -> list[float]:
    """Each stage's share of its device's budget (`plan`)."""
    owners = list(range(devices)) if owners is None else list(owners)
    if len(owners) != devices:
        raise ValueError(f"owners {owners} must give a device for each of the {devices} stages")
    if budgets is None:
        return [math.inf] * devices
    count = max(owners) + 1
    if isinstance(budgets, int):
        budgets = [budgets] * count
    if len(budgets) != count:
        raise ValueError(f"{len(budgets)} memory budgets given for {count} devices; "
                         "give one per device or a single int")
    return [budgets[d] / owners.count(d) for d in owners]


def _solve(costs: _Costs, devices: int, cost: Callable[[int, int, int], float], *,
           even: bool = False) -> tuple[int, ...] | None:
    """Min-max contiguous split by dynamic programming, then the earliest cuts within it
    (`even`: the cuts whose stage costs have the least sum of squares within it)."""
    n = len(costs.segments)

    @functools.lru_cache(maxsize=None)
    def best(d: int, i: int) -> float:
        if d == devices - 1:
            return cost(d, i, n)
        return min(max(cost(d, i, j), best(d + 1, j))
                   for j in range(i + 1, n - (devices - d - 1) + 1))

    value = best(0, 0)
    if value == math.inf:
        return None
    bound = value + TIE * abs(value)

    @functools.lru_cache(maxsize=None)
    def spread(d: int, i: int) -> tuple[float, int]:
        """(the least sum of squared stage costs from stage d at segment i within `bound`,
        where stage d + 1 then begins)."""
        ends = range(i + 1, n - (devices - d - 1) + 1) if d < devices - 1 else [n]
        return min(((c * c + (spread(d + 1, j)[0] if j < n else 0.0), j)
                    if (c := cost(d, i, j)) <= bound else (math.inf, j)) for j in ends)

    starts, i = [0], 0
    for d in range(devices - 1):
        i = spread(d, i)[1] if even else next(
            j for j in range(i + 1, n - (devices - d - 1) + 1)
            if cost(d, i, j) <= bound and best(d + 1, j) <= bound)
        starts.append(i)
    return tuple(starts)


def _placement(costs: _Costs, starts: tuple[int, ...], flight: Sequence[int]) -> Placement:
    ends = starts[1:] + (len(costs.segments),)
    stages = tuple(
        Stage(d, tuple(s.name for s in costs.segments[i:j]), costs.seconds(i, j),
              costs.peak(i, j, flight[d]))
        for d, (i, j) in enumerate(zip(starts, ends, strict=True)))
    return Placement(starts, stages)


def _oom_message(best: Placement, caps: list[float]) -> str:
    rows = "; ".join(f"device {s.device}: {s.peak_bytes / 2**20:.1f} MB of "
                     f"{caps[s.device] / 2**20:.1f} MB ({_span(s.segments)})"
                     for s in best.stages)
    return (f"No placement over {len(best.stages)} devices fits the memory budget; the best "
            f"plan peaks at {rows}. Remedies: halve activations and weights with "
            "fp16 (model.half()), recompute activations (opts.Training.setRecomputation), "
            "offload optimiser state (opts.TensorLocations), use more devices, or raise "
            "opts.setMemoryBudget")


def propose_gradient_accumulation(stages: int, *, target: float = BUBBLE_TARGET) -> int:
    """Smallest G with bubble (S-1)/(G+S-1) under `target`, and at least 2S-1 for 1F1B."""
    if stages <= 1:
        return 1
    g = math.floor((stages - 1) * (1 - target) / target) + 1
    while (stages - 1) / (g + stages - 1) >= target:
        g += 1
    return max(g, 2 * stages - 1)
