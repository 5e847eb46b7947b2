"""A wrapper's inputs: a call bound to forward's parameters, cast, checked, and matched to
an input signature (another one compiled on the same engine with inputSignatures), and
generate()'s prompts compiled from."""
from __future__ import annotations

import inspect
import logging
import re
import time
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from pipetorch.errors import ConfigError, DeviceError, InputArgumentError, InputMismatchError
from pipetorch.partition.export import Tree
from pipetorch.runtime.batching import (
    InputName, Signature, cast_float_inputs, check_batch, half_dtype, input_names,
    plain_containers, split_micro_batches,
)
from pipetorch.runtime.checks import device_mismatch_explained, forward_errors_explained, held
from pipetorch.runtime.compile import Compiled, add_signature
from pipetorch.runtime.config import run_config

if TYPE_CHECKING:
    from pipetorch.options import Options

__all__: list[str] = []

logger = logging.getLogger("pipetorch.runtime.executor")


class Inputs:
    """PoplarExecutor's handling of a call's inputs (the wrapper's attributes, below)."""

    _compiled: Compiled | None
    _user_model: nn.Module
    _options: Options
    _training: bool
    _attached: bool
    _params: tuple[str, ...]  # forward's positional parameters
    _device: torch.device
    _signature: Signature | None  # the signature the engine runs now
    # every signature compiled for (inputSignatures("several")), with its synthetic inputs
    _signatures: list[tuple[Signature, list | None]]
    _from_prompts: bool  # compiled by generate() from its prompts, not by a call

    _compile: Callable[[tuple, dict, Signature], Compiled]
    _refresh_from_host: Callable[[], None]  # weight_copies'

    def _cast_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """PopTorch casts float32 inputs of a half model to its dtype (and gives forward
        plain dicts for dict subclasses)."""
        args, kwargs = plain_containers((args, kwargs))
        dtype = half_dtype(held(self._user_model, "_parameters").values())
        return cast_float_inputs(args, kwargs, dtype)

    def compile(self, *args: Tree, **kwargs: Tree) -> None:
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

    def _check_inputs(self, args: tuple, kwargs: dict) -> tuple[InputName, ...]:
        """Refuse, before anything runs, a first call forward cannot take or whose tensors
        cannot be cut into micro-batches; the inputs' names for later messages."""
        self._bound(args, kwargs)
        names = input_names(args, kwargs, self._params)
        o = self._options
        check_batch(args, kwargs, device_iterations=o.device_iterations,
                    gradient_accumulation=o.Training.gradient_accumulation,
                    replication_factor=o.replication_factor, names=names)
        return names

    def _first_micro_batch(self, args: tuple, kwargs: dict) -> list[object]:
        o = self._options
        return pytree.tree_leaves(split_micro_batches(
            args, kwargs, device_iterations=o.device_iterations,
            gradient_accumulation=o.Training.gradient_accumulation,
            replication_factor=o.replication_factor)[0])

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
