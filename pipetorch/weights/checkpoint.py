"""Safetensors checkpoints as HuggingFace lays them out: one file, or a folder of files and
`model.safetensors.index.json` naming each tensor's file (save_pretrained's sharded format),
read tensor by tensor without reading the bytes (weights.mapped).

    folder/model.safetensors.index.json   {"metadata": {...}, "weight_map": {name: file}}
    folder/model-00001-of-00002.safetensors
    folder/model-00002-of-00002.safetensors   (maybe on another machine: see weights.saving)

A file pipetorch wrote names, in its `__metadata__`, the point of training it holds
(`pipetorch_point`: the training calls since the workers started) and the save that wrote it
(`pipetorch_save`); files of one checkpoint from different points are refused.
"""
from __future__ import annotations

import json
import logging
import os

import torch
import torch.nn as nn

from pipetorch.errors import ConfigError
from pipetorch.weights.mapped import Entry, SafetensorsFile

__all__: list[str] = []

logger = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
POINT, SAVE = "pipetorch_point", "pipetorch_save"  # keys of a file's __metadata__


def shard_name(number: int, count: int) -> str:
    """HuggingFace's name of file `number` (from 0) of `count`."""
    return f"model-{number + 1:05d}-of-{count:05d}.safetensors"


def aliases(model: nn.Module) -> list[tuple[torch.Tensor, list[str]]]:
    """Each parameter and buffer of `model` once, with every name it has (a tied tensor has
    several), in the model's order."""
    found: dict[int, tuple[torch.Tensor, list[str]]] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False),
                         *model.named_buffers(remove_duplicate=False)]:
        found.setdefault(id(tensor), (tensor, []))[1].append(name)
    return list(found.values())


class Checkpoint:
    """A checkpoint's tensors by name: the file holding each (`files`), and where their bytes
    are (`entries`) for those whose file is on this machine; the others' files are `absent`."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.path.abspath(os.fspath(path))
        self._opened: dict[str, SafetensorsFile] = {}
        index = self._index_path()
        self.files: dict[str, str] = {}  # tensor name -> absolute path of its file
        if index is None:
            self.files = dict.fromkeys(self._open(self.path).entries, self.path)
        else:
            folder = os.path.dirname(index)
            self.files = {name: os.path.join(folder, file)
                          for name, file in _read_index(index).items()}
        self.absent = sorted({f for f in self.files.values() if not os.path.exists(f)})
        self.entries: dict[str, Entry] = {}
        for name, file in self.files.items():
            if file not in self.absent:
                entries = self._open(file).entries
                if name not in entries:
                    raise ConfigError(f"{index} names {file} as the file of {name!r}, which "
                                      "that file does not hold: the index and the files are "
                                      "from different saves; save the checkpoint again")
                self.entries[name] = entries[name]
        self._check_points()

    def _index_path(self) -> str | None:
        """The index file, None for a single file; what a path can be, if neither."""
        if os.path.isdir(self.path):
            for name in (INDEX, SINGLE):
                if os.path.exists(os.path.join(self.path, name)):
                    self.path = os.path.join(self.path, name)
                    return self.path if name == INDEX else None
            raise ConfigError(f"{self.path} holds neither {INDEX} nor {SINGLE}: pass the "
                              "folder save_pretrained (or map_weights's output) wrote, or a "
                              ".safetensors file")
        if self.path.endswith(".json"):
            return self.path
        if not self.path.endswith(".safetensors"):
            raise ConfigError(f"map_weights({self.path!r}): the weights must be a .safetensors "
                              f"file, a {INDEX} or a folder holding one (safetensors.torch."
                              "save_file(model.state_dict(), path) writes a file); a torch.save "
                              "file is read whole: load it with model.load_state_dict("
                              "torch.load(path, mmap=True)) instead")
        return None

    def _open(self, file: str) -> SafetensorsFile:
        if file not in self._opened:
            self._opened[file] = SafetensorsFile(file)
        return self._opened[file]

    def _check_points(self) -> None:
        """Refuse files from different points of training (a save cut short, files mixed)."""
        points = {f: self._opened[f].metadata.get(POINT) for f in self._opened}
        if len({p for p in points.values() if p is not None}) > 1:
            said = ", ".join(f"{os.path.basename(f)}: {p}" for f, p in sorted(points.items()))
            raise ConfigError(f"{self.path}: its files hold weights from different points of "
                              f"training (training calls: {said}): a save was cut short or "
                              "files of several saves were mixed; save the checkpoint again")

    def tensor(self, name: str) -> torch.Tensor:
        """`name`'s tensor, mapped (its file must be on this machine)."""
        return self._open(self.files[name]).tensor(name)

    def read(self, name: str) -> bytes:
        """`name`'s bytes, read."""
        entry = self.entries[name]
        with open(self.files[name], "rb") as file:
            file.seek(entry.start)
            return file.read(entry.end - entry.start)


def _read_index(index: str) -> dict[str, str]:
    try:
        with open(index) as file:
            weight_map = json.load(file)["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{index} is not a readable safetensors index ({exc}): it must hold "
                          '{"metadata": {...}, "weight_map": {name: file}}, as '
                          "save_pretrained writes") from exc
    return dict(weight_map)


def materialize(model: nn.Module, source: Checkpoint) -> list[str]:
    """Give `model` (built on the meta device, or with any weights) the tensors of `source`,
    mapped, under their names in the model's state_dict; the Parameter objects stay the same
    (an optimiser built before keeps them). A tensor tied under several names needs one of
    them in the checkpoint. Returns the names of the tensors mapped from no file (buffers the
    model computes itself are fine; a tensor whose file is on another machine keeps what it
    holds)."""
    missing = []
    for tensor, names in aliases(model):
        name = next((n for n in names if n in source.entries), None)
        if name is None:
            missing.append(names[0])
            continue
        entry = source.entries[name]
        if entry.shape != tuple(tensor.shape):
            raise ValueError(f"{source.files[name]}: {name!r} has shape {list(entry.shape)} in "
                             f"the file but {list(tensor.shape)} in the model: build the model "
                             "with the configuration the file was saved from")
        mapped = source.tensor(name)
        if mapped.dtype != tensor.dtype:  # a cast reads the bytes into memory
            mapped = mapped.to(tensor.dtype)
        value: torch.Tensor = (nn.Parameter(mapped, requires_grad=tensor.requires_grad)
                               if isinstance(tensor, nn.Parameter) else mapped)
        torch.utils.swap_tensors(tensor, value)
    if source.absent:
        logger.info("%d file(s) of %s are not on this machine (%s): their tensors keep what "
                    "the model holds", len(source.absent), source.path,
                    ", ".join(os.path.basename(f) for f in source.absent))
    return missing
