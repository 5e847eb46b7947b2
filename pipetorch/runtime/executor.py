"""`trainingModel` / `inferenceModel`: the wrapper that runs a model on its devices."""
from __future__ import annotations

import datetime
import logging
import os
import sys
import time
import weakref
from typing import Any

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from pipetorch.errors import ConfigError, DeviceError
from pipetorch.optim import attributes, ipu_state
from pipetorch.runtime import counters, weights, wrapping
from pipetorch.runtime.batching import Signature, split_micro_batches, to_device
from pipetorch.runtime.compile import Compiled, compile_model
from pipetorch.runtime.devices import default_device
from pipetorch.runtime.optimizer import (
    copy_hyperparameters, copy_state_to_device, copy_state_to_host, default_optimizer,
)
from pipetorch.runtime.outputs import OutputCollector, resolve_mode

__all__ = ["PoplarExecutor", "trainingModel", "inferenceModel"]

logger = logging.getLogger(__name__)

# user model -> its live training wrapper: two would train diverging device copies.
_training_wrappers: "weakref.WeakKeyDictionary[nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()
class _TrainingOutput(torch.Tensor):
    """A returned tensor whose `.backward()` explains that training already happened."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self, **kwargs: Any) -> str:  # print like the tensor it is
        return repr(self.as_subclass(torch.Tensor))

    def backward(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        raise RuntimeError(
            "backward() was called on an output of a pipetorch trainingModel: the forward pass, "
            "backward pass and optimiser step already ran inside the call. Use the returned loss "
            "for logging only; to train a plain PyTorch model, call the model itself")


def _mark_training_output(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return torch.Tensor._make_subclass(_TrainingOutput, x)
    return x


class PoplarExecutor:
    """A model wrapped for its devices; call it like the model, with a host call's batch."""

    def __init__(self, model: nn.Module, options: Any = None, *, training: bool,
                 optimizer: torch.optim.Optimizer | None = None) -> None:
        from pipetorch.options import Options

        if isinstance(model, PoplarExecutor):
            model = model._user_model  # PopTorch wraps a wrapper's model (e.g. for inference)
        if not isinstance(model, nn.Module):
            raise TypeError(f"Expected a torch.nn.Module to wrap, got {type(model).__name__}")
        options = Options() if options is None else options
        if not isinstance(options, Options):
            raise TypeError(f"options must be a pipetorch.Options, got {type(options).__name__}")
        options._freeze()
        own = options.clone()
        mode = resolve_mode(own.output_mode, training=training)
        own.outputMode(mode, **({"output_return_period": own.output_return_period}
                                if mode.name == "EveryN" else {}))
        own._freeze()
        if not training and own.Training.gradient_accumulation != 1:
            raise ConfigError(
                "You must set poptorch.Options().Training.gradientAccumulation to 1 or use the "
                f"default value (it is {own.Training.gradient_accumulation}) when running a "
                "poptorch.inferenceModel(); gradient accumulation only applies to training")
        if training:
            other = _training_wrappers.get(model)
            if other is not None and other() is not None:
                raise ConfigError(
                    "Model has already been wrapped in 'poptorch.trainingModel'. Call "
                    "model.destroy() on the model to re-use (this destroys its live "
                    "trainingModel, whose device copy would otherwise train apart)")
            _training_wrappers[model] = weakref.ref(self)
        wrapping.register(model, self)
        if training and optimizer is None:
            optimizer = default_optimizer(model)
        self._user_model, self._options, self._training = model, own, training
        self._user_optimizer = optimizer
        self._device = default_device()
        self._compiled: Compiled | None = None
        self._signature: Signature | None = None
        self._sync: weights.HostSync | None = None
        self._uploaded_generation = -1
        self._attached = True
        self._profiler: Any = None
        self._profile_writer: weakref.finalize | None = None
        self._optimizer_record: attributes.Compiled | None = None
        self._times: counters.CallTimes | None = None

    # -- calls ------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self._attached:
            raise DeviceError("The model is detached from its device: call attachToDevice() first")
        signature = Signature.of(args, kwargs)
        compiled = self._compiled or self._compile(args, kwargs, signature)
        problem = self._signature.mismatch(signature) if self._signature else None
        if problem:
            raise ValueError(
                f"This model was compiled for other inputs: {problem}. A wrapped model runs one "
                "input signature; build a new trainingModel/inferenceModel for the new inputs, "
                "or call destroy() first")
        if not self._training:
            self._refresh_from_host()
        o = self._options
        times = counters.CallTimes()
        micro = compiled.synthetic or [to_device(mb, compiled.engine.input_device) for mb in split_micro_batches(
            args, kwargs, device_iterations=o.device_iterations,
            gradient_accumulation=o.Training.gradient_accumulation,
            replication_factor=o.replication_factor)]
        collector = OutputCollector(o.output_mode, steps=compiled.engine.batching.steps,
                                    replicas=o.replication_factor, period=o.output_return_period)
        times.stamp("input_complete")
        start = time.monotonic_ns()
        if self._training:
            compiled.engine.train(micro, collector)
            # The steps ran on the device: a learning-rate scheduler stepping the user's
            # optimizer must not warn that optimizer.step() was never called.
            self._user_optimizer._opt_called = True  # type: ignore[union-attr]
            assert self._sync is not None
            self._sync.mark_stale(self._fetch)
        else:
            compiled.engine.infer(micro, collector)
        times.stamp("output")
        if self._profiler is not None:
            items = next(leaf.shape[0] for leaf in pytree.tree_leaves((args, kwargs))
                         if isinstance(leaf, torch.Tensor))
            self._profiler.record_call(start, time.monotonic_ns(), items)
        result = collector.result()
        times.stamp("output_complete")
        self._times = times
        if self._training:
            return pytree.tree_map(_mark_training_output, result)
        return result

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """Prepare the model for these inputs without running it."""
        self._compile(args, kwargs, Signature.of(args, kwargs))

    def _compile(self, args: tuple, kwargs: dict, signature: Signature) -> Compiled:
        if self._compiled is not None:
            raise ValueError("The model is already compiled: call destroy() to compile again")
        if self._training:
            self._link_optimizer(self._user_optimizer)
        self._compiled = compile_model(
            self._user_model, args, kwargs, options=self._options, training=self._training,
            optimizer=self._user_optimizer, device=self._device)
        self._signature = signature
        if self._options.profiling_dir:
            self._start_profiler(args, kwargs)
        self._sync = weights.attach(self._user_model)
        self._uploaded_generation = self._sync.generation
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
        self._profiler = Profiler(directory, self._compiled, training=self._training, options=o,
                                  sample=sample)
        self._profile_writer = weakref.finalize(self, _write_report, self._profiler)

    def _write_profile(self) -> None:
        if self._profile_writer is not None:
            self._profile_writer()  # at most once; a later call starts a new profiler
        self._profiler, self._profile_writer = None, None

    # -- weights ----------------------------------------------------------------------------
    def _fetch(self) -> None:
        assert self._compiled is not None
        engine = self._compiled.engine
        engine.pull()
        weights.copy_state(engine.model, self._user_model)
        if engine.optimizer is not None and self._user_optimizer is not None:
            copy_state_to_host(engine.optimizer, self._user_optimizer)

    def _refresh_from_host(self) -> None:
        """Inference wrappers follow weights trained by another wrapper of the same model."""
        assert self._sync is not None and self._compiled is not None
        self._sync.flush()
        if self._sync.generation != self._uploaded_generation:
            weights.copy_state(self._user_model, self._compiled.engine.model)
            self._compiled.engine.push()
            self._uploaded_generation = self._sync.generation

    def copyWeightsToHost(self) -> None:
        """Copy the device's weights (and optimiser state) into the user's model now."""
        if self._compiled is not None and self._sync is not None:
            self._sync.mark_stale(self._fetch)
            self._sync.flush()

    def copyWeightsToDevice(self) -> None:
        """Copy the user's model's weights to the device (host edits reach it only this way)."""
        if self._compiled is not None and self._sync is not None:
            self._sync.forget(self._fetch)  # the host copy is what the user asks to upload
            weights.copy_state(self._user_model, self._compiled.engine.model)
            self._compiled.engine.push()
            self._uploaded_generation = self._sync.generation

    def setOptimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Send new hyper-parameters (learning rate, ...) to the device; its state is kept.

        The new optimiser may be another object of the same class; attributes that
        `variable_attrs` marks constant must keep their compiled values."""
        if not self._training:
            raise ConfigError("setOptimizer is for trainingModel wrappers; this is an inferenceModel")
        if self._compiled is not None and self._compiled.engine.optimizer is not None:
            assert self._optimizer_record is not None
            attributes.check_replacement(self._optimizer_record, optimizer)
            copy_hyperparameters(optimizer, self._compiled.engine.optimizer)
            self._compiled.engine.set_hyperparameters()
            if optimizer is not self._user_optimizer:
                assert self._sync is not None
                self._sync.flush()  # the old optimiser's state is the device's until now
                ipu_state.unlink(self._user_optimizer)  # type: ignore[arg-type]
                self._link_optimizer(optimizer)
        self._user_optimizer = optimizer

    def _link_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """`optimizer.state_dict()["ipu_state"]` and write_ipu_state reach this model."""
        self._optimizer_record = attributes.record(
            optimizer, automatic_loss_scaling=self._options.Training.auto_loss_scaling)
        ipu_state.link(optimizer, self._user_model, sync=self._flush_host,
                       push=self._push_optimizer_state)

    def _flush_host(self) -> None:
        if self._sync is not None:
            self._sync.flush()

    def _push_optimizer_state(self) -> None:
        """The user's optimiser state (written by write_ipu_state) becomes the device's."""
        if self._compiled is not None and self._compiled.engine.optimizer is not None:
            assert self._user_optimizer is not None
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
        if self._sync is not None:
            self._sync.flush()
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

    def getPerfCounters(self) -> dict[str, list[list[float]]]:
        """PopTorch's counters of the last call: {"input", "input_complete", "output",
        "output_complete": [per input/output: [per iteration: seconds]]} (see counters)."""
        if self._compiled is None or self._signature is None:
            return counters.perf_counters(None, inputs=0, outputs=0, iterations=0)
        outputs = len([x for x in pytree.tree_leaves(self._compiled.capture.output)
                       if isinstance(x, torch.Tensor)])
        return counters.perf_counters(
            self._times, inputs=sum(leaf.shape is not None for leaf in self._signature.leaves),
            outputs=outputs,
            iterations=self._options.device_iterations * self._options.replication_factor)

    def getLatency(self) -> tuple[float, float, float]:
        """(min, max, mean) seconds from the first input requested to the last output on
        the host, over the last call's iterations."""
        return counters.latency(self.getPerfCounters(), "input", min, "output_complete", max)

    def getHostIpuLatency(self) -> tuple[float, float, float]:
        """(min, max, mean) seconds to move the inputs to the devices."""
        return counters.latency(self.getPerfCounters(), "input", min, "input_complete", max)

    def getComputeLatency(self) -> tuple[float, float, float]:
        """(min, max, mean) seconds from the inputs on the devices to the outputs ready."""
        return counters.latency(self.getPerfCounters(), "input_complete", max, "output", max)

    def getIpuHostLatency(self) -> tuple[float, float, float]:
        """(min, max, mean) seconds to bring the outputs to the host."""
        return counters.latency(self.getPerfCounters(), "output", min, "output_complete", max)

    def save(self, path: str) -> None:
        """Save the compiled model (stages, options, weights) to `path`; see compileAndExport."""
        from pipetorch.runtime import artefact

        artefact.save(self, path)

    def loadExecutable(self, filename: str) -> None:
        """Compile this model for the inputs the executable at `filename` was saved for (by
        compileAndExport of this model's class), keeping this model's own weights, as
        PopTorch does; `poptorch.load(filename)` restores the saved weights too."""
        from pipetorch.runtime import artefact

        saved = artefact.saved_weights(filename)
        own = dict(self._user_model.state_dict())
        wrong = [n for n, t in saved.items() if n not in own or own[n].shape != t.shape]
        if wrong:
            raise ConfigError(
                f"The executable {filename} was saved from another model: its weights "
                f"{wrong[:4]} are missing here or have other shapes")
        args, kwargs = artefact.saved_inputs(filename)
        self.compile(*args, **kwargs)

    def compileAndExport(self, filename: str, *args: Any, export_model: bool = True,
                         **kwargs: Any) -> None:
        """Compile for these inputs (if not compiled yet) and save an executable that
        `poptorch.load(filename)` runs in another process without the model's source."""
        if self._compiled is None:
            self.compile(*args, **kwargs)
        self.save(filename)

    def destroy(self) -> None:
        """Free the device copy; the user's model keeps the latest weights."""
        try:
            if self._sync is not None:
                self._sync.flush()
        finally:
            if self._training and self._user_optimizer is not None:
                ipu_state.unlink(self._user_optimizer)
            wrapping.forget(self._user_model, self)
            if self._sync is not None:
                weights.detach(self._sync)
            self._write_profile()
            if self._compiled is not None:
                self._compiled.engine.close()
            self._compiled, self._signature, self._sync = None, None, None
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
        """The wrapped user model (its weights are synced lazily from the device)."""
        return self._user_model

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
        return getattr(self._user_model, name)

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # isinstance(wrapped, type(model)) holds, as in PopTorch
        return wrapping.wrapper_class(PoplarExecutor, type(self.__dict__["_user_model"]))

    def __repr__(self) -> str:
        kind = "trainingModel" if self._training else "inferenceModel"
        return f"{kind}({self._user_model!r})"


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
