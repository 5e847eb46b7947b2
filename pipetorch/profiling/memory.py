"""memory.json: per device, parameters, gradients, optimiser state and stashed activations.

On the CPU nothing reports allocations, so every figure is computed from tensor sizes:
parameters and buffers as they are; gradients as one tensor per trainable parameter;
optimiser state from the optimiser's state tensors (or, before the first step reached the
host copy, from the state one step creates on stand-ins of the parameters' dtypes); and the
activations kept for backward as the most micro-batches the schedule stashes on the stage
(`schedule.checks`' peak stash) times what one micro-batch's forward keeps: the tensors
autograd saves plus the values the stage received and produced, each storage counted once.
On a GPU in this process the peak is also measured with `torch.cuda.max_memory_allocated`.
"""
from __future__ import annotations

import copy
import logging
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

from pipetorch.partition.split import Source
from pipetorch.profiling.summary import is_local, lanes_of, stage_modules
from pipetorch.profiling.timing import plan_micro_batches

__all__: list[str] = []

logger = logging.getLogger(__name__)

COMPUTED = "computed from tensor sizes (no allocator statistics on the CPU)"
MEASURED = ("peak measured with torch.cuda.max_memory_allocated; the parts computed from "
            "tensor sizes")


def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def optimiser_state_bytes(optimizer: torch.optim.Optimizer | None,
                          params: list[nn.Parameter]) -> tuple[int, str]:
    """Bytes of `optimizer`'s state for `params`, and how they were found."""
    if optimizer is None or not params:
        return 0, "no optimiser"
    present = [p for p in params if optimizer.state.get(p)]
    if len(present) == len(params):
        return sum(_nbytes(v for v in optimizer.state[p].values()
                           if isinstance(v, torch.Tensor)) for p in params), "state tensors"
    try:
        per_element = _state_layout(optimizer, params)
    except Exception as exc:  # an optimiser that cannot step on stand-ins: say so, guess nothing
        logger.warning("Cannot size the state of %s: %s", type(optimizer).__name__, exc)
        return 0, f"unknown ({type(optimizer).__name__} could not step on stand-ins)"
    total = 0
    for p in params:
        per_tensor, fixed = per_element[id(p)]
        total += per_tensor * p.numel() + fixed
    return total, "estimated from the state one step creates"


def _state_layout(optimizer: torch.optim.Optimizer,
                  params: list[nn.Parameter]) -> dict[int, tuple[int, int]]:
    """Per parameter: (state bytes per element of the parameter, bytes of scalar state)."""
    stand_ins = {id(p): nn.Parameter(torch.ones(2, dtype=p.dtype)) for p in params}
    everything = [p for g in optimizer.param_groups for p in g["params"]]
    memo = {id(p): stand_ins.get(id(p), nn.Parameter(torch.ones(2, dtype=p.dtype)))
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


@contextmanager
def _saving(parameters: set[int]) -> Iterator[Callable[[list[torch.Tensor]], int]]:
    """Collects the tensors autograd saves for backward (not the weights); yields a counter of
    those plus any other tensors given. Views of one storage count once, as the largest."""
    storages: dict[int, int] = {}

    def note(tensor: torch.Tensor) -> None:
        key = tensor.untyped_storage().data_ptr()
        if key not in parameters:
            storages[key] = max(storages.get(key, 0), tensor.numel() * tensor.element_size())

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        note(tensor)
        return tensor

    def total(extra: list[torch.Tensor]) -> int:
        for tensor in extra:
            note(tensor)
        return sum(storages.values())

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield total


def _weights(module: nn.Module) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in [*module.parameters(), *module.buffers()]}


def _tensors(value: Any) -> list[torch.Tensor]:
    leaves = torch.utils._pytree.tree_leaves(value)
    return [t for t in leaves if isinstance(t, torch.Tensor)]


def stashed_per_micro_batch(compiled: Any, sample: tuple[tuple, dict]) -> list[int]:
    """Bytes one micro-batch's forward keeps for its backward, per lane (see the module doc)."""
    from pipetorch import ops
    from pipetorch.runtime.capture import preserved

    engine = compiled.engine
    args, kwargs = sample
    modes = {m: m.training for m in engine.model.modules()}
    try:
        with preserved(engine.model), torch.enable_grad(), ops.running_on_device():
            engine.model.train(True)
            if is_local(engine):
                device = engine.input_device
                args, kwargs = torch.utils._pytree.tree_map(
                    lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, (args, kwargs))
                with _saving(_weights(engine.model)) as total:
                    output = engine.forward(*args, **kwargs)
                    return [total(_tensors(output))]
            return _staged_stash(engine, args, kwargs)
    finally:
        for module, mode in modes.items():
            module.training = mode


def _staged_stash(engine: Any, args: tuple, kwargs: dict) -> list[int]:
    """What each stage worker's forward keeps: saved tensors, received and produced values."""
    staged = engine.staged
    inputs = staged.flatten_inputs(*args, **kwargs)
    produced: dict[Any, Any] = {}
    stashes = []
    for j, (module, io) in enumerate(zip(staged.modules, staged.io)):
        received = []
        values = []
        for source in io.inputs:
            if source.kind == "input":
                values.append(inputs[source[1]])
                continue
            value = produced[source]
            if isinstance(value, torch.Tensor):  # arrives over the wire: a fresh leaf
                value = value.detach().clone().requires_grad_(value.requires_grad)
                received.append(value)
            values.append(value)
        with _saving(_weights(module)) as total:
            outputs = module(*values)
            stashes.append(total(received + _tensors(outputs)))
        for k, value in enumerate(outputs):
            produced[Source.stage(j, k)] = value
    return stashes


def peak_stash(compiled: Any, *, training: bool) -> list[int]:
    """Most micro-batches each lane holds for backward at once under its schedule."""
    engine = compiled.engine
    if not training:
        return [0] * len(lanes_of(compiled))
    if is_local(engine):
        return [1]  # each micro-batch's backward follows its forward
    from pipetorch.schedule.checks import check
    from pipetorch.schedule.plans import plan

    per_plan = plan_micro_batches(engine.batching, training=True)
    report = check(plan(engine.schedule, len(compiled.stages), per_plan, training=True))
    return list(report.peak_stash)


def _in_this_process_cuda(compiled: Any) -> torch.device | None:
    """The GPU the local engine runs on, when it runs on one (workers' GPUs are elsewhere)."""
    engine = compiled.engine
    device = getattr(engine, "input_device", None)
    if not is_local(engine) or device is None or device.type != "cuda":
        return None
    return device if torch.cuda.is_available() and torch.cuda.is_initialized() else None


def reset_peak(compiled: Any) -> None:
    """Start the CUDA allocator's peak afresh, so it covers the profiled calls only."""
    device = _in_this_process_cuda(compiled)
    if device is not None:
        torch.cuda.reset_peak_memory_stats(device)


def measured_peak(compiled: Any) -> int | None:
    """The CUDA allocator's peak on the local engine's GPU; None on the CPU or in workers."""
    device = _in_this_process_cuda(compiled)
    return None if device is None else int(torch.cuda.max_memory_allocated(device))


def build(compiled: Any, *, training: bool, options: Any,
          sample: tuple[tuple, dict] | None) -> dict[str, Any]:
    """The content of memory.json."""
    engine = compiled.engine
    peak = measured_peak(compiled)  # before the sizing forward below adds to it
    lanes = lanes_of(compiled)
    modules = stage_modules(compiled) or [engine.model]
    held = peak_stash(compiled, training=training)
    if not training:
        stashes: list[int | None] = [0] * len(lanes)
        activations_method = "inference keeps no activations for backward"
    elif sample is None:
        stashes = [None] * len(lanes)
        activations_method = "not computed: the profiler was given no sample micro-batch"
    else:
        activations_method = ("peak stashed micro-batches of the schedule x tensors one "
                              "micro-batch's forward keeps for backward")
        try:
            stashes = list(stashed_per_micro_batch(compiled, sample))
        except Exception as exc:  # a report without activations beats no report at exit
            logger.warning("Sizing the stashed activations failed: %s: %s",
                           type(exc).__name__, exc)
            stashes = [None] * len(lanes)
            activations_method = (f"not computed: the sizing forward failed with "
                                  f"{type(exc).__name__}: {exc}")
    location = getattr(getattr(options, "TensorLocations", None), "optimizer_location", None)
    offload = location is not None and location.use_on_chip_storage is False
    devices, methods = [], set()
    for lane, module, stashed, stash in zip(lanes, modules, held, stashes):
        params = [p for p in module.parameters() if p.requires_grad]
        optimizer = engine.optimizer if training else None
        state, how = optimiser_state_bytes(optimizer, params)
        methods.add(how)
        row = {
            "label": lane.label, "stage": lane.stage, "ipu": lane.ipu, "device": lane.device,
            "parameters": _nbytes(module.parameters()),
            "buffers": _nbytes(module.buffers()),
            "gradients": _nbytes(params) if training else 0,
            "optimiser_state": state,
            "optimiser_location": "device",
            "activations": None if stash is None else stash * stashed,
            "activations_per_micro_batch": stash,
            "peak_stashed_micro_batches": stashed,
            "measured_peak": peak,
        }
        parts = ("parameters", "buffers", "gradients", "optimiser_state", "activations")
        row["total"] = sum(row[k] or 0 for k in parts)
        devices.append(row)
    measured = any(d["measured_peak"] is not None for d in devices)
    return {
        "method": MEASURED if measured else COMPUTED,
        "units": "bytes",
        "optimiser_method": "; ".join(sorted(methods)),
        "optimiser_offload_requested": offload,
        "optimiser_note": ("setOptimizerLocation(useOnChipStorage(False)) was requested; the "
                           "state is still counted on the device" if offload else None),
        "activations_method": activations_method,
        "devices": devices,
    }
