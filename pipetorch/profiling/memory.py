"""memory.json: per device, parameters, gradients, optimiser state and stashed activations.

On the CPU nothing reports allocations, so every figure is computed from tensor sizes:
parameters and buffers as they are; gradients as one tensor per trainable parameter;
optimiser state from the optimiser's state tensors (or, before the first step reached the
host copy, from the state one step creates on stand-ins of the parameters' dtypes), counted
in host memory instead of the device's when it is offloaded
(`setOptimizerLocation(useOnChipStorage(False))`); and the activations kept for backward,
found by one forward of each stage on fake tensors under saved-tensor hooks (`Footprint`):
the values the stage received, the tensors autograd saved and the values it produced, each
storage once.
At the schedule's peak a stage holds all three for each stashed micro-batch
(`schedule.simulator`' peak stash); with recomputation only what it received and produced,
plus one micro-batch's saved tensors while its backward recomputes them (`kept_bytes`).
On a GPU the peak is also measured with `torch.cuda.max_memory_allocated`, in this process or
by each stage worker over its calls.
"""
from __future__ import annotations

import copy
import logging
from typing import (
    TYPE_CHECKING, Callable, Iterable, NamedTuple, Protocol, TypedDict, TypeVar, runtime_checkable,
)

import torch
import torch.nn as nn

from pipetorch.partition.split import Source
from pipetorch.profiling.summary import InWorkers, lanes_of, stage_modules

if TYPE_CHECKING:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from pipetorch.options.options import Options
    from pipetorch.partition.casting import Casting
    from pipetorch.partition.split import StagedModel
    from pipetorch.runtime.compile import Compiled
    from pipetorch.schedule.plans import Batching

__all__: list[str] = []

_Output = TypeVar("_Output")

logger = logging.getLogger(__name__)

COMPUTED = "computed from tensor sizes (no allocator statistics on the CPU)"
MEASURED = ("peak measured with torch.cuda.max_memory_allocated (on a CPU: each stage "
            "worker's resident peak, everything its process holds); the parts computed from "
            "tensor sizes")


class DeviceReport(TypedDict):
    """One device's row of memory.json, in bytes (None: not found)."""

    label: str
    stage: int | None
    ipu: int
    device: str
    parameters: int
    buffers: int
    gradients: int
    optimiser_state: int
    host_optimiser_state: int
    optimiser_location: str
    activations: int | None
    activations_per_micro_batch: int | None
    peak_stashed_micro_batches: int
    recomputation: bool
    measured_peak: int | None
    total: int


class MemoryReport(TypedDict):
    """memory.json (`build`), as written and as `recorder.load` reads it back."""

    method: str
    units: str
    optimiser_method: str
    optimiser_offload_requested: bool
    optimiser_note: str | None
    activations_method: str
    devices: list[DeviceReport]


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def optimiser_state_bytes(optimizer: torch.optim.Optimizer | None,
                          params: list[nn.Parameter], *,
                          dtype: torch.dtype | None = None) -> tuple[int, str]:
    """Bytes of `optimizer`'s state for `params`, and how they were found.

    With `dtype`, the state the optimiser would keep if every parameter had that dtype (what
    `model.half()` would make of it), from one step on stand-ins.
    """
    if optimizer is None or not params:
        return 0, "no optimiser"
    present = [p for p in params if optimizer.state.get(p)]
    if dtype is None and len(present) == len(params):
        return sum(_nbytes(v for v in optimizer.state[p].values()
                           if isinstance(v, torch.Tensor)) for p in params), "state tensors"
    try:
        per_element = state_layout(optimizer, params, dtype)
    except Exception as exc:  # an optimiser that cannot step on stand-ins: say so, guess nothing
        logger.warning("Cannot size the state of %s: %s", type(optimizer).__name__, exc)
        return 0, f"unknown ({type(optimizer).__name__} could not step on stand-ins)"
    total = 0
    for p in params:
        per_tensor, fixed = per_element[id(p)]
        total += per_tensor * p.numel() + fixed
    return total, "estimated from the state one step creates"


def state_layout(optimizer: torch.optim.Optimizer, params: list[nn.Parameter],
                  dtype: torch.dtype | None) -> dict[int, tuple[int, int]]:
    """Per parameter: (state bytes per element of the parameter, bytes of scalar state)."""
    def stand_in_for(p: nn.Parameter) -> nn.Parameter:
        return nn.Parameter(torch.ones(2, dtype=dtype or p.dtype))

    stand_ins = {id(p): stand_in_for(p) for p in params}
    everything = [p for g in optimizer.param_groups for p in g["params"]]
    memo = {id(p): stand_ins[id(p)] if id(p) in stand_ins else stand_in_for(p)
            for p in everything}
    clone = copy.deepcopy(optimizer, dict(memo))
    clone.state.clear()
    for stand_in in memo.values():
        stand_in.grad = torch.full_like(stand_in, 0.5)
    clone.step()
    layout = {}
    for key, stand_in in stand_ins.items():
        state = [v for v in clone.state.get(stand_in, {}).values() if isinstance(v, torch.Tensor)]
        per_element = sum(v.element_size() for v in state if v.numel() == stand_in.numel()
                          and v.dim() > 0)
        fixed = sum(v.numel() * v.element_size() for v in state
                    if not (v.numel() == stand_in.numel() and v.dim() > 0))
        layout[key] = (per_element, fixed)
    return layout


class Size(NamedTuple):
    """Bytes as they are, and as they would be with every float wider than 16 bits halved."""

    bytes: int
    half: int

    def __add__(self, other: object) -> "Size":
        assert isinstance(other, Size)
        return Size(self.bytes + other.bytes, self.half + other.half)

    def scaled(self, factor: int) -> "Size":
        return Size(self.bytes * factor, self.half * factor)


ZERO = Size(0, 0)


def size_of(tensors: Iterable[torch.Tensor]) -> Size:
    """The Size of some tensors (each counted whole, shared storages more than once)."""
    total = ZERO
    for t in tensors:
        total += sized(t, t.numel() * t.element_size())
    return total


def sized(tensor: torch.Tensor, nbytes: int) -> Size:
    wide = tensor.is_floating_point() and tensor.element_size() > 2
    return Size(nbytes, nbytes * 2 // tensor.element_size() if wide else nbytes)


class Footprint(NamedTuple):
    """What one micro-batch's forward leaves on its stage, each storage counted once: the
    values it received (host inputs and values from other stages), the values it produced
    (kept until their gradients come back), and the other tensors autograd saved for
    backward (weights excluded)."""

    received: Size
    saved: Size
    outputs: Size

    @property
    def total(self) -> Size:
        return self.received + self.saved + self.outputs


def measure_forward(forward: Callable[..., _Output], values: list[object],
                    weights: list[torch.Tensor], *, training: bool,
                    fake: Callable[[torch.Tensor], torch.Tensor] | None = None
                    ) -> tuple[Footprint, _Output]:
    """Run `forward(*values)` once (with gradients when `training`) and size its Footprint;
    `weights` are the module's parameters and buffers, never counted as activations.

    Tensor values are given to forward as fresh copies, as a stage worker receives them, so
    views of a larger batch count only their own bytes. With `fake` (a FakeTensorMode's
    `from_tensor`, the mode active) the values and weights are fake tensors: storages and
    saved tensors as a real run makes them, and nothing computed. Returns the Footprint and the
    output.
    """
    if fake is not None:
        values = [fake(v) if isinstance(v, torch.Tensor) else v for v in values]
        weights = [fake(w) for w in weights]
    weight_keys = {storage_key(w) for w in weights}
    values = [v.detach().clone().requires_grad_(v.requires_grad)
              if isinstance(v, torch.Tensor) else v for v in values]
    storages: dict[int, Size] = {}
    received = {storage_key(t) for t in tensors_of(values)}
    for t in tensors_of(values):
        storages.setdefault(storage_key(t), sized(t, t.untyped_storage().nbytes()))
    saved: set[int] = set()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = storage_key(tensor)
        if key not in weight_keys and key not in received:
            saved.add(key)
            storages.setdefault(key, sized(tensor, tensor.untyped_storage().nbytes()))
        return tensor

    with torch.set_grad_enabled(training), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        output = forward(*values)
    produced = set()
    for t in tensors_of(output):
        key = storage_key(t)
        if key not in weight_keys and key not in received:
            produced.add(key)
            storages.setdefault(key, sized(t, t.untyped_storage().nbytes()))
    saved -= produced  # a produced value stays for backward even when recomputing

    def total(keys: set[int]) -> Size:
        return sum((storages[k] for k in keys), ZERO)

    return Footprint(total(received), total(saved), total(produced)), output


def fake_tensors() -> FakeTensorMode:
    """A FakeTensorMode that turns the real tensors an op meets (weights) into fake ones;
    `from_tensor` of it gives the fake tensor of a real one, the same for every call."""
    from torch._subclasses.fake_tensor import FakeTensorMode  # imports sympy: only when sizing

    return FakeTensorMode(allow_non_fake_inputs=True)


def faked(mode: FakeTensorMode) -> Callable[[torch.Tensor], torch.Tensor]:
    """`mode.from_tensor` for real tensors; fake tensors (earlier stages' outputs) as they are."""
    from torch._subclasses.fake_tensor import FakeTensor

    return lambda t: t if isinstance(t, FakeTensor) else mode.from_tensor(t)


def kept_bytes(footprint: Footprint, in_flight: int, *, training: bool,
               recomputation: bool) -> tuple[Size, Size]:
    """(activations, received values) a stage holds at its peak with `in_flight` micro-batches
    awaiting backward. Inference keeps one micro-batch's inputs and nothing for backward.
    Recomputation keeps each micro-batch's inputs and outputs only, and re-creates the saved
    tensors of one micro-batch at a time during backward."""
    if not training:
        return ZERO, footprint.received
    received = footprint.received.scaled(in_flight)
    if recomputation:
        return footprint.outputs.scaled(in_flight) + footprint.saved, received
    return (footprint.saved + footprint.outputs).scaled(in_flight), received


def module_tensors(module: nn.Module) -> list[torch.Tensor]:
    """A module's parameters and buffers (model state: never counted as activations)."""
    return [*module.parameters(), *module.buffers()]


def storage_key(tensor: torch.Tensor) -> int:
    # The storage object's identity: a fake tensor's (meta) storage has no data pointer.
    return tensor.untyped_storage()._cdata


def tensors_of(value: object) -> list[torch.Tensor]:
    leaves = torch.utils._pytree.tree_leaves(value)
    return [t for t in leaves if isinstance(t, torch.Tensor)]


@runtime_checkable
class _InProcess(Protocol):
    """The engine running every stage in this process (LocalEngine): its forward and casts."""

    casting: Casting | None
    forward: Callable[..., object]


def footprints(compiled: Compiled, sample: tuple[tuple, dict]) -> list[Footprint]:
    """Each lane's Footprint for one training micro-batch (see the module doc)."""
    from pipetorch import ops
    from pipetorch.partition.probe import preserved
    from pipetorch.partition.casting import within

    engine = compiled.engine
    args, kwargs = sample
    modes = {m: m.training for m in engine.model.modules()}
    try:
        with preserved(engine.model), ops.running_on_device():
            engine.model.train(True)
            if compiled.plan.local:
                assert isinstance(engine, _InProcess)
                device = engine.input_device
                args, kwargs = torch.utils._pytree.tree_map(
                    lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, (args, kwargs))
                flat, spec = torch.utils._pytree.tree_flatten((args, kwargs))

                def whole(*leaves: object) -> object:
                    a, k = torch.utils._pytree.tree_unflatten(list(leaves), spec)
                    return engine.forward(*a, **k)

                with within(engine.casting):  # forward (and backward) cast as they run
                    return [measure_forward(whole, flat, module_tensors(engine.model),
                                            training=True)[0]]
            assert isinstance(engine, InWorkers)
            return staged_footprints(engine.staged, args, kwargs, training=True)
    finally:
        for module, mode in modes.items():
            module.training = mode


def staged_footprints(staged: StagedModel, args: tuple, kwargs: dict, *,
                      training: bool) -> list[Footprint]:
    """Each stage's Footprint, running the captured stages in order on fake tensors of one
    micro-batch: nothing is computed and no graph holds real memory. A stage receives the
    host inputs it reads and the bundle from the stage before it, which holds the values it
    relays (`parallel.layout.routes`) as well as those it reads. Raises what fake tensors raise on a
    graph they cannot run (an op without a fake kernel)."""
    from pipetorch.parallel.layout.routes import routes_of

    with fake_tensors() as mode:
        fake = faked(mode)
        inputs = staged.flatten_inputs(*args, **kwargs)
        produced: dict[Source, object] = {}
        result = []
        for j, (module, io, route) in enumerate(zip(staged.modules, staged.io,
                                                    routes_of(staged), strict=True)):
            values = [inputs[s[1]] if s.kind == "input" else produced[s] for s in io.inputs]
            relayed = [produced[s] for s in route.receive if s not in io.inputs]
            footprint, outputs = measure_forward(lambda *v, m=module: m(*v), values,
                                                 module_tensors(module), training=training,
                                                 fake=fake)
            extra = size_of(tensors_of(relayed))
            result.append(footprint._replace(received=footprint.received + extra))
            for k, value in enumerate(outputs):
                produced[Source.stage(j, k)] = value
    return result


def replica_plan_length(batching: Batching, *, training: bool) -> int:
    """Micro-batches one run of a replica's plan covers: G (training) or D (inference)."""
    return batching.gradient_accumulation if training else batching.device_iterations


def stash_per_lane(compiled: Compiled, *, training: bool) -> list[int]:
    """Most micro-batches each lane holds for backward at once: the plan's in-flight count
    (`CompilePlan.in_flight`) for the schedule its engine runs now."""
    engine = compiled.engine
    per_plan = replica_plan_length(engine.batching, training=training)
    return list(compiled.plan.in_flight(per_plan, training=training, schedule=engine.schedule))


def _in_this_process_cuda(compiled: Compiled) -> torch.device | None:
    """The GPU the local engine runs on, when it runs on one (workers' GPUs are elsewhere)."""
    device = getattr(compiled.engine, "input_device", None)
    if not compiled.plan.local or device is None or device.type != "cuda":
        return None
    return device if torch.cuda.is_available() and torch.cuda.is_initialized() else None


def reset_peak(compiled: Compiled) -> None:
    """Start the CUDA allocator's peak afresh, so it covers the profiled calls only."""
    device = _in_this_process_cuda(compiled)
    if device is not None:
        torch.cuda.reset_peak_memory_stats(device)


def measured_peak(compiled: Compiled) -> int | None:
    """The CUDA allocator's peak on the local engine's GPU; None on the CPU or in workers."""
    device = _in_this_process_cuda(compiled)
    return None if device is None else int(torch.cuda.max_memory_allocated(device))


def offloaded(options: Options) -> bool:
    """Whether the options keep the optimiser state in host memory."""
    location = getattr(getattr(options, "TensorLocations", None), "optimizer_location", None)
    return location is not None and location.use_on_chip_storage is False


def sharded_above(options: Options) -> int | None:
    """With replicated tensor sharding (TensorLocations.setOptimizerLocation(
    ...useReplicatedTensorSharding(True))), the most elements of a weight whose optimiser state
    stays whole (minElementsForReplicatedTensorSharding, unset: PopART's 8192); else None."""
    from pipetorch.parallel.worker.sharded_step import DEFAULT_MIN_ELEMENTS

    location = getattr(getattr(options, "TensorLocations", None), "optimizer_location", None)
    if location is None or not location.use_replicated_tensor_sharding:
        return None
    found = location.min_elements_for_replicated_tensor_sharding
    return DEFAULT_MIN_ELEMENTS if found is None else found


def per_replica(state: int, whole: int, shards: int) -> int:
    """Optimiser state bytes one of `shards` replicas keeps with replicated tensor sharding:
    `whole` (the state of the weights too small to shard) whole, 1/R of the rest."""
    return whole + -(-(state - whole) // shards)


def recomputing(options: Options) -> bool:
    """Whether the options checkpoint every stage's activations (Training.recomputation)."""
    return bool(getattr(getattr(options, "Training", None), "recomputation", False))


def build(compiled: Compiled, *, training: bool, options: Options,
          sample: tuple[tuple, dict] | None) -> MemoryReport:
    """The content of memory.json."""
    engine = compiled.engine
    peak = measured_peak(compiled)  # before the sizing forward below adds to it
    lanes = lanes_of(compiled)
    modules = stage_modules(compiled) or [engine.model]
    held = stash_per_lane(compiled, training=training)
    recomputation = training and recomputing(options)
    prints: list[Footprint | None] = [None] * len(lanes)
    if not training:
        activations_method = "inference keeps no activations for backward"
    elif sample is None:
        activations_method = "not computed: the profiler was given no sample micro-batch"
    else:
        activations_method = (
            "measured: the tensors one micro-batch's forward receives, saves for backward and "
            "produces (stage workers' stages run on fake tensors), x the schedule's peak "
            "stashed micro-batches" + (
                "; with recomputation only the received and produced ones are stashed, plus "
                "one micro-batch's saved tensors recomputed during its backward"
                if recomputation else ""))
        try:
            prints = list(footprints(compiled, sample))
        except Exception as exc:  # a report without activations beats no report at exit
            logger.warning("Sizing the stashed activations failed: %s: %s",
                           type(exc).__name__, exc)
            activations_method = (f"not computed: the sizing forward failed with "
                                  f"{type(exc).__name__}: {exc}")
    offload = training and offloaded(options)
    least = sharded_above(options)
    shards = engine.batching.replication_factor if least is not None else 1
    devices: list[DeviceReport] = []
    methods = set()
    for lane, module, stashed, footprint in zip(lanes, modules, held, prints, strict=True):
        params = [p for p in module.parameters() if p.requires_grad]
        optimizer = engine.optimizer if training else None
        state, how = optimiser_state_bytes(optimizer, params)
        if shards > 1 and least is not None:
            state = per_replica(state, optimiser_state_bytes(
                optimizer, [p for p in params if p.numel() <= least])[0], shards)
        methods.add(how)
        activations = None
        if footprint is not None or not training:
            kept, received = kept_bytes(footprint or Footprint(ZERO, ZERO, ZERO), stashed,
                                        training=training, recomputation=recomputation)
            activations = kept.bytes + received.bytes
        row: DeviceReport = {
            "label": lane.label, "stage": lane.stage, "ipu": lane.ipu, "device": lane.device,
            "parameters": _nbytes(module.parameters()),
            "buffers": _nbytes(module.buffers()),
            "gradients": _nbytes(params) if training else 0,
            "optimiser_state": 0 if offload else state,
            "host_optimiser_state": state if offload else 0,
            "optimiser_location": "host" if offload else "device",
            "activations": activations,
            "activations_per_micro_batch": (
                None if footprint is None else footprint.total.bytes) if training else 0,
            "peak_stashed_micro_batches": stashed,
            "recomputation": recomputation,
            # this process's GPU, else the stage worker's (the worst replica's) peak: its
            # GPU's allocator, or on a CPU the worker process's resident memory
            "measured_peak": peak if peak is not None else
            getattr(engine, "peak_memory", {}).get(lane.stage),
            "total": 0,
        }
        row["total"] = (row["parameters"] + row["buffers"] + row["gradients"]
                        + row["optimiser_state"] + (row["activations"] or 0))
        devices.append(row)
    measured = any(d["measured_peak"] is not None for d in devices)
    return {
        "method": MEASURED if measured else COMPUTED,
        "units": "bytes",
        "optimiser_method": "; ".join(sorted(methods)),
        "optimiser_offload_requested": offload,
        "optimiser_note": ("setOptimizerLocation(useOnChipStorage(False)): the state lives in "
                           "host memory (host_optimiser_state), outside the device's total"
                           if offload else None),
        "activations_method": activations_method,
        "devices": devices,
    }
