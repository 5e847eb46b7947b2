"""The device's own copy of the user's optimiser, and hyper-parameter updates to it."""
from __future__ import annotations

import copy
import inspect
import logging
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn as nn

from pipetorch.errors import ConfigError
from pipetorch.optim import ipu_param, offload as offloading, scaling
from pipetorch.optim._common import PopTorchOptimizer

if TYPE_CHECKING:
    from pipetorch.parallel.host.engines import Engine

__all__: list[str] = []

logger = logging.getLogger(__name__)

#: The optimiser families PopTorch compiles for the IPU (torch's, or poptorch.optim's).
POPTORCH_FAMILIES = ("SGD", "Adam", "AdamW", "RMSprop", "LAMB")
_warned: set[str] = set()


def default_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """PopTorch's default when trainingModel gets no optimiser: SGD with lr=0.01."""
    from pipetorch.optim import SGD

    return SGD(model.parameters(), lr=0.01)


def device_optimizer(optimizer: torch.optim.Optimizer, host: nn.Module,
                     device: nn.Module, *, auto_loss_scaling: bool = False,
                     offload: bool = False) -> torch.optim.Optimizer:
    """A copy of `optimizer` (hyper-parameters and state) that updates `device`'s parameters,
    with automatic loss scaling on or off (Training.setAutomaticLossScaling; a scale the
    optimiser already carries is kept) and its state offloaded to host memory when asked
    (TensorLocations.setOptimizerLocation(...useOnChipStorage(False)))."""
    warn_code_poptorch_skips(optimizer)
    memo: dict[int, object] = {}
    for (_, h), (_, d) in zip(host.named_parameters(remove_duplicate=False),
                              device.named_parameters(remove_duplicate=False), strict=True):
        memo[id(h)] = d
    for index, group in enumerate(optimizer.param_groups):
        strangers = [tuple(p.shape) for p in group["params"] if id(p) not in memo]
        if strangers:
            raise ConfigError(
                f"The optimiser's param group {index} holds {len(strangers)} tensors (shapes "
                f"{strangers[:3]}) that are not parameters of the wrapped model: build the "
                "optimiser from model.parameters() of the model you pass to trainingModel"
            )
    shared = host is device  # stage workers hold the device's state; the host copy is
    if shared:               # the user's model, and its optimiser state the user's own
        memo.update({id(t): t for s in optimizer.state.values() for t in s.values()
                     if isinstance(t, torch.Tensor)})
    # deepcopy with the host parameters pre-mapped: groups, state and defaults are copied,
    # and every reference to a host parameter becomes the matching device parameter.
    clone = copy.deepcopy(optimizer, memo)
    if shared:
        clone.state = optimizer.state  # what the workers' state is copied into, when asked
    if not offloading.is_offloaded(clone):
        for param, state in clone.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.device != param.device and value.dim():
                    state[key] = value.to(param.device)
    _set_scaling_and_offload(clone, auto_loss_scaling=auto_loss_scaling, offload=offload)
    _log_update(clone)
    return clone


def _log_update(optimizer: torch.optim.Optimizer) -> None:
    """The optimiser the device now uses, in PopTorch's debug lines (its tests read them)."""
    for line in ipu_param.describe(optimizer):
        logger.debug(line)


def _ours(function: Callable[..., object]) -> bool:
    module = getattr(inspect.unwrap(function), "__module__", "") or ""
    return module.split(".")[0] in ("torch", "pipetorch")


def warn_code_poptorch_skips(optimizer: torch.optim.Optimizer) -> None:
    """Warn, once per message, about optimiser Python code PopTorch would not run.

    PopTorch compiles SGD, Adam, AdamW, RMSprop or LAMB from the optimiser's type and
    hyper-parameters: an override of `step()` or `zero_grad()` in a subclass, or a step hook,
    never runs on an IPU, and another optimiser type is refused. pipetorch runs the Python
    optimiser, so such code does run here, and the numbers can differ from PopTorch's.
    """
    cls = _base_class(optimizer)
    family = next((c.__name__ for c in cls.__mro__
                   if c.__name__ in POPTORCH_FAMILIES and _ours(c)), None)
    messages = []
    if family is None:
        messages.append(
            f"{cls.__qualname__} is not one of PopTorch's optimisers (SGD, Adam, AdamW, RMSprop, "
            "LAMB, from torch.optim or poptorch.optim): PopTorch refuses it; pipetorch runs "
            "its step() as written")
    else:
        for method in ("step", "zero_grad"):
            function = getattr(cls, method)
            if not _ours(function):
                messages.append(
                    f"{inspect.unwrap(function).__qualname__}() overrides {family}.{method}(): "
                    f"PopTorch never runs an optimiser's Python {method}() (the IPU runs its own "
                    f"{family} update, built from the type and hyper-parameters), so this code "
                    f"would not run on an IPU; pipetorch runs it, and the numbers can differ "
                    "from PopTorch's")
    hooks = [hook for hooks in (optimizer._optimizer_step_pre_hooks,
                                optimizer._optimizer_step_post_hooks)
             for hook in hooks.values() if not _ours(hook)]
    if hooks:
        messages.append(
            f"{cls.__qualname__} has {len(hooks)} step hook(s) (register_step_pre_hook / "
            "register_step_post_hook) that PopTorch would not run; pipetorch runs them at "
            "every optimiser step")
    for message in messages:
        if message not in _warned:
            _warned.add(message)
            logger.warning(message)


def _set_scaling_and_offload(optimizer: torch.optim.Optimizer, *, auto_loss_scaling: bool,
                             offload: bool) -> None:
    """Automatic loss scaling on or off, and the state offloaded, as the options ask."""
    if auto_loss_scaling:
        if not isinstance(optimizer, PopTorchOptimizer):
            raise ConfigError(
                "opts.Training.setAutomaticLossScaling(True) needs a poptorch.optim optimiser "
                "(its step() skips overflowing steps and un-scales the gradients), but the model "
                f"trains with {type(optimizer).__module__}.{type(optimizer).__name__} "
                "(PopTorch also accepts torch.optim's optimisers here; pipetorch does not): "
                "use poptorch.optim.SGD, Adam, AdamW, RMSprop or LAMB, or call "
                "setAutomaticLossScaling(False) and pass a static loss_scaling")
        # Keeps the scale the user's optimiser carries from an earlier wrapper, if any.
        scaling.enable_automatic_loss_scaling(optimizer)
    else:
        scaling.disable_automatic_loss_scaling(optimizer)
    if offload:
        offloading.offload_state(optimizer)


def copy_hyperparameters(source: torch.optim.Optimizer, target: torch.optim.Optimizer) -> None:
    """setOptimizer: new learning rates etc. reach the device; its state stays."""
    if _family(source) is not _family(target):
        raise ConfigError(
            f"setOptimizer got a {type(source).__name__} but the model trains with a "
            f"{type(target).__name__}: keep the optimiser type, or build a new trainingModel"
        )
    if len(source.param_groups) != len(target.param_groups):
        raise ConfigError(
            f"setOptimizer got {len(source.param_groups)} param groups but the model was compiled "
            f"with {len(target.param_groups)}: keep the same groups"
        )
    before = ipu_param.describe(target)
    for src, dst in zip(source.param_groups, target.param_groups, strict=True):
        if len(src["params"]) != len(dst["params"]):
            raise ConfigError("setOptimizer: a param group holds a different number of parameters")
        dst.update({k: copy.deepcopy(v) for k, v in src.items() if k != "params"})
    for key in ("loss_scaling",):
        if hasattr(source, key):
            setattr(target, key, getattr(source, key))
    if ipu_param.describe(target) != before:  # PopTorch logs an update only when one is sent
        _log_update(target)


def copy_state_to_host(device_opt: torch.optim.Optimizer, host_opt: torch.optim.Optimizer) -> None:
    """Give the user's optimiser the device's state (and dynamic loss scale), e.g. for a
    checkpoint or to read `scaling.loss_scale(optimizer)` after a call."""
    if device_opt.state is not host_opt.state:  # else the engine filled the user's state
        host_opt.load_state_dict(copy.deepcopy(device_opt.state_dict()))
    copy_scaling_to_host(device_opt, host_opt)


def copy_scaling_to_host(device_opt: torch.optim.Optimizer,
                         host_opt: torch.optim.Optimizer) -> None:
    """Give the user's optimiser the device's dynamic loss scale (with every copy of the
    weights: it is a few numbers)."""
    if scaling.is_automatic(device_opt):
        scaling.load_scaling_state(host_opt, scaling.scaling_state(device_opt))


def copy_state_to_device(host_opt: torch.optim.Optimizer, engine: Engine) -> None:
    """The user's optimiser state (and dynamic loss scale) becomes the device's: after
    `write_ipu_state` on a compiled model."""
    state = host_opt.state_dict()
    state.pop("ipu_state", None)
    state.pop("ipu_param", None)  # already in the groups it was read from
    device_opt = engine.optimizer
    assert device_opt is not None  # a training engine's
    device_opt.load_state_dict(copy.deepcopy(state))
    scaling.load_scaling_state(device_opt, scaling.scaling_state(host_opt))
    engine.push(optimizer_state=True)  # the state, with parameters' own hyper-parameters
    engine.set_hyperparameters()  # the groups' (a checkpoint's learning rate, say)


def _family(optimizer: torch.optim.Optimizer) -> type:
    """The torch optimiser class `optimizer` is (poptorch.optim.SGD is a torch.optim.SGD: one
    may replace the other, as in PopTorch); its own class when it derives from no torch one
    but the base Optimizer (LAMB, a user's own)."""
    own = _base_class(optimizer)
    return next((c for c in own.__mro__ if c.__module__.startswith("torch.optim.")
                 and c is not torch.optim.Optimizer), own)


def _base_class(optimizer: torch.optim.Optimizer) -> type:
    """The optimiser's own class (an offloaded one runs as a subclass of it)."""
    return type(optimizer).__dict__.get("_pipetorch_base", type(optimizer))
