"""Every PIPETORCH_* environment variable in one place: its type, default, meaning and check.

`get(field)` parses one variable as os.environ holds it now: modules call it at each use, so
a change between two calls counts and a bad value fails only where it is used. The table in
docs/machines.md is checked against `Environment` (POPTORCH_* ones: options.environment).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from pipetorch.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__: list[str] = []

_T = TypeVar("_T")
_Number = TypeVar("_Number", int, float)


def _var(default: _T, shown: str, meaning: str, parse: Callable[[str, str], _T]) -> _T:
    """A field; `parse(variable, its value stripped)` gives the value when the variable is set."""
    return field(default=default, metadata={"shown": shown, "meaning": meaning, "parse": parse})


def _choice(default: str, meanings: dict[str, str], convert: Callable[[str], str] = str) -> str:
    """A field taking one of `meanings`' keys (in any case), as `convert` turns it."""
    def parse(name: str, raw: str) -> str:
        if raw.lower() not in meanings:
            allowed = [f"{value} ({meaning})" for value, meaning in meanings.items()]
            raise ConfigError(f"{name}={raw!r} must be {', '.join(allowed[:-1])} or {allowed[-1]}")
        return convert(raw.lower())

    described = "; ".join(f"`{value}`: {meaning}" for value, meaning in meanings.items())
    return _var(convert(default), f"`{default}`", described, parse)


def _positive(kind: type[_Number], what: str) -> Callable[[str, str], _Number]:
    def parse(name: str, raw: str) -> _Number:
        try:
            if kind(raw) > 0:
                return kind(raw)
        except ValueError:
            pass
        raise ConfigError(f"{name}={raw!r} must be a positive {what}")
    return parse


def _niceness(name: str, raw: str) -> int:
    try:
        if 0 <= int(raw) <= 19:
            return int(raw)
    except ValueError:
        pass
    raise ConfigError(f"{name}={raw!r} must be a whole number from 0 (as your process) to 19")


def _device(name: str, raw: str) -> torch.device:
    import torch  # here: `import pipetorch` does not import torch

    try:
        device = torch.device(raw)
    except RuntimeError as exc:
        raise ConfigError(f"{name}={raw!r} is not a torch device: use 'cpu' or 'cuda[:N]'") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{name}={raw!r} asks for a GPU but CUDA is not available here; use "
                          "'cpu'")
    return device


def _backend(name: str, raw: str) -> str | None:
    if raw in ("", "0", "1"):
        return "inductor" if raw == "1" else None
    import torch._dynamo  # here: only a named backend needs the list

    if raw not in torch._dynamo.list_backends(exclude_tags=()):
        raise ConfigError(f"{name}={raw!r} names no torch.compile backend; use 1 (inductor), 0, "
                          f"or one of {torch._dynamo.list_backends()}")
    return raw


@dataclass(frozen=True)
class Environment:
    """What the PIPETORCH_* variables ask for (field x: PIPETORCH_X); metadata says how."""

    device: torch.device | None = _var(None, "the first GPU, else the CPU",
                                       "`cpu`, `cuda` or `cuda:N`: where stages run", _device)
    num_devices: int | None = _var(None, "all", "at most this many GPUs, or CPU cores to share "
                                   "out", _positive(int, "whole number"))
    threads_per_device: int | None = _var(None, "a host's cores / its CPU workers (of every "
                                          "process), at least 1",
                                          "intra-op threads per CPU worker",
                                          _positive(int, "whole number"))
    execution: str = _choice("auto", {
        "auto": "workers when there is more than one device (logical devices x replicas) or "
                "process",
        "local": "every stage and replica in your process, one after another (the reference)",
        "processes": "workers even for one device"})
    timeout: float = _var(600.0, "`600`", "seconds any wait may last before it fails",
                          _positive(float, "number of seconds"))
    transport: str = _choice("shm", {
        "shm": "bundles between CPU workers of one host through shared memory (torch.distributed "
               "where it cannot reach)",
        "gloo": "through torch.distributed (gloo, or NCCL between GPUs)"})
    snapshots: str = _choice("auto", {
        "auto": "workers write the state to disk after a training call, for the model if one "
                "dies: after every call while writing is cheap, else once the training since "
                "the last write took 9 times as long as writing (a tenth of the time at most)",
        "1": "after every training call",
        "0": "never (the model keeps the weights of its last copy to the host)"})
    shared_weights: str = _choice("1", {
        "1": "CPU workers train the host copy's weights in place, mapped from shared memory "
             "(the weights are in memory once; training needs snapshots on)",
        "0": "each CPU worker holds its own copy of its stage's weights"})
    overlap: str = _choice("auto", {
        "auto": "`1` between GPUs (NCCL), `0` on CPUs (gloo sums on the cores the backward "
                "needs, and buckets in flight hold up to a second copy of the gradients)",
        "1": "replicas start summing a bucket of gradients as soon as the step's last backward "
             "finished it",
        "0": "replicas sum the gradients after the whole backward, at the optimiser step"})
    worker_pool: str = _choice("1", {
        "1": "fork workers from a warm process started by the first wrapper",
        "early": "start that process at `import pipetorch`",
        "0": "start each worker as a new process"})
    worker_nice: int = _var(10, "`10`", "niceness each stage worker adds to its own: where "
                            "the workers and your process want more cores than there are, your "
                            "process (which feeds the stages and reads their replies) gets one "
                            "first; `0`: the same as your process", _niceness)
    compile: str | None = _var(None, "`0`", "`1`: compile each stage with torch.compile "
                               "(inductor), as `opts.Jit.compileStages(True)`; a backend's name: "
                               "with that backend; `0`: not", _backend)
    registry: str | None = _var(None, "`$TMPDIR/pipetorch-UID`", "the folder stage workers "
                                "register in, which `pipetorch devices` reads",
                                lambda name, raw: raw or None)
    max_devices: int = _var(64, "`64`", "the most logical devices (each a process) a model may "
                            "ask for", _positive(int, "whole number"))


_FIELDS = {f.name: f for f in fields(Environment)}


def variable(name: str) -> str:
    """The environment variable of field `name`: PIPETORCH_NAME."""
    return f"PIPETORCH_{name.upper()}"


def get(name: str) -> Any:
    """Field `name`: its variable parsed now, or the field's default when unset."""
    raw, spec = os.environ.get(variable(name)), _FIELDS[name]
    return spec.default if raw is None else spec.metadata["parse"](variable(name), raw.strip())


def read() -> Environment:
    """Every variable parsed now; the first bad one raises."""
    return Environment(**{name: get(name) for name in _FIELDS})
