"""`plan`: each device's memory and the step time of a pipelined run, before having the machines.

The model may live on the meta device: nothing is allocated. One forward on fake tensors (under
saved-tensor hooks, as the memory estimate sizes a stage) measures each candidate segment: what
runs before the model's layer list, each layer, what runs after it. Identical layers (same class
and parameter shapes) are measured once: for that forward the others stand aside, giving back the
first one's output.
The segments are priced with the memory estimate's own functions (`estimate.price`: weights,
gradients, optimiser state, activations x the schedule's micro-batches in flight from
`schedule.devices.peak_stash`; `estimate.rank_remedies` for what would make it fit), the cut is
chosen by the balancer (`partition.balance.plan`) and the step time comes from the schedule
simulator (`simulate_devices`) with each stage's FLOPs (counted on the same fake forward)
divided by a per-device rate: given (`flops`), or measured here on the CPU.
"""
from __future__ import annotations

import copy
import dataclasses
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn

from pipetorch.errors import OutOfMemoryError
from pipetorch.parallel.local import Batching
from pipetorch.partition import balance
from pipetorch.profiling.estimate import (
    MemoryEstimate, Remedy, Setting, StageMemory, fmt, price, rank_remedies,
)
from pipetorch.profiling.memory import (
    ZERO, Footprint, Size, fake_tensors, faked, module_tensors, size_of, sized, state_layout,
    storage_key, tensors_of,
)
from pipetorch.schedule.devices import device_plan, peak_stash, simulate_devices

__all__ = ["plan", "Plan"]

OPTIMIZERS = {"adamw": ("AdamW", {}), "sgd": ("SGD", {"momentum": 0.9}), "lamb": ("LAMB", {})}
SCHEDULES = {"1f1b": "pipelined", "zero_bubble": "zero_bubble"}
METHOD = ("activations: one forward on fake tensors under saved-tensor hooks (identical layers "
          "measured once), x the schedule's micro-batches in flight; weights, gradients and "
          "optimiser state from tensor sizes and the state one optimiser step creates")


@dataclass(eq=False)
class Piece:
    """A candidate segment: what one forward leaves on it, its forward FLOPs, its tensors."""

    name: str
    params: list[nn.Parameter] = field(default_factory=list)
    buffers: list[torch.Tensor] = field(default_factory=list)
    received: dict[int, Size] = field(default_factory=dict)
    saved: dict[int, Size] = field(default_factory=dict)
    outputs: dict[int, Size] = field(default_factory=dict)
    flops: int = 0

    def footprint(self) -> Footprint:
        kept = {k: v for k, v in self.saved.items()
                if k not in self.received and k not in self.outputs}
        return Footprint(*(sum(d.values(), ZERO) for d in (self.received, kept, self.outputs)))


@dataclass(frozen=True)
class Plan:
    """The planned run: its cut, schedule, each device's memory and the step time."""

    estimate: MemoryEstimate
    names: tuple[str, ...]           # each stage's first and last segment, "first .. last"
    cut: tuple[str, ...]             # the BeginBlock names where stages 1.. begin
    schedule: str                    # "1f1b", "zero_bubble", or "none" (one stage)
    replicas: int
    accumulation: int
    budget: int | None               # bytes per device
    overhead: int                    # bytes per worker process outside the model (measured here)
    remedies: tuple[Remedy, ...]
    step_seconds: float | None
    bubble: float
    time_method: str
    host_weights: int

    @property
    def peaks(self) -> dict[int, int]:
        return {ipu: d.total + self.overhead for ipu, d in self.estimate.devices.items()}

    @property
    def fits(self) -> bool | None:
        return None if self.budget is None else max(self.peaks.values()) <= self.budget

    def to_json(self) -> dict[str, Any]:
        """The plan as a JSON-ready dict (bytes and seconds)."""
        devices = [{"stage": ipu, "segments": self.names[ipu], **d.categories,
                    "host_optimiser_state": d.host_optimiser_state, "in_flight": d.in_flight,
                    "process": self.overhead, "peak": self.peaks[ipu],
                    "fits": None if self.budget is None else self.peaks[ipu] <= self.budget}
                   for ipu, d in self.estimate.devices.items()]
        return {"schedule": self.schedule, "stages": len(devices), "replicas": self.replicas,
                "accumulation": self.accumulation, "cut": list(self.cut),
                "budget": self.budget, "fits": self.fits, "devices": devices,
                "host": {"weights": self.host_weights, "optimiser_state": sum(
                    d.host_optimiser_state for d in self.estimate.devices.values())},
                "step_seconds": self.step_seconds, "bubble": self.bubble,
                "time_method": self.time_method, "method": self.estimate.method,
                "remedies": [{"name": r.name, "code": r.code, "saving": r.saving,
                              "fits": r.fits} for r in self.remedies]}

    def table(self) -> str:
        """The plan as text: one row per device, then the cut, the step time, the remedies."""
        heads = ["stage", "weights", "gradients", "optimiser", "activations", "in flight",
                 "peak", "fits", "segments"]
        rows = [heads]
        for ipu, d in self.estimate.devices.items():
            fits = "-" if self.budget is None else (
                "yes" if self.peaks[ipu] <= self.budget else
                f"NO (+{fmt(self.peaks[ipu] - self.budget)})")
            rows.append([str(ipu), fmt(d.parameters + d.buffers), fmt(d.gradients),
                         fmt(d.optimiser_state) + (f" (+{fmt(d.host_optimiser_state)} host)"
                                                   if d.host_optimiser_state else ""),
                         fmt(d.activations + d.received), str(d.in_flight),
                         fmt(self.peaks[ipu]), fits, self.names[ipu]])
        widths = [max(len(r[i]) for r in rows) for i in range(len(heads))]
        lines = ["  ".join(c.rjust(w) if 0 < i < len(heads) - 1 else c.ljust(w)
                           for i, (c, w) in enumerate(zip(r, widths))).rstrip() for r in rows]
        lines.append(f"schedule {self.schedule}, {len(rows) - 1} stages x {self.replicas} "
                     f"replicas, gradient accumulation {self.accumulation}; cut: "
                     + (", ".join(self.cut) or "none"))
        if self.overhead:
            lines.append(f"peaks include {fmt(self.overhead)} per worker process outside the "
                         "model (an interpreter with torch, measured here)")
        if self.budget is not None:
            lines.append(f"budget {fmt(self.budget)} per device: "
                         + ("fits" if self.fits else "does NOT fit"))
        if self.step_seconds is not None:
            lines.append(f"predicted step: {self.step_seconds:.3f} s (bubble "
                         f"{self.bubble:.0%}; {self.time_method})")
        for rank, r in enumerate(self.remedies, 1):
            if rank == 1:
                lines.append("what would make it fit, by what each saves on the fullest device:")
            lines.append(f"  {rank}. {r.name}: saves {fmt(r.saving)}; "
                         + ("fits on its own" if r.fits else "not enough on its own"))
            lines.append(f"       {r.code}")
        return "\n".join(lines)


def _layer_list(model: nn.Module) -> tuple[str, nn.ModuleList | None]:
    """The ModuleList holding the most parameters (the layers), with its path."""
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        return "", None
    return max(lists, key=lambda nm: sum(p.numel() for p in nm[1].parameters()))


def _signature(module: nn.Module) -> tuple:
    return (type(module).__name__,
            tuple((n, tuple(t.shape), t.dtype) for n, t in module.state_dict().items()))


class _FlashAttention(torch.autograd.Function):
    """What flash attention keeps for backward: q, k, v, the output and one float32 log-sum-exp
    per query and head, never the scores."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = q.new_empty((*q.shape[:-1], v.shape[-1]))
        ctx.save_for_backward(q, k, v, out, q.new_empty(q.shape[:-1], dtype=torch.float32))
        return out


def measure(model: nn.Module, inputs: tuple[tuple, dict], *, training: bool = True,
            flash: bool = False) -> tuple[list[Piece], dict[str, Any]]:
    """The candidate segments of `model` run on one micro-batch `inputs` (args, kwargs), and
    the first layer's inputs as (shape, dtype) leaves (to time it for real on this machine).
    With `flash`, scaled_dot_product_attention keeps what flash attention keeps (a GPU's
    kernel; on the meta device it would run the math one, which keeps the scores)."""
    from torch.utils.flop_counter import FlopCounterMode

    from pipetorch import ops

    path, layers = _layer_list(model)
    units = ([(f"{path}.{i}", u) for i, u in enumerate(layers)] if layers is not None
             else list(model.named_children()))
    same = layers is not None and len(units) > 1 and len({_signature(u) for _, u in units}) == 1
    run = [u for _, u in units[:1]] if same else [u for _, u in units]
    pieces = [Piece(""), *(Piece(n) for n, _ in units[:len(run)]), Piece(""), Piece("")]
    after = len(pieces) - 2  # the last: what runs between identical layers standing aside
    counter = FlopCounterMode(display=False)
    state: dict[str, Any] = {"at": 0, "flops": 0, "first": None, "stood": 0}
    seen: set[int] = set()
    names = {id(m): n for n, m in model.named_modules()}

    def flush(to: int) -> None:
        total = counter.get_total_flops()
        pieces[state["at"]].flops += total - state["flops"]
        state["flops"], state["at"] = total, to

    def enter(k: int) -> Any:
        def hook(_: nn.Module, args: tuple, kwargs: dict) -> None:
            flush(k)
            pieces[k].received.update(_sizes((args, kwargs), weights))
            if k == 1:
                state["first"] = torch.utils._pytree.tree_map(
                    lambda t: (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t,
                    (args, kwargs))
        return hook

    def leave(k: int) -> Any:
        def hook(_: nn.Module, __: Any, output: Any) -> None:
            pieces[k].outputs.update(_sizes(output, weights))
            state["again"] = output
            flush(k if k < len(units) else after)  # code between layers: the one before
        return hook

    def stood_in() -> None:  # an identical layer's turn: what runs until the next is not priced
        state["stood"] += 1
        flush(after if state["stood"] == len(units) - 1 else after + 1)

    def touched(module: nn.Module, *_: Any) -> None:
        at = pieces[state["at"]]
        if state["at"] in (0, after) and id(module) not in seen | inside:
            seen.add(id(module))
            at.name = at.name or names[id(module)]
            at.params += list(module.parameters(recurse=False))
            at.buffers += list(module.buffers(recurse=False))

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = storage_key(tensor)
        if key not in weights:
            pieces[state["at"]].saved.setdefault(key, sized(tensor, tensor.untyped_storage().nbytes()))
        return tensor

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *_: Any,
                  **__: Any) -> torch.Tensor:
        pieces[state["at"]].flops += 4 * q.numel() * k.shape[-2]  # QK^T and PV, as counted
        return _FlashAttention.apply(q, k, v)

    sdpa = nn.functional.scaled_dot_product_attention
    inside = {id(m) for unit in run for m in unit.modules()}
    handles = [h for k, unit in enumerate(run, 1)
               for h in (unit.register_forward_pre_hook(enter(k), with_kwargs=True),
                         unit.register_forward_hook(leave(k)))]
    handles += [m.register_forward_pre_hook(touched) for m in model.modules()
                if m._parameters or m._buffers]
    modes = {m: m.training for m in model.modules()}
    again = _Again(state, stood_in)
    try:
        for key in list(layers._modules)[1:] if same else ():
            layers._modules[key] = again  # the model's own indexing and slicing still work
        if flash:
            nn.functional.scaled_dot_product_attention = attention
        model.train(training)
        with fake_tensors() as mode, ops.running_on_device():
            fake = faked(mode)
            # the fake weights are held (a freed storage's key is reused), and their real
            # (meta) tensors' keys kept too: a meta weight may reach an op as it is
            held = [(w, fake(w)) for w in module_tensors(model)]
            weights = {storage_key(t) for pair in held for t in pair}
            args, kwargs = torch.utils._pytree.tree_map(
                lambda t: fake(t) if isinstance(t, torch.Tensor) else t, inputs)
            pieces[0].received.update(_sizes((args, kwargs), weights))
            with torch.set_grad_enabled(training), counter, \
                    torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                output = model(*args, **kwargs)
            flush(after)
            pieces[after].outputs.update(_sizes(output, weights))
    finally:
        nn.functional.scaled_dot_product_attention = sdpa
        for key, (_, unit) in zip(list(layers._modules)[1:] if same else (), units[1:]):
            layers._modules[key] = unit
        for h in handles:
            h.remove()
        for module, was in modes.items():
            module.training = was
    pieces.pop()  # between identical layers standing aside
    middle = pieces[1:-1]
    if same:  # the other identical layers: the first one's sizes, their own tensors
        middle = [dataclasses.replace(middle[0], name=n) for n, _ in units]
    for piece, (_, unit) in zip(middle, units):
        piece.params, piece.buffers = list(unit.parameters()), list(unit.buffers())
    pieces = [pieces[0], *middle, pieces[-1]]
    if middle:
        pieces[0].outputs = dict(middle[0].received)
        pieces[-1].received = dict(middle[-1].outputs)
    owned = {id(p) for piece in pieces for p in piece.params}
    pieces[0].params += [p for p in model.parameters() if id(p) not in owned]  # never run
    for piece, default in ((pieces[0], "(before the layers)"), (pieces[-1], "(after them)")):
        piece.name = piece.name or default
    mids = {id(m) for m in middle}
    kept = [p for p in pieces if p.params or p.saved or p.flops or id(p) in mids]
    return kept, state["first"] or {}


class _Again(nn.Module):
    """Stands in for an identical layer while measuring: gives back the first layer's output
    (the same shapes), so the layer list is run once whatever way forward walks it."""

    def __init__(self, state: dict[str, Any], turn: Callable[[], None]) -> None:
        super().__init__()
        self.state, self.turn = state, turn

    def forward(self, *_: Any, **__: Any) -> Any:
        self.turn()
        return self.state["again"]


def _sizes(value: Any, weights: set[int]) -> dict[int, Size]:
    return {storage_key(t): sized(t, t.untyped_storage().nbytes())
            for t in tensors_of(value) if storage_key(t) not in weights}


@dataclass(frozen=True)
class _Run:
    """What prices a cut: the run's choices and the optimiser's state per element."""

    stages: int
    replicas: int
    accumulation: int
    micro_batch: int
    setting: Setting
    layouts: dict[torch.dtype, tuple[int, int]]  # dtype -> (state bytes per element, fixed)


def _layouts(optimizer: str, loss_scaling: float | None,
             dtypes: set[torch.dtype]) -> dict[torch.dtype, tuple[int, int]]:
    """Per parameter dtype (and its 16-bit form): the state one step of `optimizer` creates."""
    from pipetorch import optim

    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer {optimizer!r} is not one of {sorted(OPTIMIZERS)}")
    name, extra = OPTIMIZERS[optimizer]
    out = {}
    for dtype in dtypes | {_half(d) for d in dtypes}:
        stand_in = nn.Parameter(torch.ones(2, dtype=dtype))
        kwargs = dict(extra, **({"loss_scaling": loss_scaling} if loss_scaling else {}))
        made = getattr(optim, name)([stand_in], lr=1e-3, **kwargs)
        out[dtype] = state_layout(made, [stand_in], None)[id(stand_in)]
    return out


def _half(dtype: torch.dtype) -> torch.dtype:
    return torch.float16 if dtype.is_floating_point and dtype.itemsize > 2 else dtype


def _state(params: list[nn.Parameter], layouts: dict[torch.dtype, tuple[int, int]]) -> Size:
    def bytes_as(pick: Any) -> int:
        return sum(layouts[pick(p.dtype)][0] * p.numel() + layouts[pick(p.dtype)][1]
                   for p in params)
    return Size(bytes_as(lambda d: d), bytes_as(_half))


def _unique(tensors: Any) -> list[Any]:
    return list({id(t): t for t in tensors}.values())


def stage_memory(pieces: list[Piece], starts: tuple[int, ...], kind: str,
                 run: _Run) -> tuple[StageMemory, ...]:
    """Each stage's sizes for the cut `starts` (first piece of each stage) under plan kind
    `kind`; a weight several stages hold (tied) is stepped on the first of them."""
    ends = (*starts[1:], len(pieces))
    flights = peak_stash(kind, len(starts), run.accumulation, training=True)
    stepped: set[int] = set()
    records = []
    for s, (i, j) in enumerate(zip(starts, ends)):
        part = pieces[i:j]
        params = _unique(p for piece in part for p in piece.params)
        trainable = [p for p in params if p.requires_grad]
        steps = [p for p in trainable if id(p) not in stepped]
        stepped |= {id(p) for p in steps}
        prints = [piece.footprint() for piece in part]
        footprint = Footprint(prints[0].received,
                              sum((f.saved for f in prints), ZERO)
                              + sum((f.outputs for f in prints[:-1]), ZERO), prints[-1].outputs)
        records.append(StageMemory(s, s, size_of(params),
                                   size_of(_unique(b for piece in part for b in piece.buffers)),
                                   size_of(trainable), _state(steps, run.layouts), footprint,
                                   flights[s]))
    return tuple(records)


def _segments(pieces: list[Piece], run: _Run) -> list[balance.Segment]:
    """The pieces as the balancer's cost table: FLOPs of forward and backward (as seconds:
    only their ratios matter to the cut), activations per micro-batch, and the bytes of
    weights, gradients and optimiser state priced under the run's setting."""
    setting, segments = run.setting, []
    for piece in pieces:
        one = stage_memory([piece], (0,), "sharded", run)[0]
        device = price((dataclasses.replace(one, footprint=Footprint(ZERO, ZERO, ZERO)),),
                       setting)[0]
        kept = piece.footprint()
        activations = (kept.outputs if setting.recomputation else kept.saved + kept.outputs)
        segments.append(balance.Segment(piece.name, float(piece.flops * (
            4 if setting.recomputation else 3)), activations.bytes, device.total))
    return segments


def _kinds(schedule: str, stages: int) -> list[str]:
    if stages == 1:
        return ["sharded"]
    if schedule == "auto":
        return list(SCHEDULES.values())
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r} is not one of auto, {', '.join(SCHEDULES)}")
    return [SCHEDULES[schedule]]


def _starts(pieces: list[Piece], split: list[str] | None, kind: str, run: _Run,
            budget: int | None) -> tuple[int, ...]:
    """The first piece of each stage: from the BeginBlock names in `split`, else the
    balancer's fastest cut within the budget, else the one whose fullest device is least
    full."""
    names = [p.name for p in pieces]
    if split is not None:
        if len(split) != run.stages - 1:
            raise ValueError(f"split names {len(split)} BeginBlock places ({split}) for "
                             f"{run.stages} stages; give {run.stages - 1}, or set the devices "
                             "and replicas so that devices / replicas = len(split) + 1")
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
                            micro_batches=run.accumulation).starts
    except OutOfMemoryError as error:
        return error.placement.starts


def _timeline(kind: str, stages: int, run: _Run, forward: list[float],
              step: float) -> tuple[float, float]:
    """(makespan, bubble share) of one step in forward-FLOP units: backward costs twice the
    forward (one more with recomputation), the optimiser step `step`."""
    if kind == "sharded":
        return run.accumulation * sum(forward) * (4 if run.setting.recomputation else 3) \
            + step, 0.0
    unit = max(forward) / 200 or 1.0
    ticks = [max(1, round(f / unit)) for f in forward]
    again = ticks if run.setting.recomputation else [0] * stages
    split = kind == "zero_bubble"
    timeline = simulate_devices(
        device_plan(kind, stages, run.accumulation, tuple(range(stages)), training=True),
        tuple(range(stages)), forward=ticks, buffered=True, step=round(step / unit),
        backward=[t + a if split else 2 * t + a for t, a in zip(ticks, again)], weight=ticks)
    return timeline.makespan * unit, timeline.bubble_fraction


@dataclass(frozen=True)
class Rates:
    """This machine's measured speed: FLOP/s of a layer's forward and backward, seconds of
    an optimiser step per parameter element, and a worker process's memory outside the
    model."""

    flops: float
    step_per_element: float
    overhead: int


def plan(model: nn.Module, inputs: tuple[tuple, dict], *, devices: int = 1,
         device_memory: int | None = None, flops: float | None = None,
         accumulation: int | None = None, replicas: int = 1, optimizer: str = "adamw",
         loss_scaling: float | None = None, recompute: bool = False, offload: bool = False,
         sharded: bool = False, schedule: str = "auto", split: list[str] | None = None,
         measure_here: bool = False, flash_attention: bool = False) -> Plan:
    """Plan training `model` (on the meta device or any other) on `devices` devices of
    `device_memory` bytes each: `replicas` pipelines of devices / replicas stages, one
    micro-batch being `inputs` (args, kwargs), `accumulation` micro-batches per step (default:
    what keeps the bubble under 10%). `split` names the BeginBlock places where stages 1..
    begin; without it the balancer chooses the cut. `schedule` is "1f1b", "zero_bubble" or
    "auto" (the faster that fits). `sharded` shards the optimiser state over the replicas
    (replicated tensor sharding), `offload` keeps it in host memory. The step time needs a
    rate: `flops` (sustained FLOP/s per device) or `measure_here` (a layer timed on this
    CPU, which also measures a worker's memory outside the model). `flash_attention` sizes
    attention as a GPU's flash kernel keeps it (`measure`)."""
    if devices < 1 or replicas < 1 or devices % replicas:
        raise ValueError(f"devices ({devices}) must be a positive multiple of replicas "
                         f"({replicas}): each replica is a pipeline of devices / replicas stages")
    stages = devices // replicas
    pieces, first = measure(model, inputs, flash=flash_attention)
    micro_batch = _batch(inputs)
    setting = Setting(True, recompute, offload, shards=replicas if sharded else 1)
    run = _Run(stages, replicas, accumulation or balance.propose_gradient_accumulation(stages),
               micro_batch or 1, setting, _layouts(
                   optimizer, loss_scaling, {p.dtype for p in model.parameters()}))
    rates = _measure_here(model, pieces, first, optimizer, stages) if measure_here else None
    overhead = rates.overhead if rates else 0
    budget = None if device_memory is None else device_memory - overhead
    rate = flops or (rates.flops if rates else None)
    options = []
    for kind in _kinds(schedule, stages):
        starts = _starts(pieces, split, kind, run, budget)
        records = stage_memory(pieces, starts, kind, run)
        devices_memory = price(records, setting)
        ends = (*starts[1:], len(pieces))
        forward = [float(sum(p.flops for p in pieces[i:j])) for i, j in zip(starts, ends)]
        step = max(sum(p.numel() for p in _stepped(pieces, starts, s))
                   for s in range(stages)) * rates.step_per_element * rate if rates else 0.0
        span, bubble = _timeline(kind, stages, run, forward, step)
        worst = max(d.total for d in devices_memory.values())
        options.append((budget is not None and worst > budget, span, kind, starts, records,
                        devices_memory, bubble))
    over, span, kind, starts, records, devices_memory, bubble = min(
        options, key=lambda o: (o[0], o[1] if not o[0] else max(d.total for d in o[5].values())))
    estimate = MemoryEstimate(devices_memory, records, setting, stages > 1,
                              Batching(1, run.accumulation, replicas), micro_batch, METHOD, kind)
    remedies: tuple[Remedy, ...] = ()
    if over:
        worst = max(devices_memory, key=lambda d: devices_memory[d].total)
        remedies = tuple(rank_remedies(estimate, {d: budget for d in devices_memory}, worst))
    ends = (*starts[1:], len(pieces))
    return Plan(estimate, tuple(pieces[i].name if j - i == 1 else
                                f"{pieces[i].name} .. {pieces[j - 1].name}"
                                for i, j in zip(starts, ends)),
                tuple(pieces[i].name for i in starts[1:]),
                {v: k for k, v in SCHEDULES.items()}.get(kind, "none"), replicas,
                run.accumulation, device_memory, overhead, remedies,
                None if rate is None else span / rate, bubble, _time_method(flops, rates),
                size_of(_unique(model.parameters())).bytes)


def _stepped(pieces: list[Piece], starts: tuple[int, ...], stage: int) -> list[nn.Parameter]:
    """The parameters stage `stage` steps: its own, less those an earlier stage holds."""
    ends = (*starts[1:], len(pieces))
    earlier = {id(p) for piece in pieces[:starts[stage]] for p in piece.params}
    return [p for p in _unique(p for piece in pieces[starts[stage]:ends[stage]]
                               for p in piece.params) if id(p) not in earlier]


def _time_method(flops: float | None, rates: Rates | None) -> str:
    if flops:
        return (f"each stage's forward FLOPs x3 (x4 recomputing) at {flops:.3g} FLOP/s a "
                "device, through the schedule simulator; the optimiser step and transfers "
                "not counted")
    if rates:
        return (f"each stage's forward FLOPs x3 (x4 recomputing) at {rates.flops:.3g} FLOP/s "
                "(a layer's forward and backward timed on this CPU) and the optimiser step "
                f"at {rates.step_per_element * 1e9:.2f} ns a parameter, through the schedule "
                "simulator")
    return "no rate given (flops or measure_here)"


def _batch(inputs: tuple[tuple, dict]) -> int | None:
    for leaf in tensors_of(inputs):
        if leaf.dim() > 0:
            return int(leaf.shape[0])
    return None


def _real(leaf: Any) -> Any:
    if not (isinstance(leaf, tuple) and len(leaf) == 2 and isinstance(leaf[1], torch.dtype)):
        return leaf
    shape, dtype = leaf
    if dtype.is_floating_point:
        return torch.randn(shape, dtype=dtype).requires_grad_()
    return torch.ones(shape, dtype=dtype) if dtype == torch.bool else torch.zeros(shape, dtype=dtype)


def _measure_here(model: nn.Module, pieces: list[Piece], first: Any, optimizer: str,
                  stages: int) -> Rates:
    """Time the first layer's forward and backward and an optimiser step on it for real on
    this CPU, with the threads a worker gets; and a worker's interpreter's resident memory."""
    from pipetorch import optim
    from pipetorch.parallel.placement import cpu_cores

    _, layers = _layer_list(model)
    if layers is None or not first:
        raise ValueError("measure_here times the first layer of the model's layer list "
                         "(a ModuleList); this model has none: give flops instead")
    layer = copy.deepcopy(layers[0])
    if any(t.is_meta for t in module_tensors(layer)):
        layer = layer.to_empty(device="cpu")
    with torch.no_grad():
        for t in module_tensors(layer):
            t.normal_(0, 0.02) if t.is_floating_point() else t.fill_(1)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, cpu_cores() // stages))
    try:
        args, kwargs = torch.utils._pytree.tree_map(_real, first, is_leaf=_is_spec)
        layer.train(True)

        def once() -> float:
            start = time.perf_counter()
            out = tensors_of(layer(*args, **kwargs))[0]
            out.float().sum().backward()
            return time.perf_counter() - start

        once()
        seconds = statistics.median(once() for _ in range(3))
        name, extra = OPTIMIZERS[optimizer]
        stepper = getattr(optim, name)(layer.parameters(), lr=1e-3, **extra)
        stepper.step()
        start = time.perf_counter()
        for _ in range(3):
            stepper.step()
        per_element = (time.perf_counter() - start) / 3 / sum(p.numel() for p in layer.parameters())
    finally:
        torch.set_num_threads(threads)
    return Rates(3 * pieces[1].flops / seconds, per_element, _worker_overhead())


def _is_spec(leaf: Any) -> bool:
    return isinstance(leaf, tuple) and len(leaf) == 2 and isinstance(leaf[1], torch.dtype)


def _worker_overhead() -> int:
    """Resident bytes of a fresh interpreter that imported what a stage worker imports."""
    code = ("import resource, torch, pipetorch.parallel.worker; "
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    return int(done.stdout.split()[-1]) * 1024
