"""`trainingModel` / `inferenceModel`: the wrapper that runs a model on its devices."""
from __future__ import annotations

import copyreg
import functools
import datetime
import inspect
import logging
import os
import re
import sys
import time
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from pipetorch import extensions, log_level
from pipetorch.errors import (
    AlreadyWrappedError, ConfigError, DeviceError, InputArgumentError, InputMismatchError,
    OfflineDeviceError,
)
from pipetorch.enums import ConnectionType
from pipetorch.optim import attributes, ipu_param, ipu_state, scaling
from pipetorch.options import popart_names
from pipetorch.printing import module_repr
from pipetorch.runtime import artefact, counters, wrapping
from pipetorch.weights import host_copy
from pipetorch.runtime.anchors import Anchors
from pipetorch.runtime.batching import (
    Signature, cast_float_inputs, check_batch, forward_parameters, half_dtype,
    input_names,
    plain_containers, split_micro_batches, to_device,
)
from pipetorch.runtime.checks import (
    NonFiniteWatch, buffer_ids, check_buffers, check_finite_inputs,
    check_inference_accumulation, check_optimizer_params, check_return_periods,
    check_trainable, device_mismatch_explained, forward_errors_explained,
    check_mean_strategy_kept, held, resolve_mean_strategy, warn_non_finite_weights,
)
from pipetorch.runtime.compile import Compiled, add_signature, compile_model
from pipetorch.runtime.config import run_config
from pipetorch.parallel.devices import default_device
from pipetorch.runtime.optimizer import (
    copy_hyperparameters, copy_scaling_to_host, copy_state_to_device, copy_state_to_host,
    default_optimizer,
)
from pipetorch.parallel.outputs import OutputCollector, resolve_mode

__all__ = ["PoplarExecutor", "trainingModel", "inferenceModel", "load"]

logger = logging.getLogger(__name__)

# user model -> its live training wrapper: two would train diverging device copies.
_training_wrappers: "weakref.WeakKeyDictionary[nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()
class _TrainingOutput(torch.Tensor):
    """A returned tensor whose `.backward()` explains that training already happened."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self, **kwargs: Any) -> str:  # print like the tensor it is
        return repr(self.as_subclass(torch.Tensor))

    def backward(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        # PopTorch returns plain tensors: torch's own message is what scripts match.
        raise RuntimeError(
            "element 0 of tensors does not require grad and does not have a grad_fn: "
            "backward() was called on an output of a pipetorch trainingModel, whose forward "
            "pass, backward pass and optimiser step already ran inside the call. Use the "
            "returned loss for logging only; to train a plain PyTorch model, call the model itself")


def _mark_training_output(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return torch.Tensor._make_subclass(_TrainingOutput, x)
    return x


class PoplarExecutor(counters.PerfCounters, artefact.Exports):
    """A model wrapped for its devices; call it like the model, with a host call's batch."""

    def __init__(self, model: nn.Module, options: Any = None, *, training: bool,
                 optimizer: torch.optim.Optimizer | None = None,
                 user_model: nn.Module | None = None,
                 poptorch_version: str | None = None) -> None:
        """PopTorch's constructor: `model` is what runs; `user_model` (default `model`), a
        module sharing its parameters, is the one whose attributes the wrapper shows, as when
        a loss wrapper runs around the user's model. `poptorch_version` is recorded only."""
        from pipetorch.options import Options

        if isinstance(model, PoplarExecutor):
            model = model._user_model  # PopTorch wraps a wrapper's model (e.g. for inference)
        if not isinstance(model, nn.Module):
            raise TypeError(f"Expected a torch.nn.Module to wrap, got {type(model).__name__}")
        options = Options() if options is None else options
        if not isinstance(options, Options):
            raise TypeError(f"options must be a pipetorch.Options, got {type(options).__name__}")
        popart_names.check(options._Popart.options)  # PopTorch checks them at compile
        options._freeze(by=f"poptorch.{'trainingModel' if training else 'inferenceModel'}")
        own = options.clone()
        mode = resolve_mode(own.output_mode, training=training)
        own.outputMode(mode, **({"output_return_period": own.output_return_period}
                                if mode.name == "EveryN" else {}))
        own._freeze()
        if not training:
            check_inference_accumulation(own)
        check_return_periods(own)
        if training:
            check_trainable(model)
            if optimizer is not None:
                check_optimizer_params(optimizer, model, where="trainingModel")
            other = _training_wrappers.get(model)
            if other is not None and other() is not None:
                raise AlreadyWrappedError(
                    "Model has already been wrapped in 'poptorch.trainingModel'. Call "
                    "model.destroy() on the model to unwrap before wrapping again (this "
                    "destroys its live trainingModel, whose device copy would otherwise train "
                    "apart)")
            _training_wrappers[model] = weakref.ref(self)
        wrapping.register(model, self)
        if training and optimizer is None:
            optimizer = default_optimizer(model)
        if training:
            resolve_mean_strategy(optimizer, options, own)
        log_level.limit_repeats(own.max_repeat_logs)
        self._user_model, self._options, self._training = model, own, training
        self._shown_model = model if user_model is None else user_model
        self._poptorch_version = poptorch_version
        self._params = forward_parameters(model)
        self._user_optimizer = optimizer
        self._device = default_device()
        self._compiled: Compiled | None = None
        self._signature: Signature | None = None  # the signature the engine runs now
        # every signature compiled for (inputSignatures("several")), with its synthetic inputs
        self._signatures: list[tuple[Signature, list | None]] = []
        self._sync: host_copy.HostSync | None = None
        self._uploaded_generation = -1
        self._attached = True
        self._profiler: Any = None
        self._anchors: Anchors | None = None
        self._buffer_ids: dict[str, int] | None = None
        self._profile_writer: weakref.finalize | None = None
        self._optimizer_record: attributes.Compiled | None = None
        self._times: counters.CallTimes | None = None
        self._calls = 0  # calls checked by checkNonFinite
        self._state_stale = False  # the device's optimiser state is newer than the user's
        self._warned_weights = False
        self._from_prompts = False  # compiled by generate() from its prompts, not by a call

    # -- calls ------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self._attached:
            raise DeviceError("The model is detached from its device: call attachToDevice() first")
        args, kwargs = self._cast_inputs(*self._bound(args, kwargs))
        signature = Signature.of(args, kwargs, self._params)
        problem = self._signature.mismatch(signature) if self._signature else None
        if problem and self._from_prompts:  # the user never chose generate()'s signature
            logger.info("Compiling again for this call's inputs (generate() compiled the "
                        "model from its prompts: %s)", problem)
            self.destroy()
            wrapping.register(self._user_model, self)  # it lives on: model.destroy() reaches it
        elif problem:
            self._switch_signature(args, kwargs, signature, problem)
        self._from_prompts = False
        o = self._options
        if o.check_non_finite:
            check_finite_inputs(input_names(args, kwargs, self._params),
                                pytree.tree_leaves((args, kwargs)), micro_batches=(
                                    o.device_iterations * o.Training.gradient_accumulation
                                    * o.replication_factor))
        compiled = self._compiled or self._compile(args, kwargs, signature)
        if self._offline():
            raise OfflineDeviceError(
                "Trying to run a model on an offline device (ConnectionType.Never, set by "
                "Options.useOfflineIpuTarget() or connectionType()): such a model compiles "
                "(compile(), compileAndExport()) but never runs. Remove the option to run it")
        check_buffers(self._user_model, self._buffer_ids)
        if not self._training:
            self._refresh_from_host()
        times = counters.CallTimes()
        if compiled.synthetic is None:  # one move of the whole call, then views of it
            args, kwargs = to_device((args, kwargs), compiled.engine.input_device)
        micro = compiled.synthetic or split_micro_batches(
            args, kwargs, device_iterations=o.device_iterations,
            gradient_accumulation=o.Training.gradient_accumulation,
            replication_factor=o.replication_factor)
        collector = OutputCollector(o.output_mode, steps=compiled.engine.batching.steps,
                                    replicas=o.replication_factor, period=o.output_return_period)
        assert self._anchors is not None
        collector = self._anchors.tee(collector, steps=compiled.engine.batching.steps,
                                      replicas=o.replication_factor)
        watch = None
        if o.check_non_finite:
            collector = watch = NonFiniteWatch(
                collector, gradient_accumulation=o.Training.gradient_accumulation,
                replicas=o.replication_factor, training=self._training)
        times.stamp("input_complete")
        start = time.monotonic_ns()
        with device_mismatch_explained(self._device):
            self._run(compiled, micro, collector)
        times.stamp("output")
        self._anchors.after_call(compiled.engine)
        if self._profiler is not None:
            items = next(leaf.shape[0] for leaf in pytree.tree_leaves((args, kwargs))
                         if isinstance(leaf, torch.Tensor))
            self._profiler.record_call(start, time.monotonic_ns(), items)
        result = collector.result()
        times.stamp("output_complete")
        self._times = times
        if watch is not None:
            self._check_non_finite(compiled, watch)
        if self._training:
            return pytree.tree_map(_mark_training_output, result)
        return result

    def _check_non_finite(self, compiled: Compiled, watch: NonFiniteWatch) -> None:
        """checkNonFinite after a call: weights (warned once per wrapper), then outputs."""
        self._calls += 1
        if self._training and not self._warned_weights:
            assert self._sync is not None
            self._sync.run(self._pull)  # the device's weights into the host copy
            self._warned_weights = warn_non_finite_weights(compiled.engine.model, logger,
                                                           calls=self._calls)
        watch.check()

    def _cast_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """PopTorch casts float32 inputs of a half model to its dtype (and gives forward
        plain dicts for dict subclasses)."""
        args, kwargs = plain_containers((args, kwargs))
        dtype = half_dtype(held(self._user_model, "_parameters").values())
        return cast_float_inputs(args, kwargs, dtype)

    def _run(self, compiled: Compiled, micro: list, collector: Any) -> None:
        if self._training:
            compiled.engine.train(micro, collector)
            # The steps ran on the device: a learning-rate scheduler stepping the user's
            # optimizer must not warn that optimizer.step() was never called.
            self._user_optimizer._opt_called = True  # type: ignore[union-attr]
            assert self._sync is not None
            self._sync.mark_stale(self._fetch)
            self._state_stale = True
        else:
            compiled.engine.infer(micro, collector)

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """Prepare the model for these inputs without running it (with
        Options.inputSignatures("several"), for one more signature when already compiled)."""
        args, kwargs = self._cast_inputs(*self._bound(args, kwargs))
        signature = Signature.of(args, kwargs, self._params)
        problem = self._signature.mismatch(signature) if self._signature else None
        if problem and self._options.input_signatures == "several":
            self._switch_signature(args, kwargs, signature, problem)
            return
        self._compile(args, kwargs, signature)

    def _switch_signature(self, args: tuple, kwargs: dict, signature: Signature,
                          problem: str) -> None:
        """Run `signature` from this call on: PopTorch's InputMismatchError by default; with
        Options.inputSignatures("several"), that signature's stages on the same engine (made
        on its first call, logged with the time it took)."""
        if self._options.input_signatures != "several":
            raise InputMismatchError(
                f"This model was compiled for other inputs: {problem}. A wrapped model runs one "
                "input signature: call it with the arguments, shapes and dtypes of its first "
                "call; for new inputs build a new trainingModel/inferenceModel, or call "
                "destroy() first (pipetorch's Options.inputSignatures(\"several\") lets one "
                "wrapper run several)")
        compiled = self._compiled
        assert compiled is not None
        for key, (known, synthetic) in enumerate(self._signatures):
            if known.mismatch(signature) is None:
                compiled.engine.use(key)
                compiled.synthetic, self._signature = synthetic, known
                return
        names = self._check_inputs(args, kwargs)
        start = time.perf_counter()
        with device_mismatch_explained(self._device), forward_errors_explained(
                names, pytree.tree_leaves((args, kwargs)),
                lambda: self._first_micro_batch(args, kwargs), None):
            key, synthetic = add_signature(compiled, args, kwargs,
                                           config=run_config(self._options),
                                           training=self._training, device=self._device)
        assert key == len(self._signatures)
        self._signatures.append((signature, synthetic))
        compiled.engine.use(key)
        compiled.synthetic, self._signature = synthetic, signature
        logger.warning(
            "Input signature %d added in %.2fs (captured and split for this call's inputs, "
            "which differ from the last call's: %s); it runs on the same devices, weights and "
            "optimiser state (Options.inputSignatures)", key + 1, time.perf_counter() - start,
            problem)

    def _bound(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The call as forward's full argument list, defaults filled in, as PopTorch's
        arguments parser reads it: `(x, y)`, `(x, labels=y)` and `(x)` with `labels=y` as
        default are one input signature. A call forward cannot take is refused here."""
        forward = getattr(self._user_model.forward, "__func__", self._user_model.forward)
        cached = self.__dict__.get("_forward_signature")
        if cached is None or cached[0] is not forward:
            try:
                cached = (forward, inspect.signature(self._user_model.forward))
            except (TypeError, ValueError):  # no Python signature: forward itself will say
                cached = (forward, None)
            self.__dict__["_forward_signature"] = cached
        signature = cached[1]
        if signature is None:
            return args, kwargs
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as error:
            required = re.match(r"missing a required argument: '(\w+)'", str(error))
            lead = f"Mandatory parameter {required.group(1)} missing: " if required else ""
            raise InputArgumentError(
                f"{lead}{type(self._user_model).__name__}.forward{signature} cannot take this "
                f"call: {error}. Call the wrapped model with the arguments of the model's "
                "forward") from None
        bound.apply_defaults()
        return bound.args, bound.kwargs

    def _check_inputs(self, args: tuple, kwargs: dict) -> tuple:
        """Refuse, before anything runs, a first call forward cannot take or whose tensors
        cannot be cut into micro-batches; the inputs' names for later messages."""
        self._bound(args, kwargs)
        names = input_names(args, kwargs, self._params)
        o = self._options
        check_batch(args, kwargs, device_iterations=o.device_iterations,
                    gradient_accumulation=o.Training.gradient_accumulation,
                    replication_factor=o.replication_factor, names=names)
        return names

    def _first_micro_batch(self, args: tuple, kwargs: dict) -> list[Any]:
        o = self._options
        return pytree.tree_leaves(split_micro_batches(
            args, kwargs, device_iterations=o.device_iterations,
            gradient_accumulation=o.Training.gradient_accumulation,
            replication_factor=o.replication_factor)[0])

    def _compile(self, args: tuple, kwargs: dict, signature: Signature) -> Compiled:
        if self._compiled is not None:
            raise ValueError("The model is already compiled: call destroy() to compile again")
        names = self._check_inputs(args, kwargs)
        dtypes = {p.dtype for p in held(self._user_model, "_parameters").values()
                  if p.is_floating_point()}
        extensions.run_pre_compile_hooks()
        if self._training:
            self._link_optimizer(self._user_optimizer)
        with device_mismatch_explained(self._device), forward_errors_explained(
                names, pytree.tree_leaves((args, kwargs)),
                lambda: self._first_micro_batch(args, kwargs),
                dtypes.pop() if len(dtypes) == 1 else None):
            self._compiled = compile_model(
                self._user_model, args, kwargs, config=run_config(self._options),
                training=self._training, optimizer=self._user_optimizer, device=self._device)
        self._signature = signature
        self._signatures = [(signature, self._compiled.synthetic)]
        o, engine = self._options, self._compiled.engine
        try:
            self._anchors = Anchors(
                o.anchored_tensors, engine.model, training=self._training,
                in_process=engine.in_process, default_mode=o.output_mode,
                default_period=o.output_return_period,
                loss_index=self._compiled.capture.loss_index)
        except ConfigError:
            self.destroy()  # a bad anchor name: stop the workers; fix the options, wrap again
            raise
        if self._options.profiling_dir:
            self._start_profiler(args, kwargs)
        self._sync = host_copy.attach(self._user_model, self._shown_model)
        if engine.optimizer is not None and self._user_optimizer is not None:
            # From compile on, the user's optimiser reports the device's loss scale (ipu_state's
            # lossScaleUpdateFactor), as PopTorch's does before the first call.
            scaling.load_scaling_state(self._user_optimizer,
                                       scaling.scaling_state(engine.optimizer))
        self._buffer_ids = buffer_ids(self._user_model)
        self._uploaded_generation = self._sync.generation
        extensions.run_post_compile_hooks()
        return self._compiled

    def _start_profiler(self, args: tuple, kwargs: dict) -> None:
        """Reports go to <profiling dir>/training or /inference, rewritten at detach/destroy/exit."""
        from pipetorch.profiling.recorder import Profiler

        assert self._compiled is not None
        o = self._options
        sample = to_device(split_micro_batches(
            args, kwargs, device_iterations=o.device_iterations,
            gradient_accumulation=o.Training.gradient_accumulation,
            replication_factor=o.replication_factor)[0], self._compiled.engine.input_device)
        directory = os.path.join(o.profiling_dir, "training" if self._training else "inference")
        try:  # now, not at destroy(): a report that cannot be written must not be lost
            os.makedirs(directory, exist_ok=True)
        except OSError as error:
            self.destroy()
            raise ConfigError(
                f"The profiling report directory {directory!r} cannot be created "
                f"({error.strerror or error}); it comes from opts.enableProfiling() or "
                "POPLAR_ENGINE_OPTIONS autoReport.directory. Name a directory this process "
                "can write to, then wrap the model again") from error
        self._profiler = Profiler(directory, self._compiled, training=self._training, options=o,
                                  sample=sample)
        self._profile_writer = weakref.finalize(self, _write_report, self._profiler)

    def _write_profile(self) -> None:
        if self._profile_writer is not None:
            self._profile_writer()  # at most once; a later call starts a new profiler
        self._profiler, self._profile_writer = None, None

    # -- anchored tensors -------------------------------------------------------------------
    def getAnchoredTensor(self, short_name: str) -> Any:
        """The value of the tensor anchored as `short_name` by Options.anchorTensor, from the
        last call (see pipetorch.runtime.anchors for the names)."""
        return self._anchor_table().get(short_name)

    def getTensorNames(self) -> list[str]:
        """Every tensor name Options.anchorTensor accepts for this model."""
        return list(self._anchor_table().names)

    def _anchor_table(self) -> Anchors:
        if self._anchors is None:
            raise RuntimeError("Model has not been compiled or has been destroyed. Call the "
                               "model (or compile()) first")
        return self._anchors

    # -- weights ----------------------------------------------------------------------------
    def _fetch(self) -> None:
        # PopTorch's lazy copy calls the wrapper's copyWeightsToHost, which scripts and tests
        # replace to count copies (`deviceToHostCounter`).
        self.copyWeightsToHost()

    def _pull(self) -> None:
        """The device's weights into the user's model (PopTorch's implicit copy to the host:
        weights only; the optimiser's state comes when the optimiser is read)."""
        assert self._compiled is not None
        engine = self._compiled.engine
        engine.pull()
        if engine.model is not self._user_model:
            host_copy.copy_state(engine.model, self._user_model)
        if engine.optimizer is not None and self._user_optimizer is not None:
            copy_scaling_to_host(engine.optimizer, self._user_optimizer)

    def _pull_optimizer_state(self) -> None:
        """The device's optimiser state into the user's optimiser, stage by stage, when the
        user reads it (state_dict(), ipu_state) after training calls."""
        compiled = self._compiled
        if compiled is None or compiled.engine.optimizer is None or self._user_optimizer is None:
            return
        if not self._state_stale:
            logger.debug("Using cached optimiser state dict")
            return
        self._state_stale = False  # first: loading the state reads the optimiser again
        logger.debug("Writing optimiser state tensors from IPU to host.")
        compiled.engine.pull(optimizer_state=True)
        copy_state_to_host(compiled.engine.optimizer, self._user_optimizer)

    def _refresh_from_host(self) -> None:
        """Inference wrappers follow weights trained by another wrapper of the same model."""
        assert self._sync is not None and self._compiled is not None
        self._sync.flush()
        if self._sync.generation != self._uploaded_generation:
            host_copy.copy_state(self._user_model, self._compiled.engine.model)
            self._compiled.engine.push()
            self._uploaded_generation = self._sync.generation

    def copyWeightsToHost(self) -> None:
        """Copy the device's weights (and optimiser state) into the user's model now."""
        if self._compiled is not None and self._sync is not None:
            self._sync.run(self._pull)

    def copyWeightsToDevice(self) -> None:
        """Copy the user's model's weights to the device (host edits reach it only this way).

        The host copy is brought to the latest call first when a call trained since it was
        last: the upload holds every tensor from one point of training (docs/precision.md)."""
        if self._compiled is not None and self._sync is not None:
            self._sync.flush()
            host_copy.copy_state(self._user_model, self._compiled.engine.model)
            self._compiled.engine.push()
            self._uploaded_generation = self._sync.generation

    def copyNamedBuffersToDevice(self) -> None:
        """Copy the buffers named by Options.updatableNamedBuffers from the user's model to
        the device (other weights and buffers on the device are kept)."""
        compiled = self._compiled
        if compiled is None:
            raise RuntimeError("Model has not been compiled or has been destroyed. Call the "
                               "model (or compile()) before copyNamedBuffersToDevice()")
        names = self._options.updatable_named_buffers
        if not names:
            raise ConfigError("copyNamedBuffersToDevice: no buffers were named; list them with "
                              "Options.updatableNamedBuffers([...]) before wrapping the model")
        host = dict(self._user_model.named_buffers())
        device = dict(compiled.engine.model.named_buffers())
        missing = [n for n in names if n not in host or n not in device]
        if missing:
            raise ConfigError(f"copyNamedBuffersToDevice: {missing} are not buffers of the "
                              f"model; its buffers are {sorted(host)}")
        with torch.no_grad():
            wanted = {name: host[name].detach().clone() for name in names}
            # the host copy (which may be the user's model itself) must hold the device's
            # latest values first, then the named buffers the user set
            compiled.engine.pull()
            for name in names:
                device[name].copy_(wanted[name])
        compiled.engine.push()

    def setOptimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Send new hyper-parameters (learning rate, ...) to the device; its state is kept.

        The new optimiser may be another object of the same class; attributes that
        `variable_attrs` marks constant must keep their compiled values."""
        if not self._training:
            raise ConfigError("setOptimizer is for trainingModel wrappers; this is an inferenceModel")
        check_optimizer_params(optimizer, self._user_model, where="setOptimizer")
        if self._compiled is None:
            resolve_mean_strategy(optimizer, self._options)  # compiled later: may still change
        if self._compiled is not None and self._compiled.engine.optimizer is not None:
            assert self._optimizer_record is not None
            check_mean_strategy_kept(optimizer, self._options)
            attributes.check_replacement(self._optimizer_record, optimizer)
            copy_hyperparameters(optimizer, self._compiled.engine.optimizer)
            self._compiled.engine.set_hyperparameters()
            if optimizer is not self._user_optimizer:
                assert self._sync is not None
                self._flush_host()  # the old optimiser's state is the device's until now
                ipu_state.unlink(self._user_optimizer)  # type: ignore[arg-type]
                # The new one reads the device's state, and a checkpoint's state it holds
                # (load_state_dict before this call) is pushed from it.
                self._user_optimizer = optimizer
                self._sync.mark_stale(self._fetch)
                self._link_optimizer(optimizer)
        self._user_optimizer = optimizer

    def _offline(self) -> bool:
        return self._options.connection_type == ConnectionType.Never

    def _link_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """`optimizer.state_dict()["ipu_state"]` and write_ipu_state reach this model (not
        an offline one: it has no device state, so they stay None, as in PopTorch)."""
        self._optimizer_record = attributes.record(
            optimizer, automatic_loss_scaling=self._options.Training.auto_loss_scaling)
        if self._offline():
            return
        ipu_param.link(optimizer, self._user_model, sync=self._flush_host,
                       push=self._push_optimizer_state)

    def _flush_host(self) -> None:
        """Before the user's optimiser is read or written: the device's weights and state."""
        if self._sync is not None:
            self._sync.flush()
        self._pull_optimizer_state()

    def _push_optimizer_state(self) -> None:
        """The user's optimiser state (written by write_ipu_state) becomes the device's."""
        if self._compiled is not None and self._compiled.engine.optimizer is not None:
            assert self._user_optimizer is not None
            logger.debug("Writing optimiser state tensors from host to IPU memory")
            copy_state_to_device(self._user_optimizer, self._compiled.engine)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The user model's state_dict, holding the device's latest weights."""
        return self._user_model.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> Any:
        """Load weights into the user model and the device."""
        result = self._user_model.load_state_dict(state_dict, strict=strict)
        self.copyWeightsToDevice()
        return result

    # -- device lifetime --------------------------------------------------------------------
    def detachFromDevice(self) -> None:
        """Release the device; the user's model keeps the trained weights."""
        self._flush_host()
        if self._profiler is not None:
            self._profiler.write()
        if self._compiled is not None and self._attached:
            self._compiled.engine.release()
        self._attached = False

    def attachToDevice(self) -> None:
        """Take the device again, with the user model's current weights."""
        if self._compiled is not None and not self._attached:
            self._compiled.engine.acquire()
        self._attached = True
        self.copyWeightsToDevice()

    def isAttachedToDevice(self) -> bool:
        return self._attached

    def isCompiled(self) -> bool:
        return self._compiled is not None

    def _require_compiled(self, what: str) -> Compiled:
        if self._compiled is None:
            raise RuntimeError(f"{what} needs a compiled model: call the model or compile() first")
        return self._compiled

    def compilationTime(self) -> datetime.timedelta:
        """How long compiling the model took."""
        return datetime.timedelta(seconds=self._require_compiled("compilationTime()").seconds)

    @property
    def rng_state(self) -> list[list[torch.Tensor]]:
        """The devices' random generator states (one list per device process); assign what
        it returned to repeat the random numbers (dropout) from that point."""
        return self._require_compiled("rng_state").engine.rng_state()

    @rng_state.setter
    def rng_state(self, state: list[list[torch.Tensor]]) -> None:
        self._require_compiled("rng_state").engine.rng_state(state)

    def destroy(self) -> None:
        """Free the device copy; the user's model keeps the latest weights."""
        try:
            self._flush_host()  # the optimiser's state too: a new wrapper resumes from it
        finally:
            if self._training and self._user_optimizer is not None:
                ipu_state.unlink(self._user_optimizer)
            wrapping.forget(self._user_model, self)
            if self._sync is not None:
                host_copy.detach(self._sync)
            self._write_profile()
            if self._compiled is not None:
                self._compiled.engine.close()
            if self._anchors is not None:
                self._anchors.remove()
            self._compiled, self._signature, self._sync, self._anchors = None, None, None, None
            self._signatures = []
            self._buffer_ids = None
            if self._training and _training_wrappers.get(self._user_model) is not None:
                if _training_wrappers[self._user_model]() is self:
                    del _training_wrappers[self._user_model]

    def __del__(self) -> None:
        if sys.is_finalizing():  # torch may be half torn down; workers stop via their finalizer
            return
        try:
            self.destroy()
        except Exception:  # interpreter shutdown: modules may already be gone
            pass

    # -- the user's model -------------------------------------------------------------------
    @property
    def model(self) -> nn.Module:
        """The user's model (PopTorch's `user_model` where another module runs in its place;
        its weights are synced lazily from the device)."""
        return self._shown_model

    @property
    def options(self) -> Any:
        """The executor's own frozen copy of the options."""
        return self._options

    @property
    def training(self) -> bool:
        return self._training

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or "_user_model" not in self.__dict__:
            raise AttributeError(name)
        found = getattr(self.__dict__.get("_shown_model", self._user_model), name)
        if name == "generate":  # HuggingFace's: each of its forwards on the device
            return functools.wraps(found)(functools.partial(PoplarExecutor._generate, self))
        return found

    def _generate(self, *args: Any, **kwargs: Any) -> Any:
        """The model's generate() (HuggingFace), every forward it calls run on the device:
        in the stages, each stage's worker keeping the key/value cache of its own layers."""
        if self._training:
            raise ConfigError(
                "generate() runs on a poptorch.inferenceModel: wrap the model with "
                "poptorch.inferenceModel(model, opts) (it follows the weights this "
                "trainingModel trains) and call its generate()")
        if not self._attached:
            raise DeviceError("The model is detached from its device: call attachToDevice() first")
        compiled = self._compiled or self._compile_for_generation(args, kwargs)
        self._refresh_from_host()
        o = self._options
        with device_mismatch_explained(self._device):
            return compiled.engine.generate(
                self._user_model, compiled.stages,
                lanes=o.device_iterations * o.replication_factor, args=args, kwargs=kwargs)

    def _compile_for_generation(self, args: tuple, kwargs: dict) -> Compiled:
        """Compile for generate()'s first call: forward on the prompts (one row per device
        iteration and replica), without its key/value cache, to split the model."""
        ids = kwargs.get("input_ids", args[0] if args else None)
        if not isinstance(ids, torch.Tensor):
            raise InputArgumentError(
                "generate() compiles the model from its prompts: pass them as a tensor of "
                "token ids, generate(input_ids, ...), or call the model once first")
        o = self._options
        rows = o.device_iterations * o.replication_factor
        first = {"input_ids": ids[:1].expand(rows, -1).contiguous(), "use_cache": False}
        config = getattr(self._user_model, "config", None)
        if getattr(config, "is_encoder_decoder", False):
            start = getattr(config, "decoder_start_token_id", None) or 0
            first["decoder_input_ids"] = torch.full((rows, 1), start, dtype=ids.dtype)
        call_args, call_kwargs = self._cast_inputs(*self._bound((), first))
        compiled = self._compile(call_args, call_kwargs,
                                 Signature.of(call_args, call_kwargs, self._params))
        self._from_prompts = True
        return compiled

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # isinstance(wrapped, type(model)) holds, as in PopTorch
        return wrapping.wrapper_class(PoplarExecutor, type(self.__dict__["_user_model"]))

    def __reduce_ex__(self, protocol: Any) -> Any:
        # torch.save(wrapper) / pickle: the user's model with the device's latest weights (a
        # wrapper holds devices and processes, which cannot be saved); poptorch.load reads
        # executables written by compileAndExport / save.
        reduced = self._user_model.__reduce_ex__(protocol)
        if reduced[0] is copyreg.__newobj__:  # pickle would check the class against ours
            return (_new_model, *reduced[1:])
        return reduced

    def __repr__(self) -> str:
        kind = "trainingModel" if self._training else "inferenceModel"
        return f"{kind}({module_repr(self._user_model)})"


def _new_model(cls: type, *args: Any) -> nn.Module:
    """Unpickling helper of a saved wrapper: an empty instance of the user model's class."""
    return cls.__new__(cls, *args)


def _write_report(profiler: Any) -> None:
    try:
        path = profiler.write()
        logger.info("Profiling report written to %s", os.path.join(path, "report.html"))
    except Exception as exc:  # at exit: a report must not turn a clean exit into a crash
        logger.warning("Could not write the profiling report: %s", exc)


def trainingModel(model: nn.Module, options: Any = None,
                  optimizer: torch.optim.Optimizer | None = None) -> PoplarExecutor:
    """Wrap `model` for training: each call runs forward, backward and optimiser steps."""
    return PoplarExecutor(model, options, training=True, optimizer=optimizer)


def inferenceModel(model: nn.Module, options: Any = None) -> PoplarExecutor:
    """Wrap `model` for inference (eval mode, no gradients)."""
    return PoplarExecutor(model, options, training=False)


def load(path: str | Path, edit_opts_fn: Any = None) -> PoplarExecutor:
    """A wrapper (trainingModel or inferenceModel) for the executable saved at `path`;
    `edit_opts_fn(options)` may change its (unfrozen copy of the) options first."""
    return PoplarExecutor(**artefact.read_executable(path, edit_opts_fn))
