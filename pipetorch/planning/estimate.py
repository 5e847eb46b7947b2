"""Knowing before running: each device's peak memory, checked against a budget, with remedies.

At compile time, before any worker starts, `estimate_memory` sizes what each logical device
(ipu_id) holds at its peak: parameters, buffers, gradients, optimiser state (in host memory
when offloaded), the activations kept for backward and the values received, each x the
micro-batches in flight at the schedule's peak. Activations are found by one forward of each
captured stage on fake tensors of the first micro-batch under saved-tensor hooks
(`memory.Footprint`): the host never runs the model; everything else is computed from tensor
sizes. `check_budget` raises `OutOfMemoryError` when a device is
over, listing every device by category and the remedies ranked by what each saves on the
worst device, each computed by re-pricing this estimate:

    remedy               what changes in the estimate
    fp16 (model.half())  every float wider than 16 bits halves; optimiser state re-sized
    recomputation        a stage stashes only what it received and produced
    optimiser offload    the optimiser state moves to the host
    sharded state        each of R replicas keeps 1/R of the optimiser state (of the weights
                         over minElementsForReplicatedTensorSharding: the others keep it whole)
    smaller micro-batch  received values and activations halve (they scale with the batch)
    more stages          each stage splits in two: weights and saved tensors halve, in-flight
                         micro-batches follow the schedule on twice the stages
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn as nn

from pipetorch.errors import OutOfMemoryError
from pipetorch.parallel.worker.sharded_step import DEFAULT_MIN_ELEMENTS
from pipetorch.partition.strategies import StageSpec
from pipetorch.planning.memory import (
    ZERO, Footprint, Size, faked, fake_tensors, kept_bytes, measure_forward, module_tensors,
    optimiser_state_bytes, per_replica, replica_plan_length, size_of, staged_footprints,
)
from pipetorch.schedule.device_plans import engine_kind, owners_of, peak_stash

if TYPE_CHECKING:
    from pipetorch.partition.split import CaptureOnce
    from pipetorch.schedule.plans import Batching

__all__: list[str] = []

logger = logging.getLogger(__name__)

CATEGORIES = ("parameters", "buffers", "gradients", "optimiser_state", "activations",
              "received")
METHOD = ("activations and received values found by one forward of each stage on fake "
          "tensors of the first micro-batch, x the micro-batches in flight at the schedule's "
          "peak; the rest computed from tensor sizes")


@dataclass(frozen=True)
class StageMemory:
    """One stage's sizes (as they are and at 16 bits) and its micro-batches in flight."""

    index: int
    ipu: int
    parameters: Size
    buffers: Size
    gradients: Size
    optimiser_state: Size
    footprint: Footprint
    in_flight: int
    whole_state: Size = ZERO  # of it, the state of weights too small to shard over replicas


@dataclass(frozen=True)
class DeviceMemory:
    """One logical device's peak, in bytes by category; `host_optimiser_state` is offloaded
    state, held in host memory and outside `total`."""

    ipu: int
    stages: tuple[int, ...]
    parameters: int
    buffers: int
    gradients: int
    optimiser_state: int
    activations: int
    received: int
    host_optimiser_state: int
    in_flight: int

    @property
    def categories(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in CATEGORIES}

    @property
    def total(self) -> int:
        return sum(self.categories.values())


@dataclass(frozen=True)
class Setting:
    """The choices that decide how a StageMemory is priced."""

    training: bool
    recomputation: bool
    offload: bool
    half: bool = False
    shards: int = 1  # replicas the optimiser state is sharded over (replicated tensor sharding)


@dataclass(frozen=True)
class Remedy:
    """A change, the code applying it, what it saves on the worst device and whether it alone
    brings every device within budget. `peaks` is each device's peak after it (for more
    stages: the larger of the two devices each one becomes)."""

    name: str
    code: str
    saving: int
    fits: bool
    peaks: dict[int, int]


@dataclass(frozen=True)
class MemoryEstimate:
    """Each logical device's estimated peak (`devices`, by ipu id) and how it was found."""

    devices: dict[int, DeviceMemory]
    stages: tuple[StageMemory, ...]
    setting: Setting
    pipelined: bool
    batching: Batching
    micro_batch_size: int | None
    method: str = METHOD
    kind: str = "pipelined"  # the plan kind the workers run (schedule.device_plans.engine_kind)

    def table(self, budgets: dict[int, int] | None = None) -> str:
        """The devices by category as text, with their budgets when given."""
        host = any(d.host_optimiser_state for d in self.devices.values())
        heads = ["device", *(c.replace("_", " ") for c in CATEGORIES), "total"]
        heads += ["host optimiser"] * host + ["budget"] * (budgets is not None)
        rows = [heads]
        for ipu, device in sorted(self.devices.items()):
            row = [f"IPU {ipu}", *(fmt(v) for v in device.categories.values()), fmt(device.total)]
            row += [fmt(device.host_optimiser_state)] * host
            if budgets is not None:
                limit = budgets.get(ipu)
                row.append("-" if limit is None else fmt(limit) + (
                    f"  OVER by {fmt(device.total - limit)}" if device.total > limit else ""))
            rows.append(row)
        widths = [max(len(r[i]) for r in rows) for i in range(len(heads))]
        return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                   for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip()
                         for r in rows)


def fmt(nbytes: int) -> str:
    """Bytes for people: B, KiB, MiB or GiB."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{nbytes} B"


def estimate_memory(model: nn.Module, first: tuple[tuple, dict], stages: list[StageSpec], *,
                    batching: Batching, optimizer: torch.optim.Optimizer | None,
                    pipelined: bool, training: bool, offload: bool, recomputation: bool,
                    capture: CaptureOnce | None = None, schedule: str = "pipelined",
                    sharding: int | None = None) -> MemoryEstimate:
    """Each logical device's peak for `model` (the host copy, blocks attached) run on
    `first` (one micro-batch: args, kwargs) as `stages`; see the module doc.

    `optimizer` must update `model`'s own parameters (e.g. `device_optimizer`'s copy).
    `recomputation` means every stage keeps only its inputs and outputs for backward;
    `schedule` is the pipelined plan kind (Training.pipelineSchedule: its activation stash).
    `sharding` (RunConfig.sharding) is set with replicated tensor sharding: weights of more
    elements than it keep 1/R of their optimiser state on each of the R replicas.
    The model's train/eval modes, buffers and the RNG are left as they were. `capture`
    (split.CaptureOnce) is the compilation's capture: its split and the stages' measured
    footprints are shared with the engine and saved in the executable cache.
    """
    from pipetorch import ops
    from pipetorch.partition.probe import modes_kept, preserved

    if training and optimizer is not None:
        _check_optimizer(model, optimizer)
    args, kwargs = first
    with modes_kept(model), preserved(model), ops.running_on_device(), ops.recomputing():
        model.train(training)
        modules, ipu_of, sizing = _sizing(model, first, stages, training=training,
                                          capture=capture)
        prints, method = _footprints(sizing, len(modules))
    kind = engine_kind(pipelined, schedule)
    flights = peak_stash(kind, len(modules), replica_plan_length(batching, training=training),
                         owners_of(ipu_of), training=training)
    # a weight several devices hold is stepped on the first of them (parallel.worker.tied): its
    # optimiser state is there only
    stepper: dict[int, int] = {}
    for ipu, module in zip(ipu_of, modules, strict=True):
        for param in module.parameters():
            stepper[id(param)] = min(stepper.get(id(param), ipu), ipu)
    records = tuple(_stage_memory(j, ipu, module, footprint, flight, optimizer, training,
                                  stepped={k for k, d in stepper.items() if d == ipu},
                                  min_elements=DEFAULT_MIN_ELEMENTS if sharding is None
                                  else sharding)
                    for j, (ipu, module, footprint, flight)
                    in enumerate(zip(ipu_of, modules, prints, flights, strict=True)))
    setting = Setting(training, recomputation and training, offload and training,
                      shards=batching.replication_factor if sharding is not None else 1)
    return MemoryEstimate(price(records, setting), records, setting, pipelined, batching,
                          batch_size(args, kwargs), method, kind)


def _sizing(model: nn.Module, first: tuple[tuple, dict], stages: list[StageSpec], *,
            training: bool, capture: CaptureOnce | None
            ) -> tuple[list[nn.Module], list[int], Callable[[], list[Footprint]]]:
    """(the stages' modules, their devices, what sizes their Footprints): the whole model on
    one device, else the capture's stages (their footprints remembered by the capture)."""
    ipus = sorted({s.ipu_id for s in stages})
    args, kwargs = first
    if len(ipus) == 1:  # the stages run one after another in one process
        return [model], ipus, lambda: [_whole(model, args, kwargs, training=training)]
    from pipetorch.partition.split import CaptureOnce

    capture = capture if capture is not None else CaptureOnce(model, first)
    staged = capture.split(stages)

    def sizing() -> list[Footprint]:
        return capture.remember(("footprints", tuple(stages), training),
                                lambda: staged_footprints(staged, args, kwargs,
                                                          training=training))

    return list(staged.modules), [s.ipu_id for s in stages], sizing


def _footprints(sizing: Callable[[], list[Footprint]], count: int
                ) -> tuple[list[Footprint], str]:
    """The stages' Footprints and the estimate's method; where fake tensors cannot run a
    stage (an op without a fake kernel), no activations, said in the method and the log,
    rather than running the model on the host."""
    try:
        return sizing(), METHOD
    except Exception as error:  # noqa: BLE001 - whatever fake tensors raise
        logger.warning("Memory estimate: fake tensors could not run forward (%s: %s); "
                       "activations are not counted", type(error).__name__, error)
        return [Footprint(ZERO, ZERO, ZERO)] * count, (
            f"activations NOT counted: fake tensors could not run forward "
            f"({type(error).__name__}: {error}); the rest computed from tensor sizes")


def _check_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    trainable = [p for p in model.parameters() if p.requires_grad]
    if trainable and not any(id(p) in held for p in trainable):
        raise ValueError(
            f"estimate_memory: the {type(optimizer).__name__} holds none of the model's "
            f"{len(trainable)} trainable parameters, so its state cannot be sized; pass the "
            "optimiser that updates this model (runtime.optimizer.device_optimizer's copy)")


def _whole(model: nn.Module, args: tuple, kwargs: dict, *, training: bool) -> Footprint:
    """The Footprint of the whole model's forward, run on fake tensors."""
    flat, spec = torch.utils._pytree.tree_flatten((args, kwargs))

    def forward(*leaves: object) -> object:
        a, k = torch.utils._pytree.tree_unflatten(list(leaves), spec)
        return model(*a, **k)

    with fake_tensors() as mode:
        return measure_forward(forward, flat, module_tensors(model), training=training,
                               fake=faked(mode))[0]


def _stage_memory(index: int, ipu: int, module: nn.Module, footprint: Footprint,
                  flight: int, optimizer: torch.optim.Optimizer | None,
                  training: bool, *, stepped: set[int], min_elements: int) -> StageMemory:
    """The stage's sizes; optimiser state for the parameters its device steps (`stepped`,
    id()s), and of it the state of those of at most `min_elements` elements (never sharded
    over replicas)."""
    params = [p for p in module.parameters() if p.requires_grad]
    steps = [p for p in params if id(p) in stepped]

    def state(of: list[nn.Parameter]) -> Size:
        if not training or optimizer is None or not of:
            return ZERO
        actual, how = optimiser_state_bytes(optimizer, of)
        half, half_how = optimiser_state_bytes(optimizer, of, dtype=torch.half)
        # An optimiser that cannot step at 16 bits is priced as it is: no saving claimed.
        return Size(actual, actual if half_how.startswith("unknown") else half)

    return StageMemory(index, ipu, size_of(module.parameters()), size_of(module.buffers()),
                       size_of(params), state(steps), footprint, flight,
                       state([p for p in steps if p.numel() <= min_elements]))


def batch_size(args: tuple, kwargs: dict) -> int | None:
    """Samples in a micro-batch: the first dimension of its first tensor that has one."""
    for leaf in torch.utils._pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    return None


def price(stages: tuple[StageMemory, ...], setting: Setting) -> dict[int, DeviceMemory]:
    """Each device's peak: its stages' sizes summed, priced under `setting`."""
    rows: dict[int, dict[str, Any]] = {}
    for stage in stages:
        def pick(size: Size) -> int:
            return size.half if setting.half else size.bytes

        activations, received = kept_bytes(stage.footprint, stage.in_flight,
                                           training=setting.training,
                                           recomputation=setting.recomputation)
        state = per_replica(pick(stage.optimiser_state), pick(stage.whole_state),
                            setting.shards) if setting.training else 0
        sizes = {"parameters": pick(stage.parameters), "buffers": pick(stage.buffers),
                 "gradients": pick(stage.gradients) if setting.training else 0,
                 "optimiser_state": 0 if setting.offload else state,
                 "activations": pick(activations), "received": pick(received),
                 "host_optimiser_state": state if setting.offload else 0}
        row = rows.setdefault(stage.ipu, {"stages": (), "in_flight": 0})
        row["stages"] += (stage.index,)
        row["in_flight"] = max(row["in_flight"], stage.in_flight)
        for name, value in sizes.items():
            row[name] = row.get(name, 0) + value
    return {ipu: DeviceMemory(ipu=ipu, **row) for ipu, row in sorted(rows.items())}


def device_budget(budget: int | dict[int, int] | None, *,
                  device: torch.device) -> int | dict[int, int] | None:
    """The budget to check: the one set (`opts.memory_budget`), else a GPU's total memory
    (torch.cuda.mem_get_info), else None (the CPU: no check)."""
    if budget is not None or device.type != "cuda":
        return budget
    return int(torch.cuda.mem_get_info(device)[1])


def _budgets(budget: int | dict[int, int], devices: dict[int, DeviceMemory]) -> dict[int, int]:
    if isinstance(budget, dict):
        return {ipu: int(b) for ipu, b in budget.items() if ipu in devices}
    if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
        raise TypeError(f"check_budget: budget must be bytes (an int > 0), a dict {{ipu: "
                        f"bytes}} or None; got {budget!r} ({type(budget).__name__})")
    return {ipu: budget for ipu in devices}


class OverBudgetError(OutOfMemoryError):
    """A device's estimated peak over its budget, with what the message shows: the estimate,
    the budgets and the remedies ranked by what each saves."""

    def __init__(self, message: str, estimate: MemoryEstimate, budgets: dict[int, int],
                 remedies: list[Remedy]) -> None:
        super().__init__(message)
        self.estimate, self.budgets, self.remedies = estimate, budgets, remedies

    def __reduce__(self) -> tuple[type, tuple[str, MemoryEstimate, dict[int, int], list[Remedy]]]:
        return type(self), (self.args[0], self.estimate, self.budgets, self.remedies)


def check_budget(estimate: MemoryEstimate, budget: dict[int, int] | int | None) -> None:
    """Raise OutOfMemoryError when a device's estimated peak exceeds its budget.

    `budget` is bytes for every device, {ipu id: bytes} (devices not named are not checked)
    or None (nothing checked). The error's `estimate`, `budgets` and `remedies` attributes
    hold what its message shows.
    """
    if budget is None:
        return
    budgets = _budgets(budget, estimate.devices)
    over = {ipu: estimate.devices[ipu].total - limit for ipu, limit in budgets.items()
            if estimate.devices[ipu].total > limit}
    if not over:
        return
    worst = max(over, key=over.__getitem__)
    remedies = rank_remedies(estimate, budgets, worst)
    raise OverBudgetError(_message(estimate, budgets, worst, remedies), estimate, budgets,
                          remedies)


def rank_remedies(estimate: MemoryEstimate, budgets: dict[int, int],
                  worst: int) -> list[Remedy]:
    """The remedies that save memory on `worst`, largest saving first."""
    found = []
    for name, code, peaks in _candidates(estimate):
        saving = estimate.devices[worst].total - peaks[worst]
        if saving > 0:
            fits = all(peaks[ipu] <= limit for ipu, limit in budgets.items())
            found.append(Remedy(name, code, saving, fits, peaks))
    return sorted(found, key=lambda r: -r.saving)


def _candidates(estimate: MemoryEstimate) -> list[tuple[str, str, dict[int, int]]]:
    setting, stages, batching = estimate.setting, estimate.stages, estimate.batching

    def peaks(records: tuple[StageMemory, ...], new: Setting) -> dict[int, int]:
        return {ipu: d.total for ipu, d in price(records, new).items()}

    out = [("fp16 weights, activations and inputs",
            "model.half()  # and pass float16 inputs (e.g. images.half())",
            peaks(stages, dataclasses.replace(setting, half=True)))]
    if setting.training and not setting.recomputation:
        out.append(("recomputation: each stage keeps only its inputs and outputs",
                    "opts.Training.setRecomputation(True)",
                    peaks(stages, dataclasses.replace(setting, recomputation=True))))
    if setting.training and not setting.offload:
        out.append(("optimiser state in host memory",
                    "opts.TensorLocations.setOptimizerLocation("
                    "poptorch.TensorLocationSettings().useOnChipStorage(False))",
                    peaks(stages, dataclasses.replace(setting, offload=True))))
    replicas = batching.replication_factor
    if setting.training and replicas > 1 and setting.shards == 1 and not setting.offload:
        out.append((f"optimiser state sharded over the {replicas} replicas",
                    "opts.TensorLocations.setOptimizerLocation(poptorch.TensorLocationSettings()"
                    ".useReplicatedTensorSharding(True))",
                    peaks(stages, dataclasses.replace(setting, shards=replicas))))
    size = estimate.micro_batch_size
    if size is not None and size > 1:
        knob = (f"opts.Training.gradientAccumulation({2 * batching.gradient_accumulation})"
                if setting.training else f"opts.deviceIterations({2 * batching.device_iterations})")
        out.append((f"half the micro-batch ({size} -> {size // 2} samples)",
                    f"poptorch.DataLoader(opts, dataset, batch_size={size // 2}) with {knob} "
                    "(same samples per step)",
                    peaks(tuple(_scaled(s, _halve) for s in stages), setting)))
    out.append(_more_stages(estimate))
    return out


def _halve(size: Size) -> Size:
    return Size(size.bytes // 2, size.half // 2)


def _scaled(stage: StageMemory, batch: Callable[[Size], Size]) -> StageMemory:
    """`stage` with its per-micro-batch values changed by `batch` (received values included)."""
    footprint = Footprint(*(batch(part) for part in stage.footprint))
    return dataclasses.replace(stage, footprint=footprint)


def _more_stages(estimate: MemoryEstimate) -> tuple[str, str, dict[int, int]]:
    """Every stage split in two on two devices. Each half gets half the weights and the saved
    tensors, and (not knowing the new boundary) all of the stage's received and produced
    values; in-flight micro-batches follow the schedule on twice the stages."""
    stages, setting, batching = estimate.stages, estimate.setting, estimate.batching
    count = 2 * len(stages)
    accumulation = batching.gradient_accumulation
    if estimate.pipelined and setting.training:
        accumulation = max(accumulation, 2 * count - 1)
    flights = peak_stash(estimate.kind, count, accumulation, training=setting.training)
    halves = []
    for stage in stages:
        for part in (0, 1):
            j = 2 * stage.index + part
            halves.append(StageMemory(
                j, j, _halve(stage.parameters), _halve(stage.buffers), _halve(stage.gradients),
                _halve(stage.optimiser_state),
                stage.footprint._replace(saved=_halve(stage.footprint.saved)), flights[j],
                _halve(stage.whole_state)))
    split = price(tuple(halves), setting)
    peaks = {ipu: max(split[2 * s.index + part].total for s in stages if s.ipu == ipu
                      for part in (0, 1))
             for ipu in estimate.devices}
    devices = len({s.ipu for s in stages})
    code = (f"split the model over {2 * devices} devices: one more poptorch.BeginBlock / "
            "poptorch.Block boundary inside each stage, each on its own ipu_id")
    if accumulation != batching.gradient_accumulation:
        code += f", with opts.Training.gradientAccumulation({accumulation})"
    return f"more stages ({len(stages)} -> {count})", code, peaks


def _message(estimate: MemoryEstimate, budgets: dict[int, int], worst: int,
             remedies: list[Remedy]) -> str:
    device = estimate.devices[worst]
    over = [ipu for ipu, limit in budgets.items() if estimate.devices[ipu].total > limit]
    lines = [
        f"Out of memory: the estimated peak of IPU {worst} is {fmt(device.total)}, over its "
        f"budget of {fmt(budgets[worst])} by {fmt(device.total - budgets[worst])}"
        + (f" (devices over budget: {', '.join(f'IPU {i}' for i in over)})"
           if len(over) > 1 else "") + ".",
        "",
        estimate.table(budgets),
        "",
    ]
    if remedies:
        lines.append(f"Remedies, ranked by what each saves on IPU {worst}:")
        for rank, remedy in enumerate(remedies, 1):
            verdict = "fits on its own" if remedy.fits else "not enough on its own"
            lines.append(f"  {rank}. {remedy.name}: saves {fmt(remedy.saving)} on IPU {worst}; "
                         f"{verdict}")
            lines.append(f"       {remedy.code}")
    else:
        lines.append("No remedy known to pipetorch saves memory on this device.")
    lines += ["Or raise the budget: opts.setMemoryBudget(...) (bytes or e.g. \"16GB\").", "",
              f"Method: {estimate.method}. Savings re-price this estimate; the smaller "
              "micro-batch assumes activations scale with it, more stages an even split."]
    return "\n".join(lines)
