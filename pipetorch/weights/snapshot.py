"""A stage's weights and optimiser state: read in a worker, and kept on disk after calls.

After a call that changes weights (a training call the host's SnapshotPolicy picks, and every
copyWeightsToDevice) each stage of replica 0 writes its state to a file named for the call's
parity. If a worker dies later, the files hold every stage's state after the last call
written, so the user's model returns to it: the last completed call while writing is cheap
(PIPETORCH_SNAPSHOTS=auto writes after every call until a write costs more than a tenth of the
training between writes). Writes go to a temporary name first and are renamed into place, so a
worker killed mid-write never leaves a torn file behind (the previous file stays).
"""
from __future__ import annotations

import os
from typing import Any, Iterator, Mapping, Sequence

import torch
import torch.nn as nn

from pipetorch.optim import offload, scaling
from pipetorch.weights import mapped, saving

__all__: list[str] = []

StageState = tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]], dict[str, Any]]
"""(parameters and buffers by name, optimiser state by parameter name, optimiser-wide state:
{"scaling": automatic loss scaling's state})."""


def stage_state(module: nn.Module, optimizer: torch.optim.Optimizer | None, *,
                tensors: bool = True, skip: frozenset[int] = frozenset()) -> StageState:
    """Everything of the stage that training changes: its own tensors, not copies (sending
    or saving them copies each storage in turn, never the whole stage at once), but those
    whose id() is in `skip`. Without `tensors`, of the optimiser only its small attributes
    (the dynamic loss scale)."""
    state = {n: t.detach() for n, t in [*module.named_parameters(), *module.named_buffers()]
             if id(t) not in skip}
    optimizer_state: dict[str, dict[str, Any]] = {}
    attributes: dict[str, Any] = {}
    if optimizer is not None and tensors:
        for name, param in module.named_parameters():
            if param in optimizer.state:
                optimizer_state[name] = {
                    k: v.detach() if isinstance(v, torch.Tensor) else v
                    for k, v in optimizer.state[param].items()}
    if optimizer is not None:
        attributes = {"scaling": scaling.scaling_state(optimizer)}
    return state, optimizer_state, attributes


Item = tuple[int, str, str, str, Any]
"""One value of a stage's state on its own: (stage, "weight" | "state" | "attributes", name,
optimiser state key, value)."""


def items(stage: int, state: StageState) -> Iterator[Item]:
    """`state` value by value, so a copy to the host holds one tensor at a time in transit;
    each value is taken out of `state` as it goes (a tensor held nowhere else, as a worker's
    moving optimiser state, is freed once sent)."""
    weights, optimizer_state, attributes = state
    for name in list(weights):
        yield stage, "weight", name, "", _compact(weights.pop(name))
    for name in list(optimizer_state):
        values = optimizer_state.pop(name)
        for key in list(values):
            yield stage, "state", name, key, _compact(values.pop(key))
    if attributes:
        yield stage, "attributes", "", "", attributes


class Loader:
    """Puts items into the host's stage modules and optimiser, in place where it can."""

    def __init__(self, modules: Sequence[nn.Module],
                 optimizer: torch.optim.Optimizer | None, *,
                 writer: saving.Writer | None = None) -> None:
        self.modules, self.optimizer, self.writer = modules, optimizer, writer
        self._tensors: dict[int, dict[str, torch.Tensor]] = {}
        self._params: dict[int, dict[str, nn.Parameter]] = {}
        self._stepped: set[int] | None = None  # id() of the optimiser's parameters

    def finish(self, written: Mapping[str, str]) -> None:
        """After the last item: the host maps the weights' files (if any; `written`: the
        files every process wrote, by save id, see weights.saving)."""
        if self.writer is not None:
            self.writer.finish(written)

    @torch.no_grad()
    def put(self, item: Item) -> None:
        stage, kind, name, key, value = item
        module = self.modules[stage]
        if kind == "weight":
            if stage not in self._tensors:
                self._tensors[stage] = dict([*module.named_parameters(), *module.named_buffers()])
            target = self._tensors[stage][name]
            if mapped.same_bytes(target, value):  # weights shared with the worker
                mapped.refresh(target)  # the host's next read sees what the worker wrote
            elif self.writer is not None and self.writer.takes(target):
                self.writer.write(stage, target, value)  # to the weights' file, not into memory
            else:
                target.copy_(value)
            return
        assert self.optimizer is not None
        if kind == "attributes":
            scaling.load_scaling_state(self.optimizer, value["scaling"])
            return
        if stage not in self._params:
            self._params[stage] = dict(module.named_parameters())
        param = self._params[stage][name]
        if self._stepped is None:
            self._stepped = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        if id(param) not in self._stepped:
            return  # a tied weight this device does not step: its state is the first device's
        held = self.optimizer.state[param]
        old = held.get(key)
        if isinstance(value, torch.Tensor) and value.dim():
            home = torch.device("cpu") if offload.is_offloaded(self.optimizer) else param.device
            if (isinstance(old, torch.Tensor) and old.shape == value.shape
                    and old.dtype == value.dtype and old.device == home):
                old.copy_(value)  # the host's tensor keeps its memory
                return
            value = value.to(home)
        held[key] = value


def _compact(value: object) -> object:
    """A tensor that is a view of a larger storage (flat parameter buffers) as a copy of its
    own bytes: a message sends whole storages."""
    if isinstance(value, torch.Tensor):
        own = value.numel() * value.element_size()
        if value.untyped_storage().nbytes() > 2 * own + (1 << 16):  # a page's slack is fine
            return value.clone()
    return value


def count(state: StageState) -> int:
    """How many items `items` yields for `state`."""
    weights, optimizer_state, attributes = state
    return len(weights) + sum(len(v) for v in optimizer_state.values()) + bool(attributes)


def load_stage_state(module: nn.Module, optimizer: torch.optim.Optimizer | None,
                     stage: StageState) -> None:
    """Put `stage` into `module` (in place, any device) and `optimizer`."""
    loader = Loader([module], optimizer)
    for item in items(0, stage):
        loader.put(item)


# PIPETORCH_SNAPSHOTS=auto: a state this small is written after every call; a larger one once
# the training since the last write took RATIO times as long as that write. Every call's write
# of 4 MB stages cost a pipeline over 2 processes a quarter of its speed, and of 64 MB stages
# 40% (2026-12-07): over 1 MB, writes take at most a tenth of the time.
SMALL, RATIO = 1 << 20, 9.0


class SnapshotPolicy:
    """Which training calls the workers write their state after (PIPETORCH_SNAPSHOTS)."""

    def __init__(self, setting: str) -> None:
        self.setting = setting
        self.last: tuple[float, int] | None = None  # the last write: (seconds, bytes)
        self.trained = 0.0  # seconds of training calls since the last write

    def wanted(self) -> bool:
        """Whether the next training call ends with a write."""
        if self.setting != "auto":
            return self.setting == "1"
        if self.last is None:
            return True
        seconds, nbytes = self.last
        return nbytes <= SMALL or self.trained >= RATIO * seconds

    def called(self, seconds: float, written: tuple[float, int] | None) -> None:
        """A training call took `seconds`, ending with a write of (seconds, bytes) or not."""
        if written is None:
            self.trained += seconds
        else:
            self.last, self.trained = written, 0.0


def nbytes(state: StageState) -> int:
    """The bytes of `state`'s tensors."""
    weights, optimizer_state, _ = state
    values = [*weights.values(), *(v for s in optimizer_state.values() for v in s.values())]
    return sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))


def path(folder: str, stage: int, commit: int, part: int = 0) -> str:
    """The file of `stage`'s state after `commit`; `part` r > 0: replica r's slices of the
    optimiser state, when it is sharded over the replicas (parallel.worker.sharded_step)."""
    return os.path.join(folder, f"stage{stage}-{commit % 2}" + (f".r{part}" if part else "")
                        + ".pt")


def write(folder: str, stage: int, commit: int, state: StageState, part: int = 0) -> None:
    target = path(folder, stage, commit, part)
    temporary = f"{target}.{os.getpid()}.tmp"
    torch.save((commit, state), temporary)
    os.replace(temporary, target)


def read(folder: str, stage: int, commit: int) -> StageState | None:
    """The state written after call `commit` (its slices joined, when replicas wrote one
    part each), or None when there is no such file."""
    first = _read(path(folder, stage, commit), commit)
    replicas = first[2].get("slices", 1) if first is not None else 1
    if first is None or replicas == 1:
        return first
    parts = [first] + [_read(path(folder, stage, commit, r), commit) for r in range(1, replicas)]
    found = [part for part in parts if part is not None]
    if len(found) < len(parts):
        return None
    weights, states, attributes = first
    for name in attributes["sliced"]:
        for key, value in states[name].items():
            if isinstance(value, torch.Tensor) and value.dim():
                pieces = [part[1][name][key] for part in found]
                states[name][key] = torch.cat(pieces).view(weights[name].shape)
    return weights, states, {"scaling": attributes["scaling"]}


def _read(file: str, commit: int) -> StageState | None:
    try:
        found, state = torch.load(file, weights_only=False, map_location="cpu", mmap=True)
    except (OSError, EOFError, RuntimeError):
        return None
    return state if found == commit else None
