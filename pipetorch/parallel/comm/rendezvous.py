"""How device workers find each other: one torch.distributed store, ranks and replica groups.

Every worker of every host process joins one process group. Rank = global replica x devices +
device, where the global replica is process_id x replicationFactor + the local replica and
device numbers a replica's logical devices (its distinct ipu_ids, in order) from 0.

The store: with one host process, a TCPStore this process serves on 127.0.0.1. Under torchrun
(several processes, maybe several machines), the store at MASTER_ADDR:MASTER_PORT: torchrun's
own agent store when it says so (TORCHELASTIC_USE_AGENT_STORE), else one that process 0 serves.
Each launch uses a fresh key prefix, the same on every host as long as they run the same script.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch.distributed as dist

from pipetorch.errors import ConfigError

__all__: list[str] = []

_stores: dict[tuple[str, int], dist.TCPStore] = {}  # kept alive for the life of the process
_launches = 0


@dataclass(frozen=True)
class Rendezvous:
    """Where a worker meets the others and which rank it is."""

    address: str
    port: int
    prefix: str
    world_size: int
    devices: int    # workers per replica
    replicas: int   # global: replicationFactor x processes

    def rank(self, replica: int, device: int) -> int:
        return replica * self.devices + device

    def device_ranks(self, device: int) -> list[int]:
        """The ranks of `device` in every replica: its gradient all-reduce group."""
        return [self.rank(r, device) for r in range(self.replicas)]


def _host_store(process_id: int, num_processes: int, timeout: float) -> tuple[str, int]:
    wait = datetime.timedelta(seconds=timeout)
    if num_processes == 1:
        key = ("127.0.0.1", 0)
        if key not in _stores:
            _stores[key] = dist.TCPStore("127.0.0.1", 0, is_master=True,
                                         wait_for_workers=False, timeout=wait)
        return "127.0.0.1", _stores[key].port
    address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not address or not port or not port.isdigit():
        raise ConfigError(
            f"This is process {process_id} of {num_processes}, but MASTER_ADDR / MASTER_PORT "
            f"are {address!r} / {port!r}: start every process with torchrun (e.g. torchrun "
            "--nnodes 2 --nproc-per-node 1 --master-addr HOST --master-port 29500 script.py), "
            "or set them to an address and free port that process 0's machine can serve")
    key = (address, int(port))
    if key not in _stores:
        serve = process_id == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        _stores[key] = dist.TCPStore(address, int(port), is_master=serve,
                                     wait_for_workers=False, timeout=wait)
    return key


def host_store(process_id: int, num_processes: int, timeout: float) -> dist.TCPStore:
    """This launch's store (MASTER_ADDR:MASTER_PORT's under torchrun), kept for the process."""
    return _stores[_host_store(process_id, num_processes, timeout)]


def next_rendezvous(*, process_id: int, num_processes: int, devices: int, replicas: int,
                    timeout: float, across: bool = False) -> Rendezvous:
    """The meeting point of this launch's workers (replicas: this process's replicationFactor;
    `across`: the processes hold one pipeline's devices, `devices` of them in all, and share
    its replicas rather than adding their own)."""
    global _launches
    _launches += 1
    address, port = _host_store(process_id, num_processes, timeout)
    total = replicas if across else replicas * num_processes
    return Rendezvous(address, port, f"pipetorch/{_launches}/", total * devices, devices, total)


def join(rendezvous: Rendezvous, *, rank: int, backend: str, timeout: float,
         group_timeout: float | None = None) -> dist.Store:
    """Join the launch's process group (in a worker): the store waits `timeout` seconds, the
    group's operations (NCCL's watchdog) `group_timeout`, by default the same. Returns the
    launch's store (its keys are this launch's alone)."""
    wait = datetime.timedelta(seconds=timeout)
    client = dist.TCPStore(rendezvous.address, rendezvous.port, is_master=False, timeout=wait)
    operations = wait if group_timeout is None else datetime.timedelta(seconds=group_timeout)
    store = dist.PrefixStore(rendezvous.prefix, client)
    dist.init_process_group(backend, store=store, rank=rank, world_size=rendezvous.world_size,
                            timeout=operations)
    return store
