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

from pipetorch.errors import InputArgumentError, InputMismatchError
from pipetorch.runtime.batching import (
    InputName, Signature, cast_float_inputs, check_batch, forward_parameters, half_dtype,
    input_names, plain_containers, split_micro_batches,
)
from pipetorch.runtime.checks import device_mismatch_explained, forward_errors_explained, held
from pipetorch.runtime.compile import Compiled, add_signature
from pipetorch.runtime.config import run_config
from pipetorch.schedule.plans import Batching

if TYPE_CHECKING:
    from pipetorch.options import Options

__all__: list[str] = []

logger = logging.getLogger("pipetorch.runtime.executor")


class Inputs:
    """A wrapper's input signatures: the one its engine runs, every one compiled for, and
    how a call's arguments are bound, cast and checked against them."""

    def __init__(self, user_model: nn.Module, options: Options, *, training: bool,
                 device: torch.device) -> None:
        self._user_model, self._options, self._training = user_model, options, training
        self._device = device
        self.params = forward_parameters(user_model)  # forward's positional parameters
        self.signature: Signature | None = None  # the signature the engine runs now
        # every signature compiled for (inputSignatures("several")), with its synthetic inputs
        self.signatures: list[tuple[Signature, list | None]] = []
        self.from_prompts = False  # compiled by generate() from its prompts, not by a call
        self._forward_signature: tuple[Callable, inspect.Signature | None] | None = None

    def cast(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The call bound to forward's parameters, then cast: PopTorch casts float32 inputs
        of a half model to its dtype (and gives forward plain dicts for dict subclasses)."""
        args, kwargs = plain_containers(self._bound(args, kwargs))
        dtype = half_dtype(held(self._user_model, "_parameters").values())
        return cast_float_inputs(args, kwargs, dtype)

    def of(self, args: tuple, kwargs: dict) -> Signature:
        return Signature.of(args, kwargs, self.params)

    def mismatch(self, signature: Signature) -> str | None:
        """How `signature` differs from the one the engine runs (None: it is the same)."""
        return self.signature.mismatch(signature) if self.signature else None

    def compiled(self, signature: Signature, synthetic: list | None) -> None:
        self.signature, self.signatures = signature, [(signature, synthetic)]

    def forget(self) -> None:
        self.signature, self.signatures = None, []

    def switch(self, compiled: Compiled | None, args: tuple, kwargs: dict,
               signature: Signature, problem: str) -> None:
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
        assert compiled is not None
        for key, (known, synthetic) in enumerate(self.signatures):
            if known.mismatch(signature) is None:
                compiled.engine.use(key)
                compiled.synthetic, self.signature = synthetic, known
                return
        names = self.check(args, kwargs)
        start = time.perf_counter()
        with device_mismatch_explained(self._device), forward_errors_explained(
                names, pytree.tree_leaves((args, kwargs)),
                lambda: self.first_micro_batch(args, kwargs), None):
            key, synthetic = add_signature(compiled, args, kwargs,
                                           config=run_config(self._options),
                                           training=self._training, device=self._device)
        assert key == len(self.signatures)
        self.signatures.append((signature, synthetic))
        compiled.engine.use(key)
        compiled.synthetic, self.signature = synthetic, signature
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
        cached = self._forward_signature
        if cached is None or cached[0] is not forward:
            try:
                cached = (forward, inspect.signature(self._user_model.forward))
            except (TypeError, ValueError):  # no Python signature: forward itself will say
                cached = (forward, None)
            self._forward_signature = cached
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

    def check(self, args: tuple, kwargs: dict) -> tuple[InputName, ...]:
        """Refuse, before anything runs, a first call forward cannot take or whose tensors
        cannot be cut into micro-batches; the inputs' names for later messages."""
        self._bound(args, kwargs)
        names = input_names(args, kwargs, self.params)
        check_batch(args, kwargs, self._batching(), names=names)
        return names

    def first_micro_batch(self, args: tuple, kwargs: dict) -> list[object]:
        return pytree.tree_leaves(split_micro_batches(args, kwargs, self._batching())[0])

    def _batching(self) -> Batching:
        o = self._options
        return Batching(o.device_iterations, o.Training.gradient_accumulation,
                        o.replication_factor)

    def prompts(self, args: tuple, kwargs: dict) -> tuple[tuple, dict, Signature]:
        """What generate()'s first call compiles for: forward on the prompts (one row per
        device iteration and replica), without its key/value cache, to split the model."""
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
        call_args, call_kwargs = self.cast((), first)
        return call_args, call_kwargs, self.of(call_args, call_kwargs)
