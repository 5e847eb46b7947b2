"""Copies of a mapped model's trained weights to the host, written to map_weights's `output`
as they arrive: one safetensors file, or a folder of one file per stage and HuggingFace's
index, each process writing only the stages its devices hold (the files of a process's
stages are on its machine; the index names every file).

    a copy to the host:
      begin(point)     each file written as <file>.partial, its header first
      write(...)       each tensor from this process's workers at its place, as it arrives
      seal()           this process's files complete and renamed into place
      (across processes: one round, each process sending the ids of the files it wrote)
      finish(ids)      the index, and the host's tensors mapped to the new files; a tensor
                       whose file is on another machine keeps what it held (or, held by this
                       process's stages too, as a tied weight is, its value in memory)

A tensor tied across stages is written once, in the file of the first stage holding it.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import uuid
from typing import Collection, Mapping, Sequence

import torch
import torch.nn as nn

from pipetorch.errors import ConfigError
from pipetorch.weights import checkpoint
from pipetorch.weights.checkpoint import Checkpoint
from pipetorch.weights.mapped import _DTYPES, SafetensorsFile

__all__: list[str] = []

logger = logging.getLogger(__name__)

_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


class _Partial:
    """One file being written: its tensors' places, and which have arrived."""

    def __init__(self, path: str, layout: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str]) -> None:
        self.path, self.partial = path, f"{path}.partial"
        header: dict[str, object] = {"__metadata__": metadata}
        self.places: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, (dtype, shape) in sorted(layout.items()):
            size = _nbytes(dtype, shape)
            header[name] = {"dtype": _NAMES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + size]}
            self.places[name] = (offset, size)
            offset += size
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # safetensors aligns the data to 8 bytes
        self.start = 8 + len(text)
        self.fd = os.open(self.partial, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        _write_all(self.fd, len(text).to_bytes(8, "little") + text, 0)
        os.ftruncate(self.fd, self.start + offset)
        self.missing = set(self.places)

    def write(self, name: str, data: bytes | memoryview) -> None:
        offset, size = self.places[name]
        if len(data) != size:
            raise ValueError(f"{name}: {len(data)} bytes arrived for a tensor of {size}")
        _write_all(self.fd, data, self.start + offset)
        self.missing.discard(name)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class Writer:
    """Where copies to the host of a mapped model's weights go (map_weights's `output`): a
    `.safetensors` file, or a folder of a file per stage and its index."""

    def __init__(self, output: str, source: Checkpoint, model: nn.Module) -> None:
        self.output, self.source = os.path.abspath(output), source
        self.sharded = not self.output.endswith(".safetensors")
        self.folder = self.output if self.sharded else os.path.dirname(self.output)
        self.keys: dict[int, str] = {}  # id() of the model's tensors -> name in the checkpoint
        self.tensors: dict[str, torch.Tensor] = {}
        for tensor, names in checkpoint.aliases(model):
            name = next((n for n in names if n in source.files), None)
            if name is not None:
                self.keys[id(tensor)], self.tensors[name] = name, tensor
        self.file_of: dict[str, str] = {}  # name -> its file's name in `folder`
        self.stage_of: dict[str, int] = {}  # name -> the first stage holding it
        self.mine: set[str] = set()  # the files this process writes
        self.lent: set[str] = set()  # see stays
        self._files: dict[str, _Partial] = {}
        self._kept: dict[str, torch.Tensor] = {}  # tied weights written elsewhere
        self._metadata: dict[str, str] = {}
        self.again = False  # this copy's point is in the files already
        self._sealed: int | None = None  # the point this writer last wrote

    def place(self, modules: Sequence[nn.Module], held: Collection[int]) -> None:
        """Share the tensors out over the files: each in the first of `modules` (the stages)
        holding it; those of no stage in the first file. This process holds stages `held`."""
        holders: dict[str, set[int]] = {}
        for stage, module in enumerate(modules):
            for tensor, _ in checkpoint.aliases(module):
                if id(tensor) in self.keys:
                    holders.setdefault(self.keys[id(tensor)], set()).add(stage)
        self.stage_of = {name: min(stages) for name, stages in holders.items()}
        stages = sorted(set(self.stage_of.values())) or [0]
        where = {name: self.stage_of.get(name, stages[0]) for name in self.source.files}
        if not self.sharded and not set(stages) <= set(held):
            raise ConfigError(
                f"map_weights(output={self.output!r}) is one file, but this process holds "
                f"stage(s) {sorted(held)} of {len(modules)}: with Distributed."
                "stagesAcrossProcesses each process writes its own stages' files; pass a "
                f"folder (output={os.path.splitext(self.output)[0]!r}) to write HuggingFace's "
                "sharded format, a file per stage and model.safetensors.index.json")
        number = {stage: n for n, stage in enumerate(stages)}
        self.file_of = {name: checkpoint.shard_name(number[stage], len(stages)) if self.sharded
                        else os.path.basename(self.output) for name, stage in where.items()}
        self.mine = {self.file_of[name] for name, stage in where.items() if stage in held}
        # tied weights this process writes that another process's stages hold too
        self.lent = {name for name, stages in holders.items()
                     if self.file_of[name] in self.mine and not stages <= set(held)}

    def takes(self, target: torch.Tensor) -> bool:
        """Whether `target`'s new value goes to a file (a tensor of the checkpoint, as its
        dtype there: one cast when mapped stays in memory)."""
        name = self.keys.get(id(target))
        return name is not None and target.dtype == self._layout(name)[0]

    def stays(self, target: torch.Tensor) -> bool:
        """Whether `target`'s new value reaches the other processes through the files alone
        (a tied weight another process's stage holds crosses as well: that process's
        worker holds a copy it does not send, and the file may not be on its machine)."""
        return self.takes(target) and self.keys[id(target)] not in self.lent

    def begin(self, point: int, *, current: bool = False) -> None:
        """A copy to the host of the weights of `point` (training calls) starts; `current`:
        the host holds that point's weights already. If this writer wrote them, nothing is
        written again (a copy of the optimiser's state after one of the weights)."""
        self._abandon()
        self.again = current and point == self._sealed
        self._metadata = {"format": "pt", checkpoint.POINT: str(point)}

    def write(self, stage: int, target: torch.Tensor, value: torch.Tensor) -> None:
        """`value`, from stage `stage`'s worker, is `target`'s new value."""
        name = self.keys[id(target)]
        file = self.file_of[name]
        if self.again:
            return
        if file not in self.mine:  # a tied weight, from the process writing it
            self._kept[name] = value.detach().to("cpu")
            return
        if self.stage_of[name] != stage:  # a later copy of a tied weight: written once
            return
        data = value.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy().data
        self._file(file).write(name, data)

    def seal(self) -> dict[str, str]:
        """Complete this process's files (a tensor no worker sent, one of no stage or cast in
        the model, keeps the source's bytes), put them in place and map the host's tensors
        to them; {file: the id of this save}, for the other processes to tell them from
        older files."""
        written: dict[str, str] = {}
        for file in sorted(self.mine) if not self.again else ():
            partial = self._file(file)
            for name in sorted(partial.missing):
                if name not in self.source.entries:
                    raise ValueError(f"{name!r} arrived from no stage and its file "
                                     f"{self.source.files[name]} is not on this machine: map "
                                     "a checkpoint whose files hold this process's stages")
                partial.write(name, self.source.read(name))
            partial.close()
            os.replace(partial.partial, partial.path)
            written[file] = self._metadata[checkpoint.SAVE]
        self._files.clear()
        self._map(self.mine)
        self._sealed = int(self._metadata[checkpoint.POINT])
        return written

    def finish(self, written: Mapping[str, str]) -> None:
        """After every process sealed its files (`written`: each file's save id): the index,
        and the host's tensors mapped to the other processes' files on this machine."""
        if self.again:
            return
        if self.sharded:
            self._write_index()
        away = self._map(set(self.file_of.values()) - self.mine, written)
        self._kept.clear()
        if away:
            logger.warning("%s %s saved on another machine: this process's host copy of "
                           "their weights keeps what it held (it never receives their "
                           "training); read them where they were saved",
                           ", ".join(sorted(away)), "is" if len(away) == 1 else "are")

    @torch.no_grad()
    def _map(self, files: Collection[str], written: Mapping[str, str] | None = None
             ) -> set[str]:
        """Map the host's tensors of `files` (this process's, or those `written` by the
        others where they are on this machine); the others' files not here."""
        found: dict[str, SafetensorsFile | None] = {}
        away: set[str] = set()
        for name, tensor in self.tensors.items():
            file = self.file_of[name]
            if self.again or file not in files or not self.takes(tensor):
                continue
            if file not in found:
                found[file] = self._readable(file, None if written is None else written.get(file))
            source = found[file]
            if source is not None:
                tensor.data = source.tensor(name)
            elif name in self._kept:
                tensor.data = self._kept.pop(name)
            else:
                away.add(file)
        return away

    def _readable(self, file: str, save: str | None) -> SafetensorsFile | None:
        """`file`, if on this machine and written by this save."""
        path = os.path.join(self.folder, file)
        if file in self.mine:
            return SafetensorsFile(path)
        try:
            opened = SafetensorsFile(path)
        except ValueError:  # not here: another machine's
            return None
        return opened if save is not None and opened.metadata.get(checkpoint.SAVE) == save \
            else None

    def _write_index(self) -> None:
        total = sum(_nbytes(*self._layout(name)) for name in self.file_of)
        index = {"metadata": {"total_size": total, checkpoint.POINT:
                              self._metadata[checkpoint.POINT]},
                 "weight_map": dict(sorted(self.file_of.items()))}
        path = os.path.join(self.folder, checkpoint.INDEX)
        temporary = f"{path}.{os.getpid()}.tmp"  # processes of one machine write the same
        with open(temporary, "w") as out:
            json.dump(index, out, indent=2)
        os.replace(temporary, path)

    def _layout(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        """`name`'s dtype and shape: the source's, else the model's."""
        entry = self.source.entries.get(name)
        if entry is not None:
            return entry.dtype, entry.shape
        tensor = self.tensors[name]
        return tensor.dtype, tuple(tensor.shape)

    def _file(self, file: str) -> _Partial:
        if file not in self._files:
            if checkpoint.SAVE not in self._metadata:
                self._metadata[checkpoint.SAVE] = uuid.uuid4().hex
            layout = {n: self._layout(n) for n, f in self.file_of.items() if f == file}
            self._files[file] = _Partial(os.path.join(self.folder, file), layout,
                                         self._metadata)
        return self._files[file]

    def _abandon(self) -> None:
        """Close and remove the files of a copy that did not complete (a worker failed)."""
        for partial in self._files.values():
            partial.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(partial.partial)
        self._files.clear()
        self._kept.clear()


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


def _write_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)
