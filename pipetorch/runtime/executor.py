"""`trainingModel` / `inferenceModel`: the wrapper that runs a model on its devices."""
from __future__ import annotations

import contextlib
import copyreg
import functools
import datetime
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, SupportsIndex

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from pipetorch import extensions, log_level
from pipetorch.errors import ConfigError, DeviceError, OfflineDeviceError
from pipetorch.optim import ipu_state
from pipetorch.options import session_log
from pipetorch.partition.export import Tree
from pipetorch.printing import module_repr
from pipetorch.runtime import anchors, artefact, counters, wrapping
from pipetorch.runtime.anchors import Anchors, Collector
from pipetorch.runtime.batching import (
    Signature, input_names, ordered_like, split_micro_batches, to_device,
)
from pipetorch.runtime.checks import (
    NonFiniteWatch, buffer_ids, check_buffers, check_finite_inputs, check_optimizer_params,
    check_trainable, device_mismatch_explained, forward_errors_explained, held,
    resolve_mean_strategy, warn_non_finite_weights,
)
from pipetorch.runtime.compile import Compiled, compile_model
from pipetorch.runtime.inputs import Inputs
from pipetorch.runtime.weight_copies import WeightCopies, offline
from pipetorch.runtime.config import own_options, run_config
from pipetorch.parallel.layout.placement import default_device
from pipetorch.runtime.optimizer import default_optimizer

if TYPE_CHECKING:
    from pipetorch.options import Options
from pipetorch.parallel.host.outputs import OutputCollector, mark_training_output

__all__ = ["PoplarExecutor", "trainingModel", "inferenceModel", "load"]

logger = logging.getLogger(__name__)

class PoplarExecutor:
    """A model wrapped for its devices; call it like the model, with a host call's batch.

    Its parts hold their own state: the inputs' signatures (Inputs), the copies of weights and
    optimiser between host and device (WeightCopies), the timings (PerfCounters)."""

    def __init__(self, model: nn.Module, options: Options | None = None, *, training: bool,
                 optimizer: torch.optim.Optimizer | None = None,
                 user_model: nn.Module | None = None,
                 poptorch_version: str | None = None) -> None:
        """PopTorch's constructor: `model` is what runs; `user_model` (default `model`), a
        module sharing its parameters, is the one whose attributes the wrapper shows, as when
        a loss wrapper runs around the user's model. `poptorch_version` is recorded only."""
        if isinstance(model, PoplarExecutor):
            model = model._user_model  # PopTorch wraps a wrapper's model (e.g. for inference)
        if not isinstance(model, nn.Module):
            raise TypeError(f"Expected a torch.nn.Module to wrap, got {type(model).__name__}")
        options, own = own_options(options, training=training)
        if training:
            check_trainable(model)
            if optimizer is not None:
                check_optimizer_params(optimizer, model, where="trainingModel")
            wrapping.claim_for_training(model, self)
            if optimizer is None:
                optimizer = default_optimizer(model)
            resolve_mean_strategy(optimizer, options, own)
        wrapping.register(model, self)
        log_level.limit_repeats(own.max_repeat_logs)
        self._user_model, self._options, self._training = model, own, training
        self._shown_model = model if user_model is None else user_model
        self._poptorch_version = poptorch_version
        self._device = default_device()
        self._inputs = Inputs(model, own, training=training, device=self._device)
        self._weights = WeightCopies(model, own, training=training, optimizer=optimizer)
        self._counters = counters.PerfCounters(own, training=training)
        self._compiled: Compiled | None = None
        self._attached = True
        self._anchors: Anchors | None = None
        self._buffer_ids: dict[str, int] | None = None
        self._calls = 0  # calls checked by checkNonFinite
        self._warned_weights = False

    # -- calls ------------------------------------------------------------------------------
    def __call__(self, *args: Tree, **kwargs: Tree) -> Any:
        if not self._attached:
            raise DeviceError("The model is detached from its device: call attachToDevice() first")
        inputs = self._inputs
        args, kwargs = inputs.cast(args, kwargs)
        if inputs.signature:  # dicts in the first call's key order (PopTorch matches by key)
            args, kwargs = ordered_like(inputs.signature.spec, (args, kwargs))
        signature = inputs.of(args, kwargs)
        problem = inputs.mismatch(signature)
        if problem and inputs.from_prompts:  # the user never chose generate()'s signature
            logger.info("Compiling again for this call's inputs (generate() compiled the "
                        "model from its prompts: %s)", problem)
            self.destroy()
            wrapping.register(self._user_model, self)  # it lives on: model.destroy() reaches it
        elif problem:
            inputs.switch(self._compiled, args, kwargs, signature, problem)
        inputs.from_prompts = False
        o = self._options
        if o.check_non_finite:
            check_finite_inputs(input_names(args, kwargs, inputs.params),
                                pytree.tree_leaves((args, kwargs)), micro_batches=(
                                    o.device_iterations * o.Training.gradient_accumulation
                                    * o.replication_factor))
        compiled = self._compiled or self._compile(args, kwargs, signature)
        if offline(o):
            raise OfflineDeviceError(
                "Trying to run a model on an offline device (ConnectionType.Never, set by "
                "Options.useOfflineIpuTarget() or connectionType()): such a model compiles "
                "(compile(), compileAndExport()) but never runs. Remove the option to run it")
        check_buffers(self._user_model, self._buffer_ids)
        if not self._training:
            self._weights.refresh_from_host()
        times = counters.CallTimes()
        if compiled.synthetic is None:  # one move of the whole call, then views of it
            args, kwargs = to_device((args, kwargs), compiled.engine.input_device)
        micro = compiled.synthetic or split_micro_batches(args, kwargs, compiled.engine.batching)
        collector: Collector = OutputCollector(
            o.output_mode, steps=compiled.engine.batching.steps,
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
        if self._counters.profiler is not None:
            items = next(leaf.shape[0] for leaf in pytree.tree_leaves((args, kwargs))
                         if isinstance(leaf, torch.Tensor))
            self._counters.profiler.record_call(start, time.monotonic_ns(), items)
        result = collector.result()
        times.stamp("output_complete")
        self._counters.times = times
        if watch is not None:
            self._check_non_finite(compiled, watch)
        if self._training:
            return pytree.tree_map_only(torch.Tensor, mark_training_output, result)
        return result

    def _check_non_finite(self, compiled: Compiled, watch: NonFiniteWatch) -> None:
        """checkNonFinite after a call: weights (warned once per wrapper), then outputs."""
        self._calls += 1
        if self._training and not self._warned_weights:
            self._weights.to_host()  # the device's weights into the host copy
            self._warned_weights = warn_non_finite_weights(compiled.engine.model, logger,
                                                           calls=self._calls)
        watch.check()

    def _run(self, compiled: Compiled, micro: list, collector: Collector) -> None:
        if self._training:
            compiled.engine.train(micro, collector)
            self._weights.trained(self._fetch)
        else:
            compiled.engine.infer(micro, collector)

    def _compile(self, args: tuple, kwargs: dict, signature: Signature) -> Compiled:
        if self._compiled is not None:
            raise ValueError("The model is already compiled: call destroy() to compile again")
        names = self._inputs.check(args, kwargs)
        dtypes = {p.dtype for p in held(self._user_model, "_parameters").values()
                  if p.is_floating_point()}
        extensions.run_pre_compile_hooks()
        if session_log.logger.isEnabledFor(logging.DEBUG):  # PopTorch's words for the options
            session_log.log(self._options.toDict())
        self._weights.link_optimizer()  # training's (trainingModel makes one)
        with device_mismatch_explained(self._device), forward_errors_explained(
                names, pytree.tree_leaves((args, kwargs)),
                lambda: self._inputs.first_micro_batch(args, kwargs),
                dtypes.pop() if len(dtypes) == 1 else None):
            self._compiled = compile_model(
                self._user_model, args, kwargs, config=run_config(self._options),
                training=self._training, optimizer=self._weights.optimizer, device=self._device)
        self._inputs.compiled(signature, self._compiled.synthetic)
        self._weights.compiled(self._compiled)
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
            try:
                self._counters.start_profiler(self._compiled, args, kwargs)
            except ConfigError:
                self.destroy()  # a report directory that cannot be made
                raise
        self._weights.attach(self._shown_model)
        self._buffer_ids = buffer_ids(self._user_model)
        extensions.run_post_compile_hooks()
        return self._compiled

    def compile(self, *args: Tree, **kwargs: Tree) -> None:
        """Prepare the model for these inputs without running it (with
        Options.inputSignatures("several"), for one more signature when already compiled)."""
        args, kwargs = self._inputs.cast(args, kwargs)
        signature = self._inputs.of(args, kwargs)
        problem = self._inputs.mismatch(signature)
        if problem and self._options.input_signatures == "several":
            return self._inputs.switch(self._compiled, args, kwargs, signature, problem)
        self._compile(args, kwargs, signature)

    def _generate(self, *args: Tree, **kwargs: Tree) -> object:
        """The model's generate() (HuggingFace), every forward it calls run on the device:
        in the stages, each stage's worker keeping the key/value cache of its own layers."""
        if self._training:
            raise ConfigError(
                "generate() runs on a poptorch.inferenceModel: wrap the model with "
                "poptorch.inferenceModel(model, opts) (it follows the weights this "
                "trainingModel trains) and call its generate()")
        if not self._attached:
            raise DeviceError("The model is detached from its device: call attachToDevice() first")
        compiled = self._compiled
        if compiled is None:  # compiled from the prompts
            compiled = self._compile(*self._inputs.prompts(args, kwargs))
            self._inputs.from_prompts = True
        self._weights.refresh_from_host()
        o = self._options
        with device_mismatch_explained(self._device):
            return compiled.engine.generate(
                self._user_model, compiled.stages,
                lanes=o.device_iterations * o.replication_factor, args=args, kwargs=kwargs)

    # -- weights: WeightCopies ---------------------------------------------------------------
    def _fetch(self) -> None:
        # PopTorch's lazy copy calls the wrapper's copyWeightsToHost, which scripts and tests
        # replace to count copies (`deviceToHostCounter`).
        logger.debug("Implicit copyWeightsToHost()")
        self.copyWeightsToHost()

    def copyWeightsToHost(self) -> None:
        """Copy the device's weights (and optimiser state) into the user's model now."""
        self._weights.to_host()

    def copyWeightsToDevice(self) -> None:
        """Copy the user's model's weights to the device (host edits reach it only this way).

        The host copy is brought to the latest call first when a call trained since it was
        last: the upload holds every tensor from one point of training (docs/precision.md)."""
        self._weights.to_device()

    def copyNamedBuffersToDevice(self) -> None:
        """Copy the buffers named by Options.updatableNamedBuffers from the user's model to
        the device (other weights and buffers on the device are kept)."""
        self._weights.named_buffers_to_device()

    def setOptimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Send new hyper-parameters (learning rate, ...) to the device; its state is kept.

        The new optimiser may be another object of the same class; attributes that
        `variable_attrs` marks constant must keep their compiled values."""
        self._weights.set_optimizer(optimizer, self._fetch)

    def state_dict(self, *args: object, **kwargs: object) -> dict[str, Any]:
        """The user model's state_dict, holding the device's latest weights."""
        state_dict: Callable[..., dict[str, Any]] = self._user_model.state_dict  # overloaded
        return state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, object], strict: bool = True) -> Any:
        """Load weights into the user model and the device."""
        result = self._user_model.load_state_dict(state_dict, strict=strict)
        self.copyWeightsToDevice()
        return result

    # -- anchored tensors, counters: anchors.Anchors, counters.PerfCounters ------------------
    def getAnchoredTensor(self, short_name: str) -> Any:
        """The value of the tensor anchored as `short_name` by Options.anchorTensor, from the
        last call (see pipetorch.runtime.anchors for the names)."""
        return anchors.table(self._anchors).get(short_name)

    def getTensorNames(self) -> list[str]:
        """Every tensor name Options.anchorTensor accepts for this model."""
        return list(anchors.table(self._anchors).names)

    def getPerfCounters(self) -> dict[str, list[list[float]]]:
        """PopTorch's counters of the last call: {"input", "input_complete", "output",
        "output_complete": [per input/output: [per iteration: seconds]]} (see counters)."""
        return self._counters.counters(self._compiled, self._inputs.signature)

    def cycleCount(self) -> int:
        """PopTorch's IPU cycle count of the last run; the checks come first, as PopTorch's:
        opts.logCycleCount(True), then a model that ran. Then IpuOnlyError: there are no IPU
        clock cycles on a CPU or GPU (getComputeLatency() times the run instead)."""
        return self._counters.cycle_count(self._compiled)

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

    # -- device lifetime --------------------------------------------------------------------
    def detachFromDevice(self) -> None:
        """Release the device; the user's model keeps the trained weights."""
        self._weights.flush_host()
        if self._counters.profiler is not None:
            self._counters.profiler.write()
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

    def save(self, path: str) -> None:
        """Save the compiled model (stages, options, weights) to `path`; see compileAndExport."""
        compiled = self._require_compiled("save()")
        self._weights.flush_host()
        signatures = self._inputs.signatures  # the graph is the first call's
        artefact.save(path, compiled, model=self._shown_model, options=self._options,
                      training=self._training, optimizer=self._weights.optimizer,
                      signature=signatures[0][0] if signatures else self._inputs.signature)

    def compileAndExport(self, filename: str, *args: Tree, export_model: bool = True,
                         **kwargs: Tree) -> None:
        """Compile for these inputs (if not compiled yet) and save an executable that
        `poptorch.load(filename)` runs in another process without the model's source."""
        if self._compiled is None:
            self.compile(*args, **kwargs)
        self.save(filename)

    def loadExecutable(self, filename: str) -> None:
        """Compile this model for the inputs the executable at `filename` was saved for (by
        compileAndExport of this model's class), keeping this model's own weights, as
        PopTorch does; `poptorch.load(filename)` restores the saved weights too."""
        args, kwargs = artefact.inputs_for(filename, self._user_model)
        self.compile(*args, **kwargs)

    def destroy(self) -> None:
        """Free the device copy; the user's model keeps the latest weights."""
        try:
            self._weights.flush_host()  # the optimiser's state too: a new wrapper resumes from it
        finally:
            if self._training and self._weights.optimizer is not None:
                ipu_state.unlink(self._weights.optimizer)
            wrapping.forget(self._user_model, self)
            self._weights.detach()
            self._counters.write_profile()
            if self._compiled is not None:
                self._compiled.engine.close()
            if self._anchors is not None:
                self._anchors.remove()
            self._compiled, self._anchors = None, None
            self._inputs.forget()
            self._buffer_ids = None
            if self._training:
                wrapping.release_for_training(self._user_model, self)

    def __del__(self) -> None:
        if sys.is_finalizing():  # torch may be half torn down; workers stop via their finalizer
            return
        with contextlib.suppress(Exception):  # interpreter shutdown: modules may be gone
            self.destroy()

    # -- the user's model -------------------------------------------------------------------
    @property
    def model(self) -> nn.Module:
        """The user's model (PopTorch's `user_model` where another module runs in its place;
        its weights are synced lazily from the device)."""
        return self._shown_model

    @property
    def options(self) -> Options:
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

    @property  # type: ignore[misc]  # overrides object.__class__
    def __class__(self) -> type:  # isinstance(wrapped, type(model)) holds, as in PopTorch
        return wrapping.wrapper_class(PoplarExecutor, type(self.__dict__["_user_model"]))

    def __reduce_ex__(self, protocol: SupportsIndex) -> Any:
        # torch.save(wrapper) / pickle: the user's model with the device's latest weights (a
        # wrapper holds devices and processes, which cannot be saved); poptorch.load reads
        # executables written by compileAndExport / save.
        reduced = self._user_model.__reduce_ex__(protocol)
        if reduced[0] is copyreg.__dict__["__newobj__"]:  # pickle would check the class
            return (_new_model, *reduced[1:])
        return reduced

    def __repr__(self) -> str:
        kind = "trainingModel" if self._training else "inferenceModel"
        return f"{kind}({module_repr(self._user_model)})"


def _new_model(cls: type[nn.Module], *args: object) -> nn.Module:
    """Unpickling helper of a saved wrapper: an empty instance of the user model's class."""
    return cls.__new__(cls, *args)


def trainingModel(model: nn.Module, options: Options | None = None,
                  optimizer: torch.optim.Optimizer | None = None) -> PoplarExecutor:
    """Wrap `model` for training: each call runs forward, backward and optimiser steps."""
    return PoplarExecutor(model, options, training=True, optimizer=optimizer)


def inferenceModel(model: nn.Module, options: Options | None = None) -> PoplarExecutor:
    """Wrap `model` for inference (eval mode, no gradients)."""
    return PoplarExecutor(model, options, training=False)


def load(path: str | Path, edit_opts_fn: Callable[[Options], object] | None = None
         ) -> PoplarExecutor:
    """A wrapper (trainingModel or inferenceModel) for the executable saved at `path`;
    `edit_opts_fn(options)` may change its (unfrozen copy of the) options first."""
    return PoplarExecutor(**artefact.read_executable(path, edit_opts_fn))
