"""Optimiser state offload: the state lives in host memory and is streamed in for each update.

`offload_state(optimizer)` registers a step pre-hook that moves each parameter's state
tensors to the parameter's device and a post-hook that moves them back to host memory
(pinned when CUDA is available, so the next upload can overlap). Only the post-hook pins:
an optimiser unpickled in a stage worker, before the worker has chosen its GPU, must not
touch CUDA (pinning would open a context on cuda:0 in every worker). Between steps the device
holds no optimiser state; the numbers are those of on-device state, bit for bit. Scalar
state (Adam's `step` counter) stays where torch keeps it.

torch pickles and deep-copies an optimiser as its defaults, state and param groups only,
dropping hooks; an offloaded optimiser therefore gets a subclass of its own class (same
name) whose pickles rebuild it offloaded, so stage workers and device copies stay
offloaded. The hooks are module-level functions for the same reason.
"""
from __future__ import annotations

import torch
from torch.optim.optimizer import Args, Kwargs

__all__ = ["offload_state", "is_offloaded"]

_HANDLES = "_pipetorch_offload_handles"
_classes: dict[type, type] = {}


def _move(optimizer: torch.optim.Optimizer, *, to_host: bool) -> None:
    """Every state tensor to its parameter's device, or (`to_host`) a pinned copy of it in host
    memory when CUDA is available and a plain copy otherwise."""
    pin = to_host and torch.cuda.is_available()
    for param, state in optimizer.state.items():
        for key, value in _state_tensors(state):
            if to_host:
                # A copy, even from a CPU device: the device's tensor is freed.
                host = torch.empty_like(value, device="cpu", pin_memory=pin)
                state[key] = host.copy_(value)
            else:
                state[key] = value.to(param.device, non_blocking=True, copy=True)


def _leave_devices(optimizer: torch.optim.Optimizer) -> None:
    """State tensors not in host memory copied there, unpinned; no CUDA call for the rest."""
    for state in optimizer.state.values():
        for key, value in _state_tensors(state):
            if value.device.type != "cpu":
                state[key] = value.to("cpu", copy=True)


def _state_tensors(state: dict[str, object]) -> list[tuple[str, torch.Tensor]]:
    """(key, tensor) of a parameter's state that offload moves: not scalars such as `step`."""
    return [(key, value) for key, value in state.items()
            if isinstance(value, torch.Tensor) and value.dim()]


def _stream_in(optimizer: torch.optim.Optimizer, args: Args, kwargs: Kwargs) -> None:
    """Step pre-hook: the state onto its parameters' devices."""
    _move(optimizer, to_host=False)


def _stream_out(optimizer: torch.optim.Optimizer, args: Args, kwargs: Kwargs) -> None:
    """Step post-hook: the updated state back to host memory."""
    _move(optimizer, to_host=True)


def _rebuild(cls: type[torch.optim.Optimizer], state: dict[str, object]) -> torch.optim.Optimizer:
    """Unpickling helper: an offloaded optimiser of class `cls` with `state`."""
    optimizer = cls.__new__(cls)
    optimizer.__setstate__(state)
    offload_state(optimizer)
    return optimizer


def _offloaded_class(cls: type) -> type:
    """`cls` whose pickles and deep copies come back offloaded."""
    if cls not in _classes:
        def __reduce_ex__(self: torch.optim.Optimizer, protocol: int) -> tuple[object, ...]:
            return _rebuild, (cls, self.__getstate__())

        _classes[cls] = type(cls.__name__, (cls,), {
            "__module__": cls.__module__, "__qualname__": cls.__qualname__,
            "_pipetorch_base": cls, "__reduce_ex__": __reduce_ex__})
    return _classes[cls]


def offload_state(optimizer: torch.optim.Optimizer) -> None:
    """Keep `optimizer`'s state in host memory between steps (idempotent)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"offload_state needs a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    if is_offloaded(optimizer):
        return
    base = type(optimizer).__dict__.get("_pipetorch_base", type(optimizer))
    optimizer.__class__ = _offloaded_class(base)
    setattr(optimizer, _HANDLES, (optimizer.register_step_pre_hook(_stream_in),
                                  optimizer.register_step_post_hook(_stream_out)))
    _leave_devices(optimizer)


def is_offloaded(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `offload_state` keeps this optimiser's state in host memory."""
    return _HANDLES in optimizer.__dict__
