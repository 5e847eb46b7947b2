"""Messages between the user's process and its workers: over pipes, tensors storage by storage
(parallel.comm.stream), every wait bounded."""
from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Collection, Protocol, Sequence

from pipetorch.errors import DeviceError
from pipetorch.parallel.comm import exits, stream

__all__: list[str] = []


def send(conn: Connection, message: object, *, shared: Collection[int] = ()) -> None:
    """Send by value (no shared-memory handles that could outlive their sender), each tensor's
    bytes from its own memory; `shared`: the host's live weights this worker maps instead
    (weights.shared)."""
    stream.send(conn, message, shared=shared)


@dataclass(frozen=True)
class Transfer:
    """When a message's bytes were read and unpickled (monotonic ns), and how many there were."""

    start: int
    end: int
    nbytes: int


def receive(conn: Connection, *, timeout: float, parent: int | None = None) -> Any:
    """The next message; raises TimeoutError after `timeout` s, EOFError if the sender is gone
    or (in a worker) if the process `parent` that started it has exited."""
    return receive_timed(conn, timeout=timeout, parent=parent)[0]


def receive_timed(conn: Connection, *, timeout: float,
                  parent: int | None = None) -> tuple[Any, Transfer]:
    """`receive`, and the Transfer that brought the message (from its arrival, not the wait)."""
    alive = None if parent is None else (lambda: os.getppid() == parent)
    stream.wait(conn, timeout, alive)
    start = time.monotonic_ns()
    message, nbytes = stream.receive(conn, timeout=timeout, alive=alive)
    return message, Transfer(start, time.monotonic_ns(), nbytes)


@dataclass(frozen=True)
class Failure:
    """An exception in a worker, as the worker saw it."""

    stage: int              # the stage of the action that failed (else the worker's first;
    # -1 before the worker knew its stages: the host names them)
    device: str
    pid: int
    action: str | None      # "F", "B", "S>F", ... or None outside the schedule
    micro_batch: int | None
    error: str              # "IndexError: Target 10 is out of bounds."
    traceback: str
    replica: int = 0


class Process(Protocol):
    """What the host uses of a worker's process: a subprocess.Popen, or a pool.PooledProcess."""

    pid: int

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def kill(self) -> None: ...


@dataclass(frozen=True)
class Peer:
    """The host's view of one worker: its pipe, its process sentinel and the stages it runs."""

    stages: tuple[int, ...]
    device: str
    conn: Connection
    process: Process
    replica: int = 0
    replicas: int = 1  # this process's replicas: named in messages only when more than one
    oom_kills: int | None = None  # the kernel's count of OOM kills when it started (exits)

    def describe(self) -> str:
        replica = f" of replica {self.replica}" if self.replicas > 1 else ""
        return f"{stage_names(self.stages)}{replica} on {self.device} (pid {self.process.pid})"


def stage_names(stages: Sequence[int]) -> str:
    """"stage 1", "stages 0 and 2", "stages 0, 1 and 2"."""
    if len(stages) == 1:
        return f"stage {stages[0]}"
    return f"stages {', '.join(map(str, stages[:-1]))} and {stages[-1]}"


class WorkerFailed(DeviceError):
    """A worker raised; the message carries its traceback and where it was."""

    def __init__(self, message: str, failure: Failure | None = None) -> None:
        super().__init__(message)
        self.failure = failure


def gather(peers: Sequence[Peer], *, timeout: float, what: str,
           transfers: list[Transfer] | None = None) -> list[Any]:
    """One reply from every worker, in the order of `peers` (their Transfers in `transfers`).

    A worker's error, its death (its end of the pipe closes), or `timeout` seconds without
    progress raises WorkerFailed naming the worker; the caller then stops all workers.
    """
    replies: dict[int, Any] = {}
    timings: dict[int, Transfer] = {}
    waiting = {p.conn: (n, p) for n, p in enumerate(peers)}
    deadline = time.monotonic() + timeout
    while waiting:
        for conn in wait(list(waiting), timeout=stream.POLL * 5):
            assert isinstance(conn, Connection)  # the only kind waited on
            n, peer = waiting.pop(conn)
            start = time.monotonic_ns()
            try:
                reply, nbytes = stream.receive(peer.conn, timeout=timeout)
            except (EOFError, OSError):
                raise _died(peer, what) from None
            except TimeoutError:
                raise WorkerFailed(
                    f"A reply during {what} from {peer.describe()} stopped arriving for "
                    f"{timeout:.0f}s; raise PIPETORCH_TIMEOUT if that is legitimate") from None
            if isinstance(reply, Failure):
                # A worker whose peer died fails on the broken connection: name the dead one.
                dead = _first_dead(peers)
                if dead:
                    raise _died(dead, what)
                if reply.stage < 0:  # it failed before it knew its stages
                    reply = dataclasses.replace(reply, stage=peer.stages[0],
                                                device=peer.device, replica=peer.replica)
                raise WorkerFailed(reply.error, reply)
            replies[n] = reply.value  # a messages.Done
            timings[n] = Transfer(start, time.monotonic_ns(), nbytes)
            deadline = time.monotonic() + timeout
        if waiting and time.monotonic() > deadline:
            stuck = ", ".join(p.describe() for _, p in waiting.values())
            raise WorkerFailed(
                f"No reply during {what} from {stuck} within {timeout:.0f}s; raise "
                "PIPETORCH_TIMEOUT if a call legitimately takes longer")
    if transfers is not None:
        transfers[:] = [timings[n] for n in range(len(peers))]
    return [replies[n] for n in range(len(peers))]


def _died(peer: Peer, what: str) -> WorkerFailed:
    code = _exit_code(peer.process)
    return WorkerFailed(
        f"The worker running {peer.describe()} died during {what} ({exits.status(code)}). "
        f"{exits.cause(code, peer.oom_kills)}. The wrapper cannot continue: call destroy() and "
        "build a new one")


def unreachable(peer: Peer, error: OSError) -> str:
    """Why the pipe to `peer` broke: how the worker ended, if it has, else `error`."""
    if _first_dead([peer]) is None:
        return f"the worker running {peer.describe()} cannot be reached ({error})"
    code = _exit_code(peer.process)
    return (f"the worker running {peer.describe()} died ({exits.status(code)}). "
            f"{exits.cause(code, peer.oom_kills)}")


def _first_dead(peers: Sequence[Peer], *, grace: float = 1.0) -> Peer | None:
    """A worker that has exited, waiting up to `grace` s for the kernel to report it."""
    deadline = time.monotonic() + grace
    while True:
        for peer in peers:
            if peer.process.poll() is not None:
                return peer
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)


def _exit_code(process: Process) -> int | None:
    try:
        return process.wait(timeout=2)
    except Exception:
        return None
