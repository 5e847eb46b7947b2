"""Models larger than the host's memory: built without weights, their weights in a file that
each stage worker reads its own part of (a pipetorch extension; PopTorch has none).

    with poptorch.empty_weights():                  # parameters on the meta device
        model = GPT2LMHeadModel(config)
    poptorch.map_weights(model, "gpt2.safetensors",  # mapped, never read by the host
                         output="trained.safetensors")
    training = poptorch.trainingModel(model, opts, optimizer)

The host's copy of the model is the mapped file: the workers read their stages' bytes from it,
and a copy of the trained weights to the host (a weight touched, `copyWeightsToHost`,
`state_dict()`) writes them stage by stage to `output`, which the model then maps. Without
`output`, that copy goes into the host's memory as for any model.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch.nn as nn

from pipetorch.errors import ConfigError
from pipetorch.weights import mapped

__all__ = ["empty_weights", "map_weights"]

_OUTPUT = "_pipetorch_weights_output"


@contextlib.contextmanager
def empty_weights() -> Iterator[None]:
    """Build models whose parameters are on the meta device (no memory, no initialisation
    kept) and whose buffers are real: buffers a model computes in its constructor (rotary
    frequencies, masks) are seldom in a checkpoint, so they must exist."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"),
                                                    requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def map_weights(model: nn.Module, path: str | os.PathLike[str], *,
                output: str | os.PathLike[str] | None = None) -> nn.Module:
    """Map the weights of the safetensors file `path` into `model` (built under
    `empty_weights()` or `torch.device("meta")`, or holding any weights) without reading
    them: each stage worker reads its own. With `output`, copies of the trained weights to
    the host are written there, stage by stage, and the model maps that file. Returns `model`.
    """
    path = os.fspath(path)
    if not path.endswith(".safetensors"):
        raise ConfigError(f"map_weights({path!r}): the weights must be a .safetensors file "
                          "(safetensors.torch.save_file(model.state_dict(), path) writes "
                          "one); a torch.save file is read whole: load it with "
                          "model.load_state_dict(torch.load(path, mmap=True)) instead")
    missing = mapped.materialize(model, path)
    empty = [name for name in missing if _on_meta(model, name)]
    if empty:
        raise ConfigError(
            f"map_weights: {path} holds no {empty[:4]} ({len(empty)} tensors) and the model "
            "has them on the meta device: build the model under poptorch.empty_weights() "
            "(its buffers are then real), or save them in the file")
    if output is not None:
        output = os.path.abspath(os.fspath(output))
        folder = os.path.dirname(output)
        if not os.access(folder, os.W_OK):
            raise ConfigError(f"map_weights(output={output!r}): cannot write in {folder}; "
                              "pass an output path in a writable folder")
        if output == os.path.abspath(path):
            raise ConfigError(f"map_weights(output={output!r}) is the file the weights are "
                              "read from: pass another path")
    model.__dict__[_OUTPUT] = output
    return model


def output_of(model: nn.Module) -> mapped.Writer | None:
    """Where copies to the host of `model`'s trained weights go: a Writer for map_weights's
    `output`, None for the host's memory."""
    output = model.__dict__.get(_OUTPUT)
    return None if output is None else mapped.Writer(output)


def _on_meta(model: nn.Module, name: str) -> bool:
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    return tensors[name].device.type == "meta"
