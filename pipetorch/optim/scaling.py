"""Automatic loss scaling: a dynamic scale that halves on overflow and doubles after clean runs.

The loss is multiplied by the scale before backward; `step()` first counts the non-finite
gradients. On an overflow the update is skipped (gradients dropped, state untouched), the
scale halves (not below `MIN_SCALE`) and the run of clean steps restarts; otherwise the
gradients are divided back and after `growth_interval` clean steps in a row the scale
doubles (not above `MAX_SCALE`). This is the standard overflow-skip scheme (as torch's
GradScaler); PopTorch's own ALS adjusts the scale from gradient histograms instead.

The scale starts at the optimiser's `loss_scaling` when that is set (not 1.0), else at
`DEFAULT_INITIAL_SCALE`. Everything lives in one picklable dataclass on the optimiser, so
it travels to stage workers with it. On a stage worker the overflow count is summed over
every stage and replica (optim.peers), so an overflow on any of them skips the step on all.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

import torch

from pipetorch.optim import device_link, peers
from pipetorch.optim.arguments import check_number

__all__ = ["enable_automatic_loss_scaling", "disable_automatic_loss_scaling",
           "is_automatic", "loss_scale", "scaling_state", "load_scaling_state",
           "skipped_steps", "last_step_scale", "DEFAULT_INITIAL_SCALE", "DEFAULT_GROWTH_INTERVAL",
           "MIN_SCALE", "MAX_SCALE"]

#: Where the scale starts when the optimiser's `loss_scaling` is left at 1.0.
DEFAULT_INITIAL_SCALE = 2.0 ** 15
#: Clean steps in a row after which the scale doubles.
DEFAULT_GROWTH_INTERVAL = 2000
MIN_SCALE = 1.0
MAX_SCALE = 2.0 ** 24

_ATTR = "_pipetorch_dynamic_scale"


@dataclass
class DynamicScale:
    """The state of automatic loss scaling (plain values: it pickles with the optimiser)."""

    scale: float
    growth_interval: int = DEFAULT_GROWTH_INTERVAL
    clean_steps: int = 0
    skipped_steps: int = 0
    used: float | None = None  # the scale the last step multiplied its loss by


class ScalingState(TypedDict, total=False):
    """`DynamicScale` as a plain dict (`scaling_state`); empty when automatic scaling is off."""

    scale: float
    growth_interval: int
    clean_steps: int
    skipped_steps: int
    used: float | None


def _dynamic(optimizer: torch.optim.Optimizer) -> DynamicScale | None:
    return optimizer.__dict__.get(_ATTR)


def _synced(optimizer: torch.optim.Optimizer) -> DynamicScale | None:
    """The state, after bringing the device's to a user's optimiser of a compiled model."""
    device_link.sync(optimizer)
    return _dynamic(optimizer)


def _check_growth_interval(growth_interval: int) -> int:
    if isinstance(growth_interval, bool) or not isinstance(growth_interval, int):
        raise TypeError(f"growth_interval must be an int >= 1, got {growth_interval!r} "
                        f"({type(growth_interval).__name__}); pass e.g. growth_interval=2000")
    if growth_interval < 1:
        raise ValueError(f"growth_interval must be >= 1, got {growth_interval}; pass e.g. "
                         "growth_interval=2000")
    return growth_interval


class LossScaled:
    """Base of every pipetorch optimiser: its step() un-scales the gradients and, with
    automatic loss scaling, skips a step whose gradients overflowed."""


def enable_automatic_loss_scaling(optimizer: torch.optim.Optimizer, *,
                                  initial_scale: float | None = None,
                                  growth_interval: int | None = None) -> None:
    """Turn automatic loss scaling on for `optimizer` (a pipetorch optimiser).

    Already on: the current scale and counters are kept; only the arguments given change.
    `initial_scale` defaults to the optimiser's `loss_scaling` if set, else 2**15.
    """
    if not isinstance(optimizer, LossScaled):
        raise TypeError(
            f"Automatic loss scaling needs a pipetorch optimiser (it un-scales the gradients "
            f"and skips overflowing steps in step()), got {type(optimizer).__module__}."
            f"{type(optimizer).__name__}; use poptorch.optim.{type(optimizer).__name__} "
            "(or another poptorch.optim optimiser) instead")
    if growth_interval is not None:
        growth_interval = _check_growth_interval(growth_interval)
    if initial_scale is not None:
        initial_scale = float(check_number("initial_scale", initial_scale, minimum=MIN_SCALE))
        if initial_scale > MAX_SCALE:
            raise ValueError(f"initial_scale must be <= 2**24 ({MAX_SCALE:g}), got "
                             f"{initial_scale:g}; pass a smaller power of two such as 2**15")
    state = _dynamic(optimizer)
    if state is None:
        static = float(getattr(optimizer, "loss_scaling", 1.0))
        start = static if static != 1.0 else DEFAULT_INITIAL_SCALE
        state = DynamicScale(min(max(start, MIN_SCALE), MAX_SCALE))
        setattr(optimizer, _ATTR, state)
    if initial_scale is not None:
        state.scale = initial_scale
    if growth_interval is not None:
        state.growth_interval = growth_interval


def disable_automatic_loss_scaling(optimizer: torch.optim.Optimizer) -> None:
    """Back to the static `loss_scaling` (the dynamic state is dropped)."""
    optimizer.__dict__.pop(_ATTR, None)


def is_automatic(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` scales the loss automatically."""
    return _dynamic(optimizer) is not None


def loss_scale(optimizer: torch.optim.Optimizer) -> float:
    """What the loss is multiplied by now: the dynamic scale, else `loss_scaling`, else 1.0."""
    state = _synced(optimizer)
    if state is not None:
        return state.scale
    return float(getattr(optimizer, "loss_scaling", None) or 1.0)


def last_step_scale(optimizer: torch.optim.Optimizer) -> float:
    """The scale the last optimiser step's loss was multiplied by (PopTorch's anchor
    finalLossScale: loss_scaling x the lossScaleUpdateFactor read before the call); before
    any step, and with a static scale, what `loss_scale` says."""
    state = _synced(optimizer)
    if state is not None and state.used is not None:
        return state.used
    return loss_scale(optimizer)


def skipped_steps(optimizer: torch.optim.Optimizer) -> int:
    """How many steps automatic loss scaling skipped because gradients overflowed."""
    state = _synced(optimizer)
    return 0 if state is None else state.skipped_steps


def scaling_state(optimizer: torch.optim.Optimizer) -> ScalingState:
    """The dynamic state as a plain dict ({} when automatic loss scaling is off)."""
    state = _dynamic(optimizer)
    if state is None:
        return {}
    return ScalingState(scale=state.scale, growth_interval=state.growth_interval,
                        clean_steps=state.clean_steps, skipped_steps=state.skipped_steps,
                        used=state.used)


def load_scaling_state(optimizer: torch.optim.Optimizer, state: ScalingState) -> None:
    """Set the dynamic state from `scaling_state(...)` of another copy; {} turns it off."""
    if not state:
        disable_automatic_loss_scaling(optimizer)
        return
    setattr(optimizer, _ATTR, DynamicScale(**state))


def overflowed(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> bool:
    """Whether any gradient of any stage and replica is inf/NaN (only counts with ALS on)."""
    grads = [p.grad for p in params if p.grad is not None]
    counts = [(~torch.isfinite(g)).sum() for g in grads]
    device = grads[0].device if grads else torch.device("cpu")
    count = (torch.stack([c.to(device) for c in counts]).sum().float() if counts
             else torch.zeros((), device=device))
    across = peers.current()
    if across is not None:
        count = across.reduce(count)
    return bool(count.item() > 0)


def record_overflow(optimizer: torch.optim.Optimizer) -> None:
    """A skipped step: halve the scale, restart the clean run, count the skip."""
    state = _dynamic(optimizer)
    assert state is not None
    state.used = state.scale
    state.scale = max(state.scale / 2.0, MIN_SCALE)
    state.clean_steps = 0
    state.skipped_steps += 1


def record_clean_step(optimizer: torch.optim.Optimizer) -> None:
    """An applied step: after `growth_interval` of them in a row the scale doubles."""
    state = _dynamic(optimizer)
    assert state is not None
    state.used = state.scale
    state.clean_steps += 1
    if state.clean_steps >= state.growth_interval:
        state.scale = min(state.scale * 2.0, MAX_SCALE)
        state.clean_steps = 0
