"""Anchored tensors (`Options.anchorTensor`): named values of a run the host reads back.

PopTorch names tensors of its IR; pipetorch answers the names a script can rely on:

    loss                     the loss of each micro-batch, kept by the anchor's output mode
    <module path>            a submodule's output, e.g. "fc1" (models run in this process)
    Gradient___<param>       the gradient the last optimiser step used (after accumulation
                             and replica reduction, times the loss scale, as PopTorch's)
    UpdatedVar___<param>     the parameter after the last step
    finalLossScale           the loss scale the call's last step used (loss_scaling x the
                             lossScaleUpdateFactor read before the call, as in PopTorch)

PopTorch's own spelling of the same names, with the user's model as `model`
("Gradient___model.fc2.bias", "model.fc1"), is accepted and listed too.

Gradients, updated weights and the loss scale exist once per call (after its last step), so
their anchors take only OutputMode.Final (or the default mode).
"""
from __future__ import annotations

import difflib
from typing import TYPE_CHECKING, Any, Callable, Protocol, TypedDict

import torch
import torch.nn as nn

from pipetorch.enums import OutputMode
from pipetorch.errors import ConfigError
from pipetorch.optim.device_link import POPTORCH_ROOT
from pipetorch.optim.scaling import last_step_scale
from pipetorch.losses import find_loss
from pipetorch.parallel.host.outputs import OutputCollector, resolve_mode
from pipetorch.partition.export import Tree
from pipetorch.weights.host_copy import held

if TYPE_CHECKING:
    from pipetorch.parallel.host.engines import Engine

__all__: list[str] = []

GRADIENT, UPDATED = "Gradient___", "UpdatedVar___"
LOSS, LOSS_SCALE = "loss", "finalLossScale"


class AnchorSpec(TypedDict):
    """One anchored tensor as Options.anchorTensor records it (`options.anchored_tensors`
    maps each short name to one)."""

    long_name: str
    output_mode: OutputMode | None  # None: the model's own output mode
    output_return_period: int


class Collector(Protocol):
    """What a host call hands its micro-batches' outputs to: an OutputCollector, or one of the
    collectors wrapping it (the anchors' tee, checkNonFinite's watch)."""

    def wants(self, step: int) -> bool: ...

    def add(self, step: int, replica: int, output: Tree) -> None: ...

    def result(self) -> Any: ...


def tensor_names(model: nn.Module, *, training: bool, in_process: bool) -> list[str]:
    """Every name `anchorTensor` accepts for this model."""
    params = [name for name, _ in model.named_parameters()]
    names = [*params, *(name for name, _ in model.named_buffers())]
    if in_process:
        names += [name for name, _ in model.named_modules() if name]
    if training:
        names += [LOSS, LOSS_SCALE, *(GRADIENT + p for p in params), *(UPDATED + p for p in params)]
    return list(dict.fromkeys(names))  # a submodule named "loss" is listed once


def poptorch_spellings(names: list[str]) -> dict[str, str]:
    """PopTorch's names for `names`, mapped to them: its IR holds the user's model as `model`,
    so scripts anchor "Gradient___model.fc2.bias" or "model.fc1" for "Gradient___fc2.bias" or
    "fc1" (the loss and the loss scale keep their names)."""
    spelled = {}
    for name in names:
        if name not in (LOSS, LOSS_SCALE):
            prefix = next((p for p in (GRADIENT, UPDATED) if name.startswith(p)), "")
            spelled[f"{prefix}{POPTORCH_ROOT}{name[len(prefix):]}"] = name
    return spelled


class Anchors:
    """The anchors of one wrapped model: checked at compile, filled by every call."""

    def __init__(self, requested: dict[str, AnchorSpec], model: nn.Module, *,
                 training: bool, in_process: bool, default_mode: OutputMode,
                 default_period: int, loss_index: int | None = None) -> None:
        self.model, self.training, self.loss_index = model, training, loss_index
        own = tensor_names(model, training=training, in_process=in_process)
        spelled = poptorch_spellings(own)
        self.names = [*own, *spelled]
        self._requested: dict[str, tuple[str, OutputMode, int]] = {}
        for short, spec in requested.items():
            long = spec["long_name"]
            self._check_name(short, long, in_process=in_process)
            long = spelled.get(long, long)
            self._requested[short] = (long, *self._mode_of(short, spec, default_mode,
                                                           default_period))
        self._values: dict[str, Any] = {}
        self._live: dict[str, OutputCollector] = {}
        self._activations: dict[str, object] = {}  # modules' outputs, tensors detached
        self._hooks = [model.get_submodule(long).register_forward_hook(self._keeper(long))
                       for long, _, _ in self._requested.values() if self._is_activation(long)]

    def _check_name(self, short: str, long: str, *, in_process: bool) -> None:
        if long in self.names:
            return
        close = difflib.get_close_matches(long, self.names, n=3)
        hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
        where = ("" if in_process or long not in dict(self.model.named_modules())
                 else " (module outputs can be anchored only when the model runs in this "
                      "process, not in stage worker processes)")
        raise ConfigError(f"anchorTensor({short!r}, {long!r}): no tensor named {long!r} in this "
                          f"model{where}{hint}. getTensorNames() lists the names")

    def _mode_of(self, short: str, spec: AnchorSpec, default_mode: OutputMode,
                 default_period: int) -> tuple[OutputMode, int]:
        """The anchor's output mode and period; None or Default means the model's own."""
        if spec["output_mode"] in (None, OutputMode.Default):
            return default_mode, default_period
        mode = OutputMode(spec["output_mode"])
        if self._per_call(spec["long_name"]) and mode != OutputMode.Final:
            raise ConfigError(
                f"anchorTensor({short!r}, {spec['long_name']!r}, {mode!r}): it has one value "
                "per call (after its last optimiser step); anchor it with OutputMode.Final")
        return mode, spec["output_return_period"] if mode == OutputMode.EveryN else 1

    def _per_call(self, long: str) -> bool:
        return long == LOSS_SCALE or long.startswith((GRADIENT, UPDATED))

    def _is_activation(self, long: str) -> bool:
        modules = dict(self.model.named_modules())
        return long != LOSS and not self._per_call(long) and long in modules

    def _keeper(self, long: str) -> Callable[[nn.Module, tuple[Tree, ...], Tree], None]:
        def keep(module: nn.Module, args: tuple[Tree, ...], output: Tree) -> None:
            self._activations[long] = output.detach() if isinstance(output, torch.Tensor) else output
        return keep

    # -- one call ---------------------------------------------------------------------------
    def tee(self, collector: Collector, *, steps: int, replicas: int) -> Collector:
        """A collector feeding `collector` and every per-micro-batch anchor of this call."""
        self._live = {short: OutputCollector(resolve_mode(mode, training=self.training),
                                             steps=steps, replicas=replicas, period=period)
                      for short, (long, mode, period) in self._requested.items()
                      if not self._per_call(long) and long in (LOSS, *self._activation_names())}
        return _Tee(self, collector) if self._live else collector

    def _activation_names(self) -> list[str]:
        return [long for long, _, _ in self._requested.values() if self._is_activation(long)]

    def add(self, step: int, replica: int, output: Tree) -> None:
        for short, collector in self._live.items():
            long = self._requested[short][0]
            if not collector.wants(step):
                continue
            if long == LOSS:
                assert self.loss_index is not None  # training models have one
                collector.add(step, replica, find_loss(output, self.loss_index).detach())
            elif long in self._activations:
                collector.add(step, replica, self._activations[long])
            else:
                raise ConfigError(
                    f"anchorTensor({short!r}, {long!r}): the module {long!r} did not run in "
                    "this process (it runs in a stage worker, or forward never calls it); "
                    "module outputs can be anchored only for a model that runs in this process")

    def after_call(self, engine: Engine) -> None:
        """Read this call's values; per-call ones after copying them back from the device."""
        if self.per_call():
            if self.wants_gradients():
                engine.pull_gradients()
            engine.pull()
        self._finish(engine.model, engine.optimizer)

    def _finish(self, engine_model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        for short, collector in self._live.items():
            self._values[short] = collector.result()
        params = held(engine_model, "_parameters")  # read without copying weights back
        for short, (long, _, _) in self._requested.items():
            if long == LOSS_SCALE:
                self._values[short] = torch.tensor(last_step_scale(optimizer) if optimizer else 1.0)
            elif long.startswith(GRADIENT):
                grad = params[long[len(GRADIENT):]].grad
                self._values[short] = None if grad is None else grad.detach().to("cpu", copy=True)
            elif long.startswith(UPDATED):
                self._values[short] = params[long[len(UPDATED):]].detach().to("cpu", copy=True)
        self._activations.clear()

    def per_call(self) -> bool:
        return any(self._per_call(long) for long, _, _ in self._requested.values())

    def wants_gradients(self) -> bool:
        return any(long.startswith(GRADIENT) for long, _, _ in self._requested.values())

    def get(self, short_name: str) -> Any:
        if short_name not in self._requested:
            raise KeyError(f"getAnchoredTensor: {short_name!r} is not an anchored tensor; anchored:"
                           f" {sorted(self._requested)}. Anchor it first with "
                           "Options.anchorTensor(short_name, long_name)")
        if short_name not in self._values:
            raise RuntimeError(f"getAnchoredTensor({short_name!r}): the model has not run yet; "
                               "anchored tensors are filled by each call of the model")
        return self._values[short_name]

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()


class _Tee:
    """A collector that also hands every micro-batch's output to the anchors."""

    def __init__(self, anchors: Anchors, main: Collector) -> None:
        self._anchors, self._main = anchors, main

    def wants(self, step: int) -> bool:
        return self._main.wants(step) or any(c.wants(step) for c in self._anchors._live.values())

    def add(self, step: int, replica: int, output: Tree) -> None:
        self._main.add(step, replica, output)
        self._anchors.add(step, replica, output)

    def result(self) -> Any:
        return self._main.result()


def table(anchors: Anchors | None) -> Anchors:
    """A wrapper's anchors, once it is compiled (getAnchoredTensor, getTensorNames)."""
    if anchors is None:
        raise RuntimeError("Model has not been compiled or has been destroyed. Call the "
                           "model (or compile()) first")
    return anchors
