"""`trainingModel` / `inferenceModel`: the wrapper that runs a model on its devices."""
from __future__ import annotations

import contextlib
import copyreg
import functools
import datetime
import logging
import sys
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, SupportsIndex

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from pipetorch import extensions, log_level
from pipetorch.errors import (
    AlreadyWrappedError, BackwardError, ConfigError, DeviceError, OfflineDeviceError,
)
from pipetorch.optim import Optimizer, attributes, ipu_state, scaling
from pipetorch.options import popart_names, session_log
from pipetorch.partition.export import Tree
from pipetorch.printing import module_repr
from pipetorch.runtime import artefact, counters, wrapping
from pipetorch.weights import host_copy
from pipetorch.runtime.anchors import AnchorReads, Anchors, Collector
from pipetorch.runtime.batching import (
    Signature, forward_parameters, input_names, ordered_like, split_micro_batches, to_device,
)
from pipetorch.runtime.checks import (
    NonFiniteWatch, buffer_ids, check_buffers, check_finite_inputs,
    check_inference_accumulation, check_optimizer_params, check_return_periods,
    check_trainable, device_mismatch_explained, forward_errors_explained,
    held, resolve_mean_strategy, warn_non_finite_weights,
)
from pipetorch.runtime.compile import Compiled, compile_model
from pipetorch.runtime.inputs import Inputs
from pipetorch.runtime.weight_copies import WeightCopies
from pipetorch.runtime.config import run_config
from pipetorch.parallel.layout.placement import default_device
from pipetorch.runtime.optimizer import default_optimizer

if TYPE_CHECKING:
    from pipetorch.options import Options
    from pipetorch.profiling.recorder import Profiler
from pipetorch.parallel.host.outputs import OutputCollector, resolve_mode

__all__ = ["PoplarExecutor", "trainingModel", "inferenceModel", "load"]

logger = logging.getLogger(__name__)

# user model -> its live training wrapper: two would train diverging device copies.
_training_wrappers: "weakref.WeakKeyDictionary[nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()
class _TrainingOutput(torch.Tensor):
    """A returned tensor whose `.backward()` explains that training already happened."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]  # C, unbound

    def __repr__(self, **kwargs: object) -> str:  # type: ignore[override]  # torch's is untyped
        return repr(self.as_subclass(torch.Tensor))  # print like the tensor it is

    def backward(self, *args: object, **kwargs: object) -> None:
        # PopTorch 3.x raises a poptorch.Error in these words; PopTorch 2.x returned plain
        # tensors, so torch's message follows for scripts matching that one.
        raise BackwardError(
            "backward() cannot be called explicitly on outputs of a PopTorch model. If you're "
            "using a trainingModel, the backwards pass is performed automatically when invoking "
            "the model. If you're using an inferenceModel, you should use a trainingModel "
            "instead. (torch: element 0 of tensors does not require grad and does not have a "
            "grad_fn: forward, backward and the optimiser step already ran inside the call; "
            "use the returned loss for logging only)")


def _mark_training_output(x: torch.Tensor) -> torch.Tensor:
    return torch.Tensor._make_subclass(_TrainingOutput, x)


class PoplarExecutor(Inputs, WeightCopies, AnchorReads, counters.PerfCounters,
                     artefact.Exports):
    """A model wrapped for its devices; call it like the model, with a host call's batch."""

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
        options, own = _own_options(options, training=training)
        if training:
            _claim_for_training(model, optimizer, self)
            if optimizer is None:
                optimizer = default_optimizer(model)
            resolve_mean_strategy(optimizer, options, own)
        wrapping.register(model, self)
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
        self._profiler: Profiler | None = None
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
    def __call__(self, *args: Tree, **kwargs: Tree) -> Any:
        if not self._attached:
            raise DeviceError("The model is detached from its device: call attachToDevice() first")
        args, kwargs = self._cast_inputs(*self._bound(args, kwargs))
        if self._signature:  # dicts in the first call's key order (PopTorch matches by key)
            args, kwargs = ordered_like(self._signature.spec, (args, kwargs))
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
            return pytree.tree_map_only(torch.Tensor, _mark_training_output, result)
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

    def _run(self, compiled: Compiled, micro: list, collector: Collector) -> None:
        if self._training:
            compiled.engine.train(micro, collector)
            optimizer = self._user_optimizer
            assert optimizer is not None and self._sync is not None  # a trainingModel's
            # the device stepped: an LR scheduler must not warn that optimizer.step() never ran
            optimizer._opt_called = True  # type: ignore[attr-defined]  # torch's flag, undeclared
            self._sync.mark_stale(self._fetch)
            self._state_stale = True
            ipu_state.forget_loaded(optimizer)
        else:
            compiled.engine.infer(micro, collector)

    def _compile(self, args: tuple, kwargs: dict, signature: Signature) -> Compiled:
        if self._compiled is not None:
            raise ValueError("The model is already compiled: call destroy() to compile again")
        names = self._check_inputs(args, kwargs)
        dtypes = {p.dtype for p in held(self._user_model, "_parameters").values()
                  if p.is_floating_point()}
        extensions.run_pre_compile_hooks()
        if session_log.logger.isEnabledFor(logging.DEBUG):  # PopTorch's words for the options
            session_log.log(self._options.toDict())
        if self._user_optimizer is not None:  # training (trainingModel makes one)
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
        # PopTorch copies a poptorch.optim optimiser's state to the host at the first read
        # after compiling (a torch optimiser's only once trained)
        self._state_stale = isinstance(self._user_optimizer, Optimizer)
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

    def save(self, path: str) -> None:
        """Save the compiled model (stages, options, weights) to `path`; see compileAndExport."""
        artefact.save(self, path)

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


def _claim_for_training(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                        wrapper: PoplarExecutor) -> None:
    """`wrapper` trains `model`, which must have trainable parameters, those `optimizer`
    steps, and no other live training wrapper."""
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
    _training_wrappers[model] = weakref.ref(wrapper)


def _own_options(options: Options | None, *, training: bool) -> tuple[Options, Options]:
    """The user's options (frozen, as in PopTorch) and the wrapper's own frozen copy, its
    output mode resolved, checked."""
    from pipetorch.options import Options

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
    return options, own


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
