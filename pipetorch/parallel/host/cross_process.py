"""One pipeline over several host processes (Distributed.stagesAcrossProcesses): which
workers each process runs, and what the processes tell each other through torchrun's store.

Devices are numbered across the processes: with D ipus in the model and P processes, process
p holds ipus p*k .. p*k + k - 1 (k = D / P) of every replica, so the pipeline axis is
outermost and a device's replicas, which sum their gradients, share one process. Each process
runs the workers of its own devices; they join the one process group of every worker
(`rendezvous`) and send activations and gradients to each other's ranks as on one host.

The hosts exchange, in rounds every process takes in the same order (they run the same
script): the outputs of each call, and the stages' weights when the host copy is read. Each
round is an all-gather over a gloo process group of the host processes (a process's death
breaks it at once). Each process also marks its arrival at a round in the store at
MASTER_ADDR:MASTER_PORT, and writes its error there when it fails, so the others stop waiting
at once and name it; one that never arrives is named after PIPETORCH_TIMEOUT.
"""
from __future__ import annotations

import dataclasses
import datetime
import io
import os
import socket
import time
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from pipetorch.errors import ConfigError, DeviceError
from pipetorch.parallel.layout import placement as places
from pipetorch.parallel.layout.placement import Placement
from pipetorch.parallel.comm.rendezvous import Rendezvous

__all__: list[str] = []

_POLL = 0.05  # the longest pause, in seconds, between looks at the store


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


class HostLink:
    """Rounds of values between the host processes of one pipeline: all-gathers over a gloo
    group of the hosts, with failure notices and arrival marks in torchrun's store."""

    def __init__(self, meeting: Rendezvous, layout: Spread, timeout: float) -> None:
        self.layout, self.timeout = layout, timeout
        self.name = f"process {layout.process} of {layout.processes} ({socket.gethostname()})"
        self._wait_for = datetime.timedelta(seconds=timeout)
        self._store = dist.PrefixStore(
            meeting.prefix + "hosts/",
            dist.TCPStore(meeting.address, meeting.port, is_master=False, timeout=self._wait_for))
        self._group: dist.ProcessGroup | None = None  # joined once every process is there
        self._round = 0
        self._failed = False

    def exchange(self, what: str, value: object) -> dict[int, object]:
        """Send `value` to the other processes; their values of this round, by process (the
        first round waits for every process, then joins their gloo group)."""
        if self._group is None:
            self._arrive(what)
            try:
                self._group = dist.ProcessGroupGloo(dist.PrefixStore("group/", self._store),
                                                    self.layout.process, self.layout.processes,
                                                    self._wait_for)
            except (RuntimeError, dist.DistError) as exc:
                self.check()
                raise self._broken(what, exc) from None
        data = torch.frombuffer(bytearray(_dumps(value)), dtype=torch.uint8)
        sizes = self._all_gather(torch.tensor([data.numel()]), what)
        padded = torch.zeros(int(max(sizes)), dtype=torch.uint8)
        padded[:data.numel()] = data
        parts = self._all_gather(padded, what)
        return {q: _loads(parts[q][:int(sizes[q])].numpy().tobytes())
                for q in range(self.layout.processes) if q != self.layout.process}

    def check(self) -> None:
        """Raise if another process has failed (before starting a call with it)."""
        found = self._failure()
        if found is not None:
            raise found

    def fail(self, message: str) -> None:
        """Tell the other processes this one failed (once)."""
        if not self._failed:
            self._failed = True
            try:
                self._store.set(f"failed/{self.layout.process}", message.encode())
            except Exception:  # the store's process is gone: the others see that themselves
                pass

    def _all_gather(self, tensor: torch.Tensor, what: str) -> list[torch.Tensor]:
        """Every process's `tensor` (all the same shape), in process order."""
        assert self._group is not None
        out = [torch.empty_like(tensor) for _ in range(self.layout.processes)]
        work = self._group.allgather([out], [tensor])
        self._arrive(what, wait=False)
        deadline, pause = time.monotonic() + self.timeout, 0.001
        while not work.is_completed():
            self.check()
            if time.monotonic() > deadline:
                raise self._silent(what)
            time.sleep(pause)  # from a millisecond, the usual lag, up to _POLL
            pause = min(2 * pause, _POLL)
        try:
            work.wait()
        except RuntimeError as exc:  # a process died: its notice, else the broken link
            time.sleep(_POLL)
            self.check()
            raise self._broken(what, exc) from None
        return out

    def _broken(self, what: str, exc: Exception) -> DeviceError:
        others = [q for q in range(self.layout.processes) if q != self.layout.process]
        return DeviceError(f"The link to {self._named(others)} broke during {what} "
                           f"({str(exc).splitlines()[0]}): that process stopped")

    def _arrive(self, what: str, *, wait: bool = True) -> None:
        """Mark this process's arrival at this round; with `wait`, until every process has
        (a process that never does is named after the timeout)."""
        me, n = self.layout.process, self._round
        self._round += 1
        self._store.set(f"{n}/{me}", b"")
        if n >= 2:  # everyone marked round n - 1 after round n - 2
            self._store.delete_key(f"{n - 2}/{me}")
        if not wait:
            return
        deadline, pause = time.monotonic() + self.timeout, 0.001
        while not self._store.check([f"{n}/{q}" for q in range(self.layout.processes)]):
            self.check()
            if time.monotonic() > deadline:
                raise self._silent(what, n)
            time.sleep(pause)
            pause = min(2 * pause, _POLL)
        self.check()  # one there before failing, or gone since

    def _silent(self, what: str, round_: int | None = None) -> DeviceError:
        """The error naming the processes that have not reached round `round_` (the last)."""
        n = self._round - 1 if round_ is None else round_
        missing = [q for q in range(self.layout.processes) if q != self.layout.process
                   and not self._store.check([f"{n}/{q}"])] or [
            q for q in range(self.layout.processes) if q != self.layout.process]
        return DeviceError(
            f"{self._named(missing).capitalize()} sent nothing for {what} within "
            f"{self.timeout:.0f}s (PIPETORCH_TIMEOUT): it stopped answering, never joined, or "
            "did not reach this point of the script; every process of one pipeline must run "
            "the same calls and reads")

    def _named(self, processes: list[int]) -> str:
        return " and ".join(f"process {q} of {self.layout.processes} (running stage(s) "
                            f"{self.layout.stages_of(q)})" for q in processes)

    def _failure(self) -> DeviceError | None:
        for q in range(self.layout.processes):
            key = f"failed/{q}"
            if q != self.layout.process and self._store.check([key]):
                message = self._store.get(key).decode()
                return DeviceError(f"Process {q} of {self.layout.processes} (running stage(s) "
                                   f"{self.layout.stages_of(q)}) failed: {message}")
        return None


def _dumps(value: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _loads(data: bytes) -> object:
    return torch.load(io.BytesIO(data), weights_only=False)
