"""memory.json: per device, parameters, gradients, optimiser state and stashed activations.

On the CPU nothing reports allocations, so every figure is computed from tensor sizes with
the memory model (`planning.memory`): parameters and buffers as they are; gradients as one
tensor per trainable parameter; optimiser state from the optimiser's state tensors (or, before
the first step reached the host copy, from the state one step creates on stand-ins of the
parameters' dtypes), counted in host memory instead of the device's when it is offloaded
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

import logging
from typing import TYPE_CHECKING, Callable, Protocol, TypedDict, runtime_checkable

import torch

from pipetorch.planning.memory import (
    ZERO, Footprint, bytes_of, kept_bytes, measure_forward, module_tensors, offloaded,
    optimiser_state_bytes, per_replica, recomputing, replica_plan_length, sharded_above,
    staged_footprints,
)
from pipetorch.profiling.lanes import InWorkers, lanes_of, stage_modules

if TYPE_CHECKING:
    from pipetorch.options.options import Options
    from pipetorch.partition.casting import Casting
    from pipetorch.profiling.compiled import Compiled

__all__: list[str] = []

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


@runtime_checkable
class _InProcess(Protocol):
    """The engine running every stage in this process (LocalEngine): its forward and casts."""

    casting: Casting | None
    forward: Callable[..., object]


def footprints(compiled: Compiled, sample: tuple[tuple, dict]) -> list[Footprint]:
    """Each lane's Footprint for one training micro-batch (see the module doc)."""
    from pipetorch import ops
    from pipetorch.partition.probe import modes_kept, preserved
    from pipetorch.partition.casting import within

    engine = compiled.engine
    args, kwargs = sample
    with modes_kept(engine.model), preserved(engine.model), ops.running_on_device():
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
            "parameters": bytes_of(module.parameters()),
            "buffers": bytes_of(module.buffers()),
            "gradients": bytes_of(params) if training else 0,
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
