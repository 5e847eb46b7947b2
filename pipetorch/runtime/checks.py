"""What PopTorch checks or decides around a wrapped model's call: buffers unchanged since
compilation, tensors on the model's device, and the mean-reduction strategy it picks."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.nn as nn

from pipetorch.enums import MeanReductionStrategy, OutputMode
from pipetorch.errors import ConfigError, DeviceMismatchError, Error, ModelChangedError
from pipetorch.runtime.anchors import GRADIENT, LOSS_SCALE, UPDATED

__all__: list[str] = []

_MISMATCH = ("Expected all tensors to be on the same device", "is not on the expected device")


def held(model: nn.Module, slot: str) -> dict[str, torch.Tensor]:
    """`model`'s parameters (slot "_parameters") or buffers ("_buffers") by qualified name,
    read without the accessors that would copy the device's weights back first."""
    return {f"{prefix}.{name}" if prefix else name: t
            for prefix, module in model.named_modules()
            for name, t in module.__dict__[slot].items() if t is not None}


def buffer_ids(model: nn.Module) -> dict[str, int]:
    """The identity of each buffer of `model`, by name (recorded at compile)."""
    return {name: id(b) for name, b in held(model, "_buffers").items()}


def check_buffers(model: nn.Module, compiled: dict[str, int] | None) -> None:
    """PopTorch refuses buffers added, removed or replaced after compilation."""
    now = buffer_ids(model)
    if compiled is None or now == compiled:
        return
    added = sorted(now.keys() - compiled.keys())
    removed = sorted(compiled.keys() - now.keys())
    replaced = sorted(n for n in now.keys() & compiled.keys() if now[n] != compiled[n])
    raise ModelChangedError(
        "Buffers cannot be added, removed or redefined after the model is compiled: "
        f"added {added}, removed {removed}, redefined {replaced}. The device keeps the "
        "buffers it was compiled with. Change buffer values in place (buf.copy_(...)) and "
        "call copyWeightsToDevice() or copyNamedBuffersToDevice(), or call destroy() and "
        "wrap the model again")


@contextlib.contextmanager
def device_mismatch_explained(device: torch.device) -> Iterator[None]:
    """torch's device-mismatch error, with where pipetorch puts tensors and the fix."""
    try:
        yield
    except RuntimeError as exc:
        if isinstance(exc, Error) or not any(p in str(exc) for p in _MISMATCH):
            raise
        raise DeviceMismatchError(
            f"{exc} The model runs on {device}: pipetorch moves its inputs, parameters and "
            "buffers there, but a tensor the model keeps as a plain attribute, or creates in "
            "forward on another device, stays where it is. Register it with "
            "module.register_buffer(name, tensor) (persistent=False if it is not state), or "
            "create it with device=x.device") from exc


def resolve_mean_strategy(optimizer: torch.optim.Optimizer, *options: Any) -> None:
    """PopTorch picks Running for float16 accumulators (unless combined), else Post, when
    the user did not choose; the choice is readable on the user's options afterwards."""
    if options[0].Training._strategy_chosen:
        return
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    accum = group.get("accum_type", getattr(optimizer, "accum_type", None))
    combined = group.get("use_combined_accum", getattr(optimizer, "use_combined_accum", False))
    strategy = (MeanReductionStrategy.Running if accum == torch.float16 and not combined
                else MeanReductionStrategy.Post)
    for o in options:  # frozen by now: this is the compile-time decision, not a user edit
        o.Training._values["mean_accumulation_and_replication_reduction_strategy"] = strategy


def check_return_periods(options: Any) -> None:
    """EveryN's period must divide the D x G iterations of a call, or the last ones are
    never returned (checked at wrap time, for outputMode and every anchorTensor)."""
    d, g = options.device_iterations, options.Training.gradient_accumulation
    steps = d * g
    factors = f"deviceIterations ({d})" + (f" x gradientAccumulation ({g})" if g > 1 else "")
    periods = []
    if options.output_mode == OutputMode.EveryN:
        periods.append((options.output_return_period, "outputMode(OutputMode.EveryN, "
                        f"output_return_period={options.output_return_period})"))
    for name, spec in options.anchored_tensors.items():
        # (a per-call anchor, gradients or weights, is refused with EveryN by anchors.py)
        per_call = spec["long_name"] == LOSS_SCALE or spec["long_name"].startswith(
            (GRADIENT, UPDATED))
        if spec["output_mode"] == OutputMode.EveryN and not per_call:
            periods.append((spec["output_return_period"], f"anchorTensor({name!r}, "
                            f"{spec['long_name']!r}, OutputMode.EveryN, "
                            f"output_return_period={spec['output_return_period']})"))
    for period, setter in periods:
        if steps % period:
            divisors = [n for n in range(1, steps + 1) if steps % n == 0]
            raise ConfigError(
                f"{setter}: the period must divide the {steps} iteration(s) of each host call "
                f"({factors}); with {period} a call returns {steps // period} of them and the "
                f"last {steps % period} never. Use a period in {divisors}, or make "
                f"{'deviceIterations' if g == 1 else 'deviceIterations x gradientAccumulation'} "
                f"a multiple of {period}")
