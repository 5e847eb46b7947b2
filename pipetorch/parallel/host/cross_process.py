"""Several host processes (torchrun's): which workers each process runs when they share one
pipeline (Distributed.stagesAcrossProcesses), and how the processes of one machine share its
cores.

Devices are numbered across the processes: with D ipus in the model and P processes, process
p holds ipus p*k .. p*k + k - 1 (k = D / P) of every replica, so the pipeline axis is
outermost and a device's replicas, which sum their gradients, share one process. Each process
runs the workers of its own devices; they join the one process group of every worker
(`rendezvous`) and send activations and gradients to each other's ranks as on one host.

The hosts' rounds (outputs, reads, the start of each call) are `host_link`'s.

CPU workers share their machine's cores with the workers of every process on it: each process
says at launch, in torchrun's store, its machine and how many CPU workers it starts, and each
worker gets cores // (the machine's CPU workers) threads. torchrun's LOCAL_WORLD_SIZE cannot
tell: it is 1 in each of two `--nnodes` processes on one machine.
"""
from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import time
from dataclasses import dataclass
from typing import Sequence

import torch.distributed as dist

from pipetorch.errors import ConfigError, DeviceError
from pipetorch.parallel.comm.rendezvous import Rendezvous
from pipetorch.parallel.layout import placement as places
from pipetorch.parallel.layout.placement import Placement

__all__: list[str] = []

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Spread:
    """How one pipeline's devices are shared out over the processes."""

    process: int
    processes: int
    ipus: tuple[int, ...]     # the model's ipus, in order: a replica's devices
    stage_devices: tuple[int, ...]  # each stage's device (its place in `ipus`)

    @property
    def per_process(self) -> int:
        return len(self.ipus) // self.processes

    def holder(self, device: int) -> int:
        """The process running `device` (of every replica)."""
        return device // self.per_process

    def stages_of(self, process: int) -> list[int]:
        return [s for s, d in enumerate(self.stage_devices) if self.holder(d) == process]

    def layout(self) -> str:
        """Where every stage runs, for error messages."""
        return ", ".join(f"stage {s} on process {self.holder(d)}"
                         for s, d in enumerate(self.stage_devices))


def spread(placements: Sequence[Placement], owners: Sequence[int], *, process: int,
           processes: int) -> Spread:
    """The Spread of a plan's devices; a clear error when they cannot be shared out."""
    ipus = tuple(sorted({p.ipu for p in placements}))
    if len(ipus) % processes:
        raise ConfigError(
            f"Distributed.stagesAcrossProcesses shares a pipeline's devices out evenly over the "
            f"{processes} processes, but the model's stages use {len(ipus)} ipu(s) {list(ipus)}:"
            f" give the stages a multiple of {processes} ipus (process p holds ipus p*k .. "
            f"p*k + k - 1), or run {len(ipus)} process(es)")
    return Spread(process, processes, ipus, tuple(owners))


def local_placements(placements: Sequence[Placement], layout: Spread) -> list[Placement]:
    """The placements of this process's devices, on this machine's devices in turn (from
    its first GPU, whatever the ipu's number; several processes on one machine, torchrun's
    LOCAL_RANK, take the next ones), its CPU cores shared among them."""
    mine = [p for p in placements if layout.holder(layout.ipus.index(p.ipu)) == layout.process]
    found = places.physical()
    threads = found.threads or max(1, found.cores // len(mine))
    first = int(os.environ.get("LOCAL_RANK", "0")) * len(mine)
    return [dataclasses.replace(p, device=found.devices[(first + n) % len(found.devices)],
                                threads=threads) for n, p in enumerate(mine)]


def share_cores(placements: Sequence[Placement], meeting: Rendezvous, *, process: int,
                processes: int, machine: str, timeout: float) -> tuple[list[Placement], bool]:
    """`placements` with their CPU workers' threads shared out over every CPU worker that the
    processes on this `machine` start for this launch (PIPETORCH_THREADS_PER_DEVICE wins),
    and whether every process runs on this machine."""
    found = places.physical()
    cpu = sum(1 for p in placements if p.device == "cpu")
    store = dist.PrefixStore(meeting.prefix + "cores/", dist.TCPStore(
        meeting.address, meeting.port, is_master=False,
        timeout=datetime.timedelta(seconds=timeout)))
    store.set(str(process), f"{cpu} {machine}")
    keys, deadline = [str(q) for q in range(processes)], time.monotonic() + timeout
    while not store.check(keys):
        if time.monotonic() > deadline:
            missing = [q for q in range(processes) if not store.check([str(q)])]
            raise DeviceError(f"Process(es) {missing} of {processes} did not start this model "
                              f"within {timeout:.0f}s (PIPETORCH_TIMEOUT): every process runs "
                              "the same script and wraps the same models")
        time.sleep(0.01)
    said = [store.get(k).decode().split(" ", 1) for k in keys]
    here = sum(int(count) for count, where in said if where == machine)
    threads = found.threads or max(1, found.cores // max(here, 1))
    logger.info("%d CPU worker(s) of %d process(es) on this machine: %d thread(s) each", here,
                sum(where == machine for _, where in said), threads)
    return ([dataclasses.replace(p, threads=threads) if p.device == "cpu" else p
             for p in placements], all(where == machine for _, where in said))
