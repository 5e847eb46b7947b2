"""One layout's plan (`plan_measured`): each device's memory and the step time of a pipelined
run of a model `measured` once, before having the machines (`plan.plan` is the public entry).

The model may live on the meta device: nothing is allocated. One forward on fake tensors (under
saved-tensor hooks, as the memory estimate sizes a stage) measures each candidate segment: what
runs before the model's layer list, each layer, what runs after it. Identical layers (same class
and parameter shapes) are measured once: for that forward the others stand aside, giving back the
first one's output.
The segments are priced with the memory estimate's own functions (`estimate.price`: weights,
gradients, optimiser state, activations x the schedule's micro-batches in flight from
`schedule.device_plans.peak_stash`; `estimate.rank_remedies` for what would make it fit), the cut is
chosen by the balancer (`partition.balance.plan`) and the step time comes from the schedule
simulator (`simulate_devices`) with each stage's seconds: its FLOPs (counted on the same fake
forward) at a given rate (`flops`), or each segment timed for real on this CPU
(`measure_here`, with the transfers, the optimiser step and tied weights crossing). Each
stage sits on the device the schedule gives it (`stage_devices.owners`: one each, or
interleaved's two round-robin), one value every step above reads; the result is a `Plan`
(`planned.py`), by device.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable, Iterable, TypeVar

import torch
import torch.nn as nn

from pipetorch.errors import ConfigError
from pipetorch.schedule.plans import Batching
from pipetorch.parallel.comm.resident import MMAP_THRESHOLD
from pipetorch.parallel.worker.sharded_step import DEFAULT_MIN_ELEMENTS
from pipetorch.partition import balance
from pipetorch.planning.estimate import (
    MemoryEstimate, Remedy, Setting, StageMemory, batch_size, price, rank_remedies,
)
from pipetorch.planning.memory import (
    ZERO, Footprint, Size, backward_transient, largest, size_of, state_layout,
)
from pipetorch.planning.planned import Plan
from pipetorch.planning.segments import Piece, measure
from pipetorch.planning.timed_here import Rates, measure_here as timed
from pipetorch.planning.stage_devices import (
    SCHEDULES, default_accumulation, owners, refusal,
)
from pipetorch.schedule.device_plans import peak_stash, read_only_plan, simulate_devices

__all__ = ["Measured", "measured", "plan_measured", "TooManyStagesError"]

OPTIMIZERS = {"adamw": ("AdamW", {}), "sgd": ("SGD", {"momentum": 0.9}), "lamb": ("LAMB", {})}
METHOD = ("activations: one forward on fake tensors under saved-tensor hooks (identical layers "
          "measured once), x the schedule's micro-batches in flight; weights, gradients and "
          "optimiser state from tensor sizes and the state one optimiser step creates")

_Tensor = TypeVar("_Tensor", bound=torch.Tensor)


class TooManyStagesError(ConfigError):
    """More stages than the model has segments to give them: each stage needs one."""

    def __init__(self, stages: int, segments: list[str]) -> None:
        self.stages, self.segments = stages, segments
        super().__init__(f"{stages} stages (devices / replicas) but the model has "
                         f"{len(segments)} segments a stage may hold ({', '.join(segments)}); "
                         f"plan at most {len(segments)} stages")


@dataclass(frozen=True)
class _Run:
    """What prices a cut: each stage's device, the run's choices and the optimiser's state
    per element."""

    owners: tuple[int, ...]  # stage s on device owners[s] (`stage_devices.owners`)
    replicas: int
    accumulation: int
    setting: Setting
    layouts: dict[torch.dtype, tuple[int, int]]  # dtype -> (state bytes per element, fixed)
    min_elements: int  # weights of more elements have their state sharded (with shards > 1)

    @property
    def stages(self) -> int:
        return len(self.owners)

    @property
    def devices(self) -> int:
        return max(self.owners) + 1


def _optimizer(optimizer: str, loss_scaling: float | None
               ) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    """What makes PopTorch's `optimizer` ("adamw", "sgd" with momentum 0.9, "lamb")."""
    from pipetorch import optim

    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer {optimizer!r} is not one of {sorted(OPTIMIZERS)}")
    name, extra = OPTIMIZERS[optimizer]
    kwargs = dict(extra, **({"loss_scaling": loss_scaling} if loss_scaling else {}))
    return lambda params: getattr(optim, name)(params, lr=1e-3, **kwargs)


def _layouts(make: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
             dtypes: set[torch.dtype]) -> dict[torch.dtype, tuple[int, int]]:
    """Per parameter dtype (and its 16-bit form): the state one optimiser step creates."""
    out = {}
    for dtype in dtypes | {_half(d) for d in dtypes}:
        stand_in = nn.Parameter(torch.ones(2, dtype=dtype))
        out[dtype] = state_layout(make([stand_in]), [stand_in], None)[id(stand_in)]
    return out


def _half(dtype: torch.dtype) -> torch.dtype:
    return torch.float16 if dtype.is_floating_point and dtype.itemsize > 2 else dtype


def _state(params: list[nn.Parameter], layouts: dict[torch.dtype, tuple[int, int]]) -> Size:
    def bytes_as(pick: Callable[[torch.dtype], torch.dtype]) -> int:
        return sum(layouts[pick(p.dtype)][0] * p.numel() + layouts[pick(p.dtype)][1]
                   for p in params)
    return Size(bytes_as(lambda d: d), bytes_as(_half))


def _unique(tensors: Iterable[_Tensor]) -> list[_Tensor]:
    return list({id(t): t for t in tensors}.values())


def stage_memory(pieces: list[Piece], starts: tuple[int, ...], kind: str,
                 run: _Run) -> tuple[StageMemory, ...]:
    """Each stage's sizes for the cut `starts` (first piece of each stage) under plan kind
    `kind`, on the run's devices; a weight several stages hold (tied) is stepped on the first
    of them."""
    ends = (*starts[1:], len(pieces))
    flights = peak_stash(kind, len(starts), run.accumulation, run.owners, training=True)
    records = []
    for s, (i, j) in enumerate(zip(starts, ends, strict=True)):
        part = pieces[i:j]
        params = _unique(p for piece in part for p in piece.params)
        trainable = [p for p in params if p.requires_grad]
        steps = [p for p in _stepped(pieces, starts, s) if p.requires_grad]
        prints = [piece.footprint() for piece in part]
        footprint = Footprint(prints[0].received,
                              sum((f.saved for f in prints), ZERO)
                              + sum((f.outputs for f in prints[:-1]), ZERO), prints[-1].outputs,
                              largest(f.largest for f in prints))
        records.append(StageMemory(s, run.owners[s], size_of(params),
                                   size_of(_unique(b for piece in part for b in piece.buffers)),
                                   size_of(trainable), _state(steps, run.layouts), footprint,
                                   flights[s], _state([p for p in steps if p.numel()
                                                       <= run.min_elements], run.layouts)))
    return tuple(records)


def _segments(pieces: list[Piece], run: _Run) -> list[balance.Segment]:
    """The pieces as the balancer's cost table: FLOPs of forward and backward (as seconds:
    only their ratios matter to the cut), activations per micro-batch, and the bytes of
    weights, gradients and optimiser state priced under the run's setting."""
    setting, segments, alone = run.setting, [], dataclasses.replace(run, owners=(0,))
    for piece in pieces:
        one = stage_memory([piece], (0,), "sharded", alone)[0]
        device = price((dataclasses.replace(one, footprint=Footprint(ZERO, ZERO, ZERO)),),
                       setting)[0]
        kept = piece.footprint()
        activations = (kept.outputs if setting.recomputation else kept.saved + kept.outputs)
        segments.append(balance.Segment(piece.name, float(piece.flops * (
            4 if setting.recomputation else 3)), activations.bytes, device.total))
    return segments


def _kinds(schedule: str, devices: int, segments: int, accumulation: int,
           split: list[str] | None) -> list[str]:
    """The plan kinds to price on a pipeline of `devices` devices: `schedule`'s (refused,
    with the reason, where it cannot train), or for "auto" each that can, of the stage count
    `split` gives when it is given."""
    if schedule != "auto" and schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r} is not one of auto, {', '.join(SCHEDULES)}")
    if schedule != "auto":
        why = refusal(SCHEDULES[schedule], devices, segments, accumulation)
        if why:
            raise ValueError(f"schedule {schedule!r}: {why}")
        return [SCHEDULES[schedule] if devices > 1 else "sharded"]
    if devices == 1:
        return ["sharded"]
    able = [kind for kind in SCHEDULES.values()
            if not refusal(kind, devices, segments, accumulation)
            and (split is None or len(split) + 1 == len(owners(kind, devices)))]
    return able or ["pipelined"]  # none of the split's length: `_starts` says what to give


def _starts(pieces: list[Piece], split: list[str] | None, kind: str, run: _Run,
            budget: int | None) -> tuple[int, ...]:
    """The first piece of each stage: from the BeginBlock names in `split`, else the
    balancer's fastest cut within the budget, else the one whose fullest device is least
    full."""
    names = [p.name for p in pieces]
    if split is not None:
        if len(split) != run.stages - 1:
            per = run.stages // run.devices
            raise ValueError(f"split names {len(split)} BeginBlock places ({split}) for "
                             f"{run.stages} stages; give {run.stages - 1}, or set the devices "
                             f"and replicas so that {f'{per} x ' if per > 1 else ''}devices / "
                             "replicas = len(split) + 1")
        unknown = [n for n in split if n not in names[1:]]
        if unknown:
            raise ValueError(f"split: {unknown} do not begin a segment; the places a stage "
                             f"may begin are {names[1:]}")
        starts = (0, *(names.index(n) for n in split))
        if list(starts) != sorted(set(starts)):
            raise ValueError(f"split {split} must name places in the model's order")
        return starts
    if run.stages == 1:
        return (0,)
    segments = _segments(pieces, run)
    schedule = kind if kind != "sharded" else "pipelined"
    try:
        return balance.plan(segments, run.stages, budgets=budget, schedule=schedule,
                            micro_batches=run.accumulation, owners=run.owners).starts
    except balance.NoPlacementFits as error:
        return error.placement.starts


def _timeline(kind: str, run: _Run, forward: list[float], backward: list[float],
              step: list[float], shares: tuple[float, float] = (0.5, 0.5)
              ) -> tuple[float, float]:
    """(makespan, bubble share) of one step in seconds, from each stage's forward and backward
    seconds for one micro-batch (recomputation runs forward again in backward; zero-bubble
    splits backward into the input's gradient and the weights', `shares` of it as measured,
    but on the first stage, whose input carries no gradient: the workers run its whole
    backward as the input's part) and its optimiser step, the stages on the run's devices."""
    again = forward if run.setting.recomputation else [0.0] * run.stages
    if kind == "sharded":
        return run.accumulation * (forward[0] + backward[0] + again[0]) + step[0], 0.0
    unit = max(forward + backward) / 200 or 1.0

    def ticks(seconds: list[float]) -> tuple[int, ...]:
        return tuple(max(1, round(t / unit)) for t in seconds)

    split = kind == "zero_bubble"
    parts = [(1.0, 0.0) if s == 0 else shares for s in range(run.stages)]
    # a device steps once for all its stages, in the action named for its first one
    firsts = {d: run.owners.index(d) for d in range(run.devices)}
    stepping = [sum(t for t, d in zip(step, run.owners, strict=True) if d == own)
                if firsts[own] == s else 0.0 for s, own in enumerate(run.owners)]
    makespan, bubble = _simulated(
        kind, run.accumulation, run.owners, ticks(forward),
        ticks([b * i + a if split else b + a
               for b, a, (i, _) in zip(backward, again, parts, strict=True)]),
        ticks([b * w for b, (_, w) in zip(backward, parts, strict=True)]),
        tuple(round(t / unit) for t in stepping))
    return makespan * unit, bubble


@functools.lru_cache(maxsize=64)
def _simulated(kind: str, accumulation: int, owners: tuple[int, ...], forward: tuple[int, ...],
               backward: tuple[int, ...], weight: tuple[int, ...],
               step: tuple[int, ...]) -> tuple[int, float]:
    """(makespan, bubble share) in ticks of the device plan the workers run, kept for the
    next caller asking the same: a search's ways of saving memory mostly take the same
    time (a 32-stage plan simulates in most of a second)."""
    timeline = simulate_devices(read_only_plan(kind, len(owners), accumulation, owners, True),
                                owners, forward=forward, backward=backward, weight=weight,
                                step=step, buffered=True)
    return timeline.makespan, timeline.bubble_fraction


def _seconds(pieces: list[Piece], starts: tuple[int, ...], run: _Run, flops: float | None,
             rates: Rates | None) -> tuple[list[float], list[float], list[float]] | None:
    """Each stage's forward and backward seconds for one micro-batch and its optimiser step's:
    measured here (each piece timed, a received value's and gradient's transfer as two copies,
    the step per element, a tied weight's gradient and value all-reduced, and with replicas
    each stage's gradients all-reduced between them, or with sharded state reduced and its
    slice of the weights sent to the others, each replica stepping its slice; computing
    slowed as `rates.crowding` says where the workers outnumber the cores), else its FLOPs
    at `flops` with backward twice the forward; None without a rate."""
    ends = (*starts[1:], len(pieces))
    spans = list(zip(starts, ends, strict=True))
    if rates is None:
        if not flops:
            return None
        forward = [sum(p.flops for p in pieces[i:j]) / flops for i, j in spans]
        return forward, [2 * f for f in forward], [0.0] * len(spans)
    copy = [2 * (pieces[i].footprint().received.bytes if i else 0) / rates.copy_rate
            for i, _ in spans]
    slow = rates.crowding
    forward = [slow * sum(rates.seconds[k][0] for k in range(i, j)) + c
               for (i, j), c in zip(spans, copy, strict=True)]
    backward = [slow * sum(rates.seconds[k][1] for k in range(i, j)) + c
                for (i, j), c in zip(spans, copy[1:] + [0.0], strict=True)]
    held = [{id(p): p for piece in pieces[i:j] for p in piece.params} for i, j in spans]
    tied = {k for s, h in enumerate(held) for k in h if any(k in o for o in held[s + 1:])}
    # a tied weight: its gradient summed and its stepped value shared, two all-reduces
    replicas, sharded = run.replicas, run.setting.shards > 1
    trained = [[p for p in _stepped(pieces, starts, s) if p.requires_grad]
               for s in range(len(spans))]
    # between replicas: a ring all-reduce moves 2 (R - 1) / R of the gradients (what the
    # two-worker rate measured, R = 2, moves once); sharded, each replica's slice of the
    # stepped weights goes to the others as well, (R - 1) / R of them
    ring = 2 * (replicas - 1) / replicas if replicas > 1 else 0.0
    shared = (replicas - 1) / replicas if sharded else 0.0
    step = [slow * sum(p.numel() for p in mine) * rates.step_per_element
            / (replicas if sharded else 1)
            + (ring + shared) * sum(p.numel() * p.element_size() for p in mine)
            / rates.all_reduce_rate
            + 2 * sum(p.numel() * p.element_size() for k, p in h.items() if k in tied)
            / rates.all_reduce_rate for mine, h in zip(trained, held, strict=True)]
    return forward, backward, step


@dataclass(frozen=True)
class Measured:
    """What every plan of one model shares: its pieces (one fake forward), a micro-batch's
    samples, the optimiser's state per element and the rates (`measure_here`) or `flops`."""

    model: str                       # the model's class
    pieces: list[Piece]
    micro_batch: int | None
    layouts: dict[torch.dtype, tuple[int, int]]
    rates: Rates | None
    flops: float | None
    host_weights: int


def measured(model: nn.Module, inputs: tuple[tuple, dict], *, workers: int, stages: int = 1,
             flops: float | None = None, optimizer: str = "adamw",
             loss_scaling: float | None = None, measure_here: bool = False,
             flash_attention: bool = False) -> Measured:
    """`model` measured once for its plans on `workers` devices (see `plan`);
    TooManyStagesError before any timing when it has fewer pieces than `stages`."""
    pieces = measure(model, inputs, flash=flash_attention)
    if stages > len(pieces):
        raise TooManyStagesError(stages, [p.name for p in pieces])
    make = _optimizer(optimizer, loss_scaling)
    rates = timed(model, pieces, inputs, make, workers) if measure_here else None
    return Measured(type(model).__name__, pieces, batch_size(*inputs),
                    _layouts(make, {p.dtype for p in model.parameters()}), rates, flops,
                    size_of(_unique(model.parameters())).bytes)


def plan_measured(found: Measured, *, devices: int, replicas: int, device_memory: int | None,
                  accumulation: int | None, recompute: bool, offload: bool, sharded: bool,
                  schedule: str, split: list[str] | None = None,
                  min_elements: int = DEFAULT_MIN_ELEMENTS, remedies: bool = True) -> Plan:
    """The plan of a model already `measured` on `replicas` pipelines of `devices` devices
    (the arguments as `plan.plan` describes them); `remedies` False: none ranked for a plan
    over budget."""
    pieces, rates, flops = found.pieces, found.rates, found.flops
    setting = Setting(True, recompute, offload, shards=replicas if sharded else 1)
    accumulation = accumulation or default_accumulation(SCHEDULES.get(schedule, "pipelined"),
                                                        devices)
    overhead = rates.overhead if rates else 0
    budget = None if device_memory is None else device_memory - overhead
    options = []
    for kind in _kinds(schedule, devices, len(pieces), accumulation, split):
        run = _Run(owners(kind, devices), replicas, accumulation, setting, found.layouts,
                   min_elements)
        starts = _starts(pieces, split, kind, run, budget)
        records = stage_memory(pieces, starts, kind, run)
        devices_memory = price(records, setting)
        seconds = _seconds(pieces, starts, run, flops, rates)
        span, bubble = (_timeline(kind, run, *seconds, shares=rates.split if rates else (0.5, 0.5))
                        if seconds else (None, 0.0))
        worst = max(d.total for d in devices_memory.values())
        options.append((budget is not None and worst > budget, span or 0.0, kind, run, starts,
                        records, devices_memory, bubble))
    over, span, kind, run, starts, records, devices_memory, bubble = min(
        options, key=lambda o: (o[0], o[1] if not o[0] else max(d.total for d in o[6].values())))
    estimate = MemoryEstimate(devices_memory, records, setting, run.stages > 1,
                              Batching(1, run.accumulation, replicas), found.micro_batch,
                              METHOD, kind)
    ranked: tuple[Remedy, ...] = ()
    if over and budget is not None and remedies:
        worst = max(devices_memory, key=lambda d: devices_memory[d].total)
        ranked = tuple(rank_remedies(estimate, {d: budget for d in devices_memory}, worst))
    ends = (*starts[1:], len(pieces))
    return Plan(estimate, tuple(pieces[i].name if j - i == 1 else
                                f"{pieces[i].name} .. {pieces[j - 1].name}"
                                for i, j in zip(starts, ends, strict=True)),
                tuple(pieces[i].name for i in starts[1:]),
                {v: k for k, v in SCHEDULES.items()}.get(kind, "none"), replicas,
                run.accumulation, device_memory, overhead,
                _temporaries(pieces, starts, run.owners) if rates else {}, ranked,
                span if flops or rates else None, bubble, _time_method(flops, rates),
                found.host_weights, found.model,
                _transients(records, recompute) if rates else {},
                _heap(pieces, starts, records, recompute) if rates else {})


def _temporaries(pieces: list[Piece], starts: tuple[int, ...],
                 owners: tuple[int, ...]) -> dict[int, int]:
    """Per device (stage s on `owners[s]`), what a CPU worker's optimiser step adds at its
    peak: torch steps one parameter at a time on a CPU, with two temporaries of its size
    (AdamW's square root of the second moment and the quotient), and a tied weight's gradient
    and value cross between its devices whole: two of the device's largest parameter."""
    ends = (*starts[1:], len(pieces))
    stages = {s: 2 * max((p.numel() * p.element_size() for piece in pieces[i:j]
                          for p in piece.params), default=0)
              for s, (i, j) in enumerate(zip(starts, ends, strict=True))}
    return {d: max(t for s, t in stages.items() if owners[s] == d)
            for d in sorted(set(owners))}


def _transients(records: tuple[StageMemory, ...], recompute: bool) -> dict[int, int]:
    """Per device, its fullest stage's backward transient (`memory.backward_transient`): one
    backward runs at a time on a device."""
    out: dict[int, int] = {}
    for record in records:
        extra = backward_transient(record.footprint, recomputation=recompute).bytes
        out[record.ipu] = max(out.get(record.ipu, 0), extra)
    return out


def _heap(pieces: list[Piece], starts: tuple[int, ...], records: tuple[StageMemory, ...],
          recompute: bool) -> dict[int, int]:
    """Per device, what a CPU worker's heap holds beyond the tensors alive at its peak: the
    activations in flight that glibc serves from its heap (tensors under its mmap threshold;
    larger ones are mapped apart and unmapped when freed) once more. Backward makes each such
    tensor's gradient before it frees the tensor, and a worker keeps freed heap memory
    (`resident.reuse_freed`: trimmed only past 1 GiB), so the heap settles at about twice
    them; the optimiser step's state and temporaries come on top. Measured on this CPU over
    GPT-2, Llama, BERT and T5 stages (2026-12-07, `benchmarks/plan_configs.py`): without it
    the first stages were 5-16% low; with it 18 of 20 workers are within 3.8% (not the first
    stages under recomputation, -10%, and of an uneven split, -5 to -7%)."""
    ends = (*starts[1:], len(pieces))
    out: dict[int, int] = {}
    for record, i, j in zip(records, starts, ends, strict=True):
        small = sum(piece.small(MMAP_THRESHOLD) for piece in pieces[i:j])
        out[record.ipu] = out.get(record.ipu, 0) + small * (1 if recompute else record.in_flight)
    return out


def _stepped(pieces: list[Piece], starts: tuple[int, ...], stage: int) -> list[nn.Parameter]:
    """The parameters stage `stage` steps: its own, less those an earlier stage holds."""
    ends = (*starts[1:], len(pieces))
    earlier = {id(p) for piece in pieces[:starts[stage]] for p in piece.params}
    return [p for p in _unique(p for piece in pieces[starts[stage]:ends[stage]]
                               for p in piece.params) if id(p) not in earlier]


def _time_method(flops: float | None, rates: Rates | None) -> str:
    if rates:
        return ("each piece's forward and backward timed on this CPU with a worker's threads "
                f"(the model run for real), transfers as two copies at {rates.copy_rate / 1e9:.3g}"
                f" GB/s, the optimiser step at {rates.step_per_element * 1e9:.2f} ns a "
                "parameter and a tied weight's gradient and value all-reduced at "
                f"{rates.all_reduce_rate / 1e9:.3g} GB/s (as the replicas' gradients), computing "
                f"{rates.crowding:.3g}x slower with more workers than cores, a zero-bubble "
                f"backward's input and weight parts {rates.split[0]:.2f} + {rates.split[1]:.2f}"
                " of a whole one, through the schedule simulator")
    if flops:
        return (f"each stage's forward FLOPs x3 (x4 recomputing) at {flops:.3g} FLOP/s a "
                "device, through the schedule simulator; the optimiser step and transfers "
                "not counted")
    return "no rate given (flops or measure_here)"
