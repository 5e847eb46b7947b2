"""What PopTorch checks or decides around a wrapped model's call: buffers unchanged since
compilation, tensors on the model's device, output periods, the mean-reduction strategy it
picks, and torch's common failures of a forward told in terms of the user's inputs."""
from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from pipetorch.enums import MeanReductionStrategy, OutputMode
from pipetorch.errors import (
    ConfigError, DeviceMismatchError, Error, ModelChangedError, NonFiniteError,
)
from pipetorch.partition.export import Tree
from pipetorch.runtime.anchors import GRADIENT, LOSS_SCALE, UPDATED, Collector
from pipetorch.weights.host_copy import held
from pipetorch.tracebacks import HINTS, error_kind, user_line_of

if TYPE_CHECKING:
    from pipetorch.options import Options
    from pipetorch.runtime.batching import InputName

__all__: list[str] = []

_MISMATCH = ("Expected all tensors to be on the same device", "is not on the expected device")


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


def _wants_running(optimizer: torch.optim.Optimizer) -> bool:
    """Whether PopTorch needs the Running mean strategy for `optimizer`: float16
    accumulators (accum_type), unless its combined accumulators only support Post."""
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    accum = group.get("accum_type", getattr(optimizer, "accum_type", None))
    combined = group.get("use_combined_accum", getattr(optimizer, "use_combined_accum", False))
    return accum == torch.float16 and not combined


def resolve_mean_strategy(optimizer: torch.optim.Optimizer, *options: Options) -> None:
    """PopTorch picks Running for float16 accumulators (unless combined), even over a
    strategy the user chose, else keeps the user's choice or Post; the choice is readable on
    the user's options afterwards."""
    if _wants_running(optimizer):
        strategy = MeanReductionStrategy.Running
    elif options[0].Training._strategy_chosen:
        return
    else:
        strategy = MeanReductionStrategy.Post
    for o in options:  # frozen by now: this is the compile-time decision, not a user edit
        o.Training._values["mean_accumulation_and_replication_reduction_strategy"] = strategy


def check_mean_strategy_kept(optimizer: torch.optim.Optimizer, options: Options) -> None:
    """setOptimizer on a compiled model: an optimiser that needs the Running strategy cannot
    replace one compiled with another (PopTorch's ValueError)."""
    strategy = options.Training.meanAccumulationAndReplicationReductionStrategy
    if _wants_running(optimizer) and strategy != MeanReductionStrategy.Running:
        raise ValueError(
            "Invalid optimizer: the new optimizer would require changing options.Training."
            "meanAccumulationAndReplicationReductionStrategy to "
            "poptorch.MeanReductionStrategy.Running but the executable is already compiled "
            f"with {strategy}. Keep the compiled accum_type (float16 accumulators need "
            "Running), or build a new trainingModel")


def check_return_periods(options: Options) -> None:
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



def check_inference_accumulation(options: Options) -> None:
    """An inference wrapper refuses gradientAccumulation > 1, in PopTorch's words."""
    g = options.Training.gradient_accumulation
    if g == 1:
        return
    from pipetorch.partition.strategies import PipelinedExecution
    pipelined = isinstance(options.execution_strategy, PipelinedExecution)
    raise ConfigError(
        "You must set poptorch.Options().Training.gradientAccumulation to 1 or leave it as its "
        "default value (1) when running a poptorch.inferenceModel()."
        + (" Use poptorch.Options().deviceIterations to process a sufficient number of batches "
           "each run for pipelined execution instead." if pipelined else "")
        + f" It is {g}; gradient accumulation only applies to training")


def check_trainable(model: nn.Module) -> None:
    """A training model needs a parameter to train (else its backward has nothing to reach)."""
    params = held(model, "_parameters")
    if any(p.requires_grad for p in params.values()):
        return
    name = type(model).__name__
    if not params:
        problem = f"{name} has no parameters"
    else:
        problem = (f"none of {name}'s {len(params)} parameters requires a gradient (e.g. "
                   f"{next(iter(params))!r} has requires_grad=False)")
    raise ConfigError(
        f"trainingModel: {problem}, so training would have nothing to update. Make the "
        "weights to train trainable (param.requires_grad_(True)) before wrapping, or run the "
        "model with poptorch.inferenceModel")


def check_optimizer_params(optimizer: torch.optim.Optimizer, model: nn.Module, *,
                           where: str) -> None:
    """Every parameter the optimiser updates must be one of the model's (not a copy's)."""
    own = {id(p) for p in held(model, "_parameters").values()}
    for number, group in enumerate(optimizer.param_groups):
        strangers = [p for p in group["params"] if id(p) not in own]
        if strangers:
            shapes = [list(p.shape) for p in strangers[:3]]
            raise ConfigError(
                f"{where}: the optimizer's param group {number} holds {len(strangers)} of "
                f"{len(group['params'])} tensors (shapes {shapes}{', ...' if len(strangers) > 3 else ''}) "
                f"that are not parameters of the wrapped {type(model).__name__}: it was built "
                "for another model, or for a copy (copy.deepcopy makes new parameters). Build "
                f"it from this model: {type(optimizer).__name__}(model.parameters(), ...) with "
                "the model you wrap")


# -- torch's common failures of forward, in the user's terms ---------------------------------
def _same_kind(error: BaseException, message: str) -> BaseException:
    """`message` as the builtin class of `error` (scripts catching RuntimeError still do)."""
    for cls in (IndexError, TypeError, ValueError, RuntimeError):
        if isinstance(error, cls):
            return cls(message)
    return RuntimeError(message)


def _described(names: Sequence[InputName], leaves: Sequence[object]) -> str:
    return ", ".join(f"{n.label} {list(x.shape)} {x.dtype}"
                     for n, x in zip(names, leaves, strict=True) if isinstance(x, torch.Tensor))


def explain_forward_error(error: BaseException, names: Sequence[InputName],
                          call: Sequence[object], micro: Sequence[object],
                          model_dtype: torch.dtype | None) -> str | None:
    """torch's message of a failed forward (on the first micro-batch, on the host) retold:
    which input (name, shape, dtype, values), the user's line, and the fix; None if torch's
    message is not one of the common kinds."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    kind = error_kind(str(error))
    if kind is None:
        return None
    line = user_line_of(error)
    where = f" at {line}" if line else ""
    said = f"torch: {text}{where}"
    if kind == "not_tensor":
        bad = [(n, x) for n, x in zip(names, call, strict=True)
               if isinstance(x, (int, float)) and n.inner]
        if bad:
            name = bad[0][0]
            return (f"{name.argument} is a list or tuple of Python numbers where the model needs "
                    f"a tensor ({said}). Pass torch.tensor({name.argument_expr}) instead")
        return f"The model received a value that is not a tensor ({said}). {HINTS[kind]}"
    if kind == "dtype":
        odd = [(n, x) for n, x in zip(names, micro, strict=True) if isinstance(x, torch.Tensor)
               and model_dtype is not None and x.dtype != model_dtype]
        if odd and model_dtype is not None:
            from pipetorch.runtime.batching import conversion
            shown = ", ".join(f"{n.label} is {x.dtype}" for n, x in odd)
            return (f"{shown}, but the model's weights are {model_dtype} ({said}). "
                    f"{HINTS[kind]}, e.g. {odd[0][0].expr}{conversion(model_dtype)}")
        return f"An input's dtype does not suit the model ({said}). {HINTS[kind]}"
    if kind == "target":
        integers = [(n, x) for n, x in zip(names, call, strict=True) if isinstance(x, torch.Tensor)
                    and not x.is_floating_point() and x.numel()]
        ranges = "; ".join(f"{n.label} holds {int(x.min())}..{int(x.max())}" for n, x in integers)
        return (f"A label is out of range for the loss ({said})"
                f"{'; ' + ranges if ranges else ''}. {HINTS[kind]}")
    return (f"The model's forward failed on the first micro-batch, whose inputs are "
            f"{_described(names, micro)} ({said}). {HINTS[kind]}")


@contextlib.contextmanager
def forward_errors_explained(names: Sequence[InputName], call: Sequence[object],
                             micro: Callable[[], Sequence[object]],
                             model_dtype: torch.dtype | None) -> Iterator[None]:
    """Retell torch's common failures of the host's run of forward (compiling probes it on
    the first micro-batch) with the inputs' names; `micro()` gives that micro-batch's leaves."""
    try:
        yield
    except (RuntimeError, TypeError, ValueError, IndexError) as error:
        if isinstance(error, Error):
            raise
        message = explain_forward_error(error, names, call, micro(), model_dtype)
        if message is None:
            raise
        raise _same_kind(error, message) from error


# -- Options.checkNonFinite -------------------------------------------------------------------
def _non_finite(x: torch.Tensor) -> str | None:
    """"nan", "inf" or "nan and inf" when floating tensor `x` holds such values, else None."""
    if not x.is_floating_point() or bool(torch.isfinite(x).all()):
        return None
    kinds = [k for k, found in (("nan", torch.isnan(x).any()), ("inf", torch.isinf(x).any()))
             if bool(found)]
    return " and ".join(kinds)


def check_finite_inputs(names: Sequence[InputName], leaves: Sequence[object], *,
                        micro_batches: int) -> None:
    """Refuse, before anything runs, a call whose tensor inputs hold NaN or Inf."""
    for name, x in zip(names, leaves, strict=True):
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            continue
        found = _non_finite(x)
        if found:
            bad = (~torch.isfinite(x)).reshape(x.shape[0], -1).any(dim=1)
            sample = int(bad.nonzero()[0])
            raise NonFiniteError(
                f"checkNonFinite: {name.label} holds {found} (first at sample {sample}, "
                f"micro-batch {sample // max(1, x.shape[0] // micro_batches)} of this call): "
                "the data is broken "
                "before the model sees it. Clean or filter it in the dataset (e.g. "
                "torch.nan_to_num), or find what produced it")


class NonFiniteWatch:
    """A collector that sees every micro-batch's outputs and remembers the first whose
    tensors hold NaN or Inf; the call's own collector gets what it asked for."""

    def __init__(self, inner: Collector, *, gradient_accumulation: int, replicas: int,
                 training: bool) -> None:
        self._inner, self._g, self._replicas, self._training = (
            inner, gradient_accumulation, replicas, training)
        self.first: tuple[int, int, str, str] | None = None  # step, replica, where, kind
        self.count = 0

    def wants(self, step: int) -> bool:
        return True

    def add(self, step: int, replica: int, output: Tree) -> None:
        from pipetorch.runtime.batching import keyed_leaves

        for path, leaf in keyed_leaves(output):
            if not isinstance(leaf, torch.Tensor):
                continue
            found = _non_finite(leaf)
            if found:
                self.count += 1
                where = f"output{pytree.keystr(path)}" if path else "the output"
                if self._training and leaf.dim() == 0:
                    where += " (the loss)"
                if self.first is None or (step, replica) < self.first[:2]:
                    self.first = (step, replica, where, found)
                break
        if self._inner.wants(step):
            self._inner.add(step, replica, output)

    def result(self) -> Any:
        return self._inner.result()

    def check(self) -> None:
        """Raise NonFiniteError naming the first non-finite micro-batch of the call."""
        if self.first is None:
            return
        step, replica, where, found = self.first
        iteration, accumulation = divmod(step, self._g)
        micro = step * self._replicas + replica
        after = (" This call's optimiser steps ran: the model holds the weights after them."
                 if self._training else "")
        raise NonFiniteError(
            f"checkNonFinite: {where} of micro-batch {micro} (device iteration {iteration}, "
            f"accumulation step {accumulation}, replica {replica}) is {found}; it is the first "
            f"of {self.count} non-finite micro-batch(es) in this call.{after} Look for what "
            "overflows at that micro-batch: lower the learning rate, clip gradients "
            "(max_grad_norm), use loss scaling for float16, or check that micro-batch's data")


def warn_non_finite_weights(model: nn.Module, logger: logging.Logger, *, calls: int) -> bool:
    """Warn (and return True) when `model`'s parameters hold NaN or Inf."""
    bad = [name for name, p in model.named_parameters() if _non_finite(p.detach())]
    if bad:
        logger.warning(
            "checkNonFinite: after call %d the weights %s%s hold NaN or Inf: every later output "
            "will be non-finite. Reload a checkpoint or the weights before the failing call, "
            "lower the learning rate or clip gradients (this warning is given once per "
            "wrapper)", calls, bad[:4], " ..." if len(bad) > 4 else "")
    return bool(bad)
