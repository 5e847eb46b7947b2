"""Models larger than the host's memory: built without weights, their weights in a file that
each stage worker reads its own part of (a pipetorch extension; PopTorch has none).

    with poptorch.empty_weights():                  # parameters on the meta device
        model = GPT2LMHeadModel(config)
    poptorch.map_weights(model, "gpt2.safetensors",  # mapped, never read by the host
                         output="trained.safetensors")
    training = poptorch.trainingModel(model, opts, optimizer)

The host's copy of the model is the mapped file: the workers read their stages' bytes from it,
and a copy of the trained weights to the host (a weight touched, `copyWeightsToHost`,
`state_dict()`) writes them stage by stage to `output`, which the model then maps: one file,
or a folder in HuggingFace's sharded format, a file per stage (weights.saving). Without
`output`, that copy goes into the host's memory as for any model.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch
import torch.nn as nn

from pipetorch.errors import ConfigError
from pipetorch.weights import checkpoint, saving

__all__ = ["empty_weights", "map_weights"]

_OUTPUT = "_pipetorch_weights_output"


@contextlib.contextmanager
def empty_weights() -> Iterator[None]:
    """Build models whose parameters are on the meta device (no memory, no initialisation
    kept) and whose buffers are real: buffers a model computes in its constructor (rotary
    frequencies, masks) are seldom in a checkpoint, so they must exist."""
    register = nn.Module.register_parameter

    def on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(self, name, param)
        if param is not None and param.device.type != "meta":
            self._parameters[name] = nn.Parameter(param.to("meta"),
                                                    requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]  # patched while building
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]  # restored


def map_weights(model: nn.Module, path: str | os.PathLike[str], *,
                output: str | os.PathLike[str] | None = None, strict: bool = True) -> nn.Module:
    """Map the weights of the safetensors checkpoint `path` (a file, HuggingFace's
    `model.safetensors.index.json`, or a folder holding one) into `model` (built under
    `empty_weights()` or `torch.device("meta")`, or holding any weights) without reading
    them: each stage worker reads its own. With `output`, copies of the trained weights to
    the host are written there, stage by stage, and the model maps them: a `.safetensors`
    file, or a folder of a file per stage and its index (each process writing only its own
    stages' files, with Distributed.stagesAcrossProcesses). Returns `model`.

    `strict` (as `load_state_dict`): the checkpoint's tensors and the model's state_dict must
    match, name for name (a weight tied under several names needs one). `strict=False` maps
    the tensors both have; the model keeps its own values for the rest. A tensor whose file
    is on another machine (a checkpoint saved over several) keeps what the model holds, which
    must not be the meta device.
    """
    source = checkpoint.Checkpoint(path)
    _check_names(model, source.path, set(source.files), strict=strict)
    _check_here(model, source)
    checkpoint.materialize(model, source)
    if output is not None:
        output = os.path.abspath(os.fspath(output))
        folder = output if not output.endswith(".safetensors") else os.path.dirname(output)
        if folder == output:
            os.makedirs(folder, exist_ok=True)
        if not os.access(folder, os.W_OK):
            raise ConfigError(f"map_weights(output={output!r}): cannot write in {folder}; "
                              "pass an output path in a writable folder")
        read = {source.path, *source.files.values()}
        if output in read or folder == output in map(os.path.dirname, read):
            raise ConfigError(f"map_weights(output={output!r}) is where the weights are "
                              "read from: pass another path")
    model.__dict__[_OUTPUT] = None if output is None else (output, source.path)
    return model


def _check_names(model: nn.Module, path: str, found: set[str], *, strict: bool) -> None:
    """Refuse, before anything is mapped, a file without a tensor the model holds on the meta
    device, and with `strict` one whose names differ from the model's state_dict."""
    aliases = checkpoint.aliases(model)  # a tied tensor has several names
    saved = set(model.state_dict())  # parameters and persistent buffers
    absent = [(t, names[0]) for t, names in aliases if not found.intersection(names)]
    empty = [(t, name) for t, name in absent if t.device.type == "meta"]
    if empty:
        raise ConfigError(f"map_weights: {path} " + "; ".join(_missing(empty, meta=True)))
    unexpected = sorted(found.difference(*(names for _, names in aliases)))
    missing = [(t, name) for t, name in absent if name in saved]
    if strict and (unexpected or missing):
        problems = ([f"holds {len(unexpected)} tensor(s) the model does not have: "
                     f"{_listed(unexpected)}"] if unexpected else []) + _missing(missing)
        raise ConfigError(
            f"map_weights: {path} does not match the model (strict=True, as load_state_dict): "
            + "; ".join(problems) + ". Map the file saved from this model's configuration, or "
            "pass strict=False to map the tensors both have (the model keeps its own values "
            "for the others)")


def _check_here(model: nn.Module, source: checkpoint.Checkpoint) -> None:
    """Refuse a checkpoint whose files of tensors the model holds on the meta device are not
    on this machine (each machine of a pipeline saved over several has its own stages')."""
    named = [next((n for n in names if n in source.files), None)
             for t, names in checkpoint.aliases(model) if t.device.type == "meta"]
    away = sorted({source.files[n] for n in named if n is not None and n not in source.entries})
    if away:
        raise ConfigError(
            f"map_weights: {source.path} names {len(away)} file(s) that are not on this "
            f"machine ({_listed([os.path.basename(f) for f in away])}), whose tensors the "
            "model holds on the meta device: a pipeline saved over several machines leaves "
            "each machine's stages' files on that machine; copy the files into one folder on "
            "each machine (or save into a folder every machine shares) before mapping it")


def _missing(absent: list[tuple[torch.Tensor, str]], *, meta: bool = False) -> list[str]:
    """"holds no parameter(s) ..." and "holds no buffer(s) ...", with the fix when `meta`."""
    said = []
    for kind in ("parameter", "buffer"):
        names = [n for t, n in absent if isinstance(t, nn.Parameter) == (kind == "parameter")]
        if not names:
            continue
        text = f"holds no {kind}(s) {_listed(names)}"
        if meta and kind == "parameter":
            text += (", which the model has on the meta device (no values): save them in the "
                     "file, or build the model with its weights and pass strict=False")
        elif meta:
            text += (", which the model has on the meta device: build it under "
                     "poptorch.empty_weights() (its buffers are then real), or save them in "
                     "the file")
        said.append(text)
    return said


def _listed(names: list[str], shown: int = 6) -> str:
    more = f" ... ({len(names)} in all)" if len(names) > shown else ""
    return ", ".join(map(repr, names[:shown])) + more


def output_of(model: nn.Module) -> saving.Writer | None:
    """Where copies to the host of `model`'s trained weights go: a Writer for map_weights's
    `output`, None for the host's memory."""
    found = model.__dict__.get(_OUTPUT)
    if found is None:
        return None
    output, source = found
    return saving.Writer(output, checkpoint.Checkpoint(source), model)
