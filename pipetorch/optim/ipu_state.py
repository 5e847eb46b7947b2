"""The optimiser state under PopTorch's names (`state_dict()["ipu_state"]`).

PopTorch keeps an optimiser's state on the IPU under PopART tensor names: the momentum of
parameter `fc.weight` is `Accl___fc.weight`, Adam's moments `Accl1___` / `Accl2___` and
its step count `Step___`, and automatic loss scaling's factor `lossScaleUpdateFactor` (the
loss scale is `loss_scaling * lossScaleUpdateFactor`). After a trainingModel has compiled,
`optimizer.state_dict()` carries that dict as "ipu_state", `read_ipu_state()` returns it and
`write_ipu_state(state)` (or `load_state_dict` of such a dict) sets it: at once on a compiled
model, else when the model compiles. A state naming only some tensors (an incomplete state)
sets those; the others keep their values, and a fresh parameter's missing moments start at 0.
Once compiled, every parameter's state is there, as on the IPU: before the first step it
reads as the zeros (and step 0) the first update starts from. As in PopTorch, what
`load_state_dict` loaded into a compiled model's optimiser reads back as it was loaded (an
incomplete state stays incomplete) until the model runs; then the device's merged state.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

from pipetorch.optim import per_param, scaling
from pipetorch.optim.per_param import ParamGroup
# linked_names and sync are also called through this module (ipu_param, optim._common)
from pipetorch.optim.device_link import (
    _LINK, Link, linked_names, poptorch_keys, poptorch_name, sync)

__all__: list[str] = []

logger = logging.getLogger(__name__)

LOSS_SCALE_FACTOR = "lossScaleUpdateFactor"
_PENDING = "_pipetorch_pending_ipu_state"
_LOADED = "_pipetorch_loaded_ipu_dicts"  # {"ipu_state": ..., "ipu_param": ...} until a run
# torch state key -> PopART prefix, per optimiser family (found through the class's MRO).
_PREFIXES = {
    "SGD": {"momentum_buffer": "Accl"},
    "Adam": {"exp_avg": "Accl1", "exp_avg_sq": "Accl2", "step": "Step"},
    "AdamW": {"exp_avg": "Accl1", "exp_avg_sq": "Accl2", "step": "Step"},
    "LAMB": {"exp_avg": "Accl1", "exp_avg_sq": "Accl2", "step": "Step"},
    "RMSprop": {"square_avg": "Accl1", "momentum_buffer": "Accl2", "grad_avg": "Accl3",
                "step": "Step"},
}


def _prefixes(optimizer: torch.optim.Optimizer) -> dict[str, str]:
    for cls in type(optimizer).__mro__:
        if cls.__name__ in _PREFIXES:
            return _PREFIXES[cls.__name__]
    return {}


def link(optimizer: torch.optim.Optimizer, model: torch.nn.Module, *,
         sync: Callable[[], None], push: Callable[[], None]) -> bool:
    """Tie `optimizer` to its compiled model, then apply any state written before; whether
    there was such state (to send to the device: `ipu_param.link` does)."""
    names = {id(p): poptorch_name(n) for n, p in model.named_parameters()}
    unlink(optimizer)
    found = optimizer.__dict__[_LINK] = Link(names, sync, push)
    # torch's own state_dict() reads the device's state first too (poptorch.optim's
    # state_dict syncs itself; the second sync finds nothing newer)
    found.hook = optimizer.register_state_dict_pre_hook(_sync_before_reading)
    pending = optimizer.__dict__.pop(_PENDING, None)
    if pending is not None:
        found.sync()  # on a running device, what the state leaves out keeps the device's
        _apply(optimizer, pending)
    return pending is not None


def remember_loaded(optimizer: torch.optim.Optimizer, key: str,
                    values: dict[str, torch.Tensor]) -> None:
    """`values` loaded as "ipu_state" or "ipu_param" into a compiled model's optimiser: read
    back as loaded until the model runs (`forget_loaded`), as PopTorch's are."""
    names = linked_names(optimizer)
    if names is not None:  # spelled as read: parameters under PopTorch's `model.`
        known = dict.fromkeys(names.values())
        optimizer.__dict__.setdefault(_LOADED, {})[key] = poptorch_keys(dict(values), known)


def loaded(optimizer: torch.optim.Optimizer, key: str) -> dict[str, torch.Tensor] | None:
    found = optimizer.__dict__.get(_LOADED, {}).get(key)
    return None if found is None else dict(found)


def forget_loaded(optimizer: torch.optim.Optimizer) -> None:
    """The model ran (or the optimiser was re-linked): its state is the device's again."""
    optimizer.__dict__.pop(_LOADED, None)


def unlink(optimizer: torch.optim.Optimizer) -> None:
    forget_loaded(optimizer)
    found: Link | None = optimizer.__dict__.pop(_LINK, None)
    if found is not None and found.hook is not None:
        found.hook.remove()


def _sync_before_reading(optimizer: torch.optim.Optimizer) -> None:
    """state_dict() pre-hook (module level: hooks are never pickled, but stay plain)."""
    sync(optimizer)


def read(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor] | None:
    """The state under PopTorch's names. Before a trainingModel compiled with it: None, or
    what was written (a loaded checkpoint's), as PopTorch returns it."""
    found: Link | None = optimizer.__dict__.get(_LINK)
    if found is None:
        pending = optimizer.__dict__.get(_PENDING)
        return None if pending is None else dict(pending)
    found.sync()
    as_loaded = loaded(optimizer, "ipu_state")
    if as_loaded is not None:
        return as_loaded
    prefixes = _prefixes(optimizer)
    state: dict[str, torch.Tensor] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            name = found.names.get(id(param))
            held = {k: v for k, v in optimizer.state.get(param, {}).items()
                    if k != per_param.KEY}  # a parameter's own hyper-parameters, not state
            slot = held or _fresh(optimizer, group, param)
            for key, value in slot.items():
                if name is not None and isinstance(value, torch.Tensor):
                    state[f"{prefixes.get(key, key)}___{name}"] = value.detach().clone()
    if scaling.is_automatic(optimizer):
        base = optimizer.param_groups[0].get("loss_scaling", 1.0)
        state[LOSS_SCALE_FACTOR] = torch.tensor(scaling.loss_scale(optimizer) / base)
    return state


def write(optimizer: torch.optim.Optimizer, state: dict[str, torch.Tensor]) -> None:
    """Set the state from PopTorch's names: now if compiled, else when the model compiles."""
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise TypeError("ipu_state must be a dict of PopTorch tensor names (such as "
                        f"'Accl___fc.weight') to tensors, got {type(state).__name__}")
    found: Link | None = optimizer.__dict__.get(_LINK)
    if found is None:
        optimizer.__dict__[_PENDING] = {**optimizer.__dict__.get(_PENDING, {}), **state}
        return
    found.sync()
    _apply(optimizer, state)
    found.push()


def _apply(optimizer: torch.optim.Optimizer, state: dict[str, torch.Tensor]) -> None:
    found: Link = optimizer.__dict__[_LINK]
    prefixes = _prefixes(optimizer)
    by_name = {found.names[id(p)]: (p, g) for g in optimizer.param_groups for p in g["params"]
               if id(p) in found.names}
    state = poptorch_keys(state, by_name)  # names without PopTorch's `model.` are read too
    _check_shapes(state, by_name, prefixes)
    unknown, missing = [], []
    for key, value in state.items():
        if key == LOSS_SCALE_FACTOR:
            _set_factor(optimizer, float(value))
            continue
        prefix, _, name = key.partition("___")
        torch_key = next((k for k, p in prefixes.items() if p == prefix), prefix)
        if name not in by_name:
            unknown.append(key)
            continue
        param, group = by_name[name]
        slot = optimizer.state[param]
        if not slot:  # a fresh parameter: every moment starts at 0, as on the IPU
            slot.update(_fresh(optimizer, group, param))
        slot[torch_key] = value.detach().clone().to(
            param.device if value.dim() else value.device)
    if unknown:
        raise ValueError(f"ipu_state names tensors this optimiser does not hold: {unknown[:4]}; "
                         f"its parameters are {sorted(by_name)[:6]}")
    for name, _param in by_name.items():
        if not any(k.endswith(f"___{name}") for k in state):
            missing.append(name)
    if missing:
        logger.warning("ipu_state sets no state for %d parameter(s) (%s): they keep theirs",
                       len(missing), ", ".join(missing[:4]))


def _check_shapes(state: dict[str, torch.Tensor],
                  by_name: dict[str, tuple[torch.Tensor, ParamGroup]],
                  prefixes: dict[str, str]) -> None:
    """Refuse, before anything is set, a tensor the update could not use: a moment of
    another shape than its parameter, a step count of more than one number."""
    step = prefixes.get("step")
    for key, value in state.items():
        prefix, _, name = key.partition("___")
        if name not in by_name or key == LOSS_SCALE_FACTOR:
            continue
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            raise TypeError(f"ipu_state[{key!r}] must be a floating-point tensor, got "
                            f"{getattr(value, 'dtype', type(value).__name__)}")
        want = () if prefix == step else tuple(by_name[name][0].shape)
        if tuple(value.shape) != want and not (prefix == step and value.numel() == 1):
            raise ValueError(f"ipu_state[{key!r}] has shape {tuple(value.shape)} but the "
                             f"optimiser state of {name} has shape {want}: nothing was set")


def _uses(group: ParamGroup, key: str) -> bool:
    """Whether a fresh state in `group` holds `key` (momentum 0 keeps no velocity)."""
    if key == "momentum_buffer":
        return bool(group.get("momentum", 0))
    if key == "grad_avg":
        return bool(group.get("centered", False))
    return True


def _fresh(optimizer: torch.optim.Optimizer, group: ParamGroup,
           param: torch.Tensor) -> dict[str, torch.Tensor]:
    """The state the first update of `param` starts from, in its accumulation dtypes: zeros
    (TensorFlow's RMSprop starts its mean square at ones), step 0."""
    formats_of = getattr(optimizer, "_formats", None)
    formats = formats_of(group, param)[1] if formats_of is not None else {}
    fresh = {}
    for key in _prefixes(optimizer):
        if not _uses(group, key):
            continue
        if key == "step":
            fresh[key] = torch.zeros((), dtype=torch.float32)
            continue
        fill = 1.0 if key == "square_avg" and group.get("use_tf_variant") else 0.0
        dtype = formats.get(key, (param.dtype, 1.0))[0]
        fresh[key] = torch.full_like(param, fill, dtype=dtype, requires_grad=False)
    return fresh


def _set_factor(optimizer: torch.optim.Optimizer, factor: float) -> None:
    base = optimizer.param_groups[0].get("loss_scaling", 1.0)
    if not scaling.is_automatic(optimizer):
        scaling.enable_automatic_loss_scaling(optimizer)
    current = scaling.scaling_state(optimizer)
    scaling.load_scaling_state(optimizer, {**current, "scale": base * factor})
