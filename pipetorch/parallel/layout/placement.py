"""Which physical device each logical device's worker computes on, and the registry of workers.

Each logical device (an `ipu_id`) of each replica has one worker, which runs every stage on
that device. It maps to `cuda:i` when GPUs are present, else to a share of the CPU cores: each
worker gets cores // workers intra-op threads, so the workers together never ask for more
threads than there are cores. Workers register themselves in a directory that
`pipetorch devices` reads (like `gc-monitor`).
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from pipetorch import environment
from pipetorch.partition.strategies import StageSpec

__all__: list[str] = []

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class Placement:
    """Where the worker of logical device `ipu` of replica `replica` runs, and its stages."""

    stages: tuple[int, ...]  # the stages on `ipu`, in pipeline order
    ipu: int
    device: str    # "cpu" or "cuda:N"
    threads: int   # intra-op threads of the worker
    replica: int = 0  # this process's replica (0 .. replicationFactor - 1)


def cpu_cores() -> int:
    """Cores this process may run on (its affinity mask, not the machine's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class Physical:
    """The physical devices stage workers get, in the order logical devices take them."""

    devices: tuple[str, ...]  # ("cuda:0", "cuda:1", ...) or ("cpu",)
    cores: int                # CPU cores shared out as the workers' threads
    threads: int | None       # $PIPETORCH_THREADS_PER_DEVICE, else None (cores // workers)


def physical() -> Physical:
    """What $PIPETORCH_DEVICE, $PIPETORCH_NUM_DEVICES and $PIPETORCH_THREADS_PER_DEVICE give."""
    device = default_device()
    limit, threads = environment.get("num_devices"), environment.get("threads_per_device")
    cores = cpu_cores()
    if device.type == "cuda":
        count = torch.cuda.device_count()
        count = min(count, limit) if limit else count
        first = device.index or 0
        return Physical(tuple(f"cuda:{(first + n) % count}" for n in range(count)), cores,
                        threads)
    return Physical(("cpu",), min(cores, limit) if limit else cores, threads)


def place(stages: Sequence[StageSpec], *, replicas: int = 1) -> list[Placement]:
    """One placement per logical device and replica on the `physical()` devices, replica-major.

    Replica r's logical devices come after replica r-1's, as on IPUs: with 2 devices and 2
    replicas, GPUs 0 and 1 hold replica 0, GPUs 2 and 3 replica 1. Several processes on one
    machine (torchrun's LOCAL_RANK) take the next devices in turn.
    """
    found = physical()
    ipus = sorted({s.ipu_id for s in stages})
    held = [tuple(s.index for s in stages if s.ipu_id == ipu) for ipu in ipus]
    workers = len(ipus) * replicas
    if found.devices[0].startswith("cuda"):
        count = len(found.devices)
        first = int(os.environ.get("LOCAL_RANK", "0")) * workers
        if workers > count:
            logger.warning("%d logical devices (%d per replica x %d replicas) share %d GPU(s): "
                           "their workers take turns", workers, len(ipus), replicas, count)
        threads = max(1, found.cores // workers)
        return [Placement(held[d], ipu, found.devices[(first + r * len(ipus) + d) % count],
                          threads, r)
                for r in range(replicas) for d, ipu in enumerate(ipus)]
    cores = found.cores
    threads = found.threads or max(1, cores // workers)
    if workers > cores:
        logger.warning("%d device workers (%d devices x %d replicas) share %d CPU core(s): they "
                       "take turns; expect no speed-up from more devices", workers, len(ipus),
                       replicas, cores)
    else:
        logger.info("%d device worker(s) on the CPU, %d thread(s) each", workers, threads)
    return [Placement(held[d], ipu, "cpu", threads, r)
            for r in range(replicas) for d, ipu in enumerate(ipus)]


# -- registry --------------------------------------------------------------------------------
def registry_dir() -> Path:
    """$PIPETORCH_REGISTRY, else a per-user folder in the temp directory."""
    custom = environment.get("registry")
    return Path(custom) if custom else Path(tempfile.gettempdir()) / f"pipetorch-{os.getuid()}"


def register(placement: Placement, *, host_pid: int) -> Path:
    """Record this worker; the file goes away in `unregister` (or is pruned once stale)."""
    folder = registry_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"worker-{os.getpid()}.json"
    record = asdict(placement) | {"pid": os.getpid(), "host_pid": host_pid}
    path.write_text(json.dumps(record))
    return path


def unregister(pid: int) -> None:
    (registry_dir() / f"worker-{pid}.json").unlink(missing_ok=True)


def running(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped, does not count)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def live_workers() -> list[dict[str, Any]]:
    """Records of running workers; files of workers that died without cleaning up are removed."""
    folder = registry_dir()
    records = []
    for path in sorted(folder.glob("worker-*.json")) if folder.is_dir() else []:
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if running(int(record.get("pid", -1))):
            records.append(record)
        else:
            path.unlink(missing_ok=True)
    return records


def default_device() -> torch.device:
    """`$PIPETORCH_DEVICE` ("cpu", "cuda", "cuda:1"), else the first GPU, else the CPU."""
    chosen = environment.get("device")
    return chosen or torch.device("cuda" if torch.cuda.is_available() else "cpu")


def rng_state(device: torch.device) -> list[torch.Tensor]:
    """The random generators `device`'s work draws from: the CPU's, then the GPU's if any."""
    states = [torch.random.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def set_rng_state(states: list[torch.Tensor], device: torch.device) -> None:
    """Restore what `rng_state(device)` returned."""
    expected = 2 if device.type == "cuda" else 1
    if not isinstance(states, (list, tuple)) or len(states) != expected:
        raise ValueError(f"A random state for {device} is a list of {expected} uint8 tensors "
                         f"(as rng_state returns), got {states!r:.80}")
    torch.random.set_rng_state(states[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(states[1], device)
