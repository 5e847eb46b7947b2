"""The worker processes of one engine and their pipes: start, send and gather, failure, Ctrl-C,
shutdown. Every other part of the engine talks to the workers through a WorkerSet."""
from __future__ import annotations

import logging
import re
import shutil
import socket
import subprocess
import tempfile
import weakref
from multiprocessing.connection import Connection
from typing import Callable, TypeVar

from pipetorch import environment
from pipetorch.errors import DeviceError
from pipetorch.parallel.comm import exits, stream, wire
from pipetorch.parallel.host import host_link, pool
from pipetorch.parallel.comm import messages as m
from pipetorch.parallel.host.pipeline import Current
from pipetorch.parallel.layout import placement as places
from pipetorch.schedule.plans import Batching
from pipetorch.partition.split import StagedModel
from pipetorch.tracebacks import HINTS, error_kind, user_line_in

__all__: list[str] = []

logger = logging.getLogger(__name__)

_STOP_GRACE = 5.0  # seconds a worker gets to stop before it is killed
_T = TypeVar("_T")


class WorkerSet:
    """One worker process per logical device and replica, ordered replica-major as
    the pipeline's placements: `peers[r * devices + d]` is device d of replica r.

    `lost` says why the workers are gone; `on_loss` runs before a failure stops them (the
    engine restores the host copy from the workers' files then)."""

    def __init__(self, pipeline: Current, *, num_processes: int, timeout: float,
                 batching: Batching, libraries: tuple[str, ...] = ()) -> None:
        self.pipeline = pipeline  # its placements; its stages name where a failure happened
        self.libraries = libraries  # what the zygote imports for them (preload.libraries)
        self.replicas = pipeline.now.replicas
        self.devices = len(pipeline.now.placements) // self.replicas  # workers per replica
        self.num_processes, self.timeout = num_processes, timeout
        self.batching = batching
        self.lost: str | None = None
        self.interrupted = False  # Ctrl-C stopped the workers; the next use starts new ones
        self.on_loss: Callable[[], None] = lambda: None
        # the pipeline's other host processes (Distributed.stagesAcrossProcesses), else None
        self.link: host_link.HostLink | None = None
        self.folder = tempfile.mkdtemp(prefix="pipetorch-")
        self.peers: list[wire.Peer] = []
        self._finalizer = weakref.finalize(self, _shutdown, self.peers, self.folder)

    def start(self) -> None:
        """A worker per placement: forked from the pool's warm zygote, or a fresh process
        with the pool off."""
        environment.get("worker_nice")  # read by each worker: a bad value fails here, at once
        for placement in self.pipeline.now.placements:
            process: wire.Process
            if pool.enabled():
                conn, process = pool.start_worker(self.timeout, self.libraries)
            else:
                ours, theirs = socket.socketpair()
                try:
                    process = subprocess.Popen(
                        pool.python_command("-m", "pipetorch.parallel.worker.serve",
                                            str(theirs.fileno())),
                        pass_fds=(theirs.fileno(),), env=pool.worker_env(),
                        stdin=subprocess.DEVNULL)
                finally:
                    theirs.close()
                conn = Connection(ours.detach())
            self.peers.append(wire.Peer(placement.stages, placement.device, conn, process,
                                        placement.replica, self.replicas, exits.oom_kills()))

    def revived(self) -> bool:
        """After Ctrl-C stopped a call: True once, when new workers must be launched."""
        if not self.interrupted:
            return False
        self.lost, self.interrupted = None, False
        return True

    @property
    def worker_pids(self) -> list[int]:
        return [p.process.pid for p in self.peers]

    @property
    def first_replica(self) -> list[wire.Peer]:
        """Replica 0's workers, by device: the replicas hold the same weights."""
        return self.peers[:self.devices]

    def check_alive(self) -> None:
        if self.lost:
            raise DeviceError(
                f"The stage workers were lost ({self.lost}); this wrapper cannot run again: "
                "call destroy() and build a new trainingModel/inferenceModel. The model keeps "
                "the weights of the last copy to the host")

    def send(self, peer: wire.Peer, message: m.Message | stream.Encoded, *,
             share: frozenset[int] = frozenset()) -> None:
        """Send `message` (`share`: the live weights the worker maps, see wire.send)."""
        try:
            wire.send(peer.conn, message, shared=share)
        except OSError as exc:
            self.fail(wire.unreachable(peer, exc))
            self.check_alive()

    def broadcast(self, message: m.Message, what: str,
                  peers: list[wire.Peer] | None = None) -> list[object]:
        """Send every worker (or `peers`) `message`; their replies, in order."""
        for peer in self.peers if peers is None else peers:
            self.send(peer, message)
        return self.gather(what, peers)

    def gather(self, what: str, peers: list[wire.Peer] | None = None, *,
               transfers: list[wire.Transfer] | None = None) -> list[object]:
        """One reply from every worker (or `peers`); a failure stops them all."""
        self.check_alive()
        try:
            return wire.gather(self.peers if peers is None else peers, timeout=self.timeout,
                               what=what, transfers=transfers)
        except wire.WorkerFailed as exc:
            message = self.describe(exc.failure) if exc.failure else str(exc)
            if self.link is not None:  # a peer process that ended is the cause, if one did
                first, newline, rest = message.partition("\n")
                gone = self.link.departed()
                message = (f"On {self.link.name}: {gone + '. Here: ' if gone else ''}{first} "
                           f"(this pipeline runs {self.link.layout.layout()}){newline}{rest}")
            self.fail(message.splitlines()[0])
            raise wire.WorkerFailed(message, exc.failure) from None
        except KeyboardInterrupt:
            self.interrupt()
            raise
        except BaseException:  # SystemExit: stop the workers before giving up
            self.fail("interrupted")
            raise

    def receive(self, peer: wire.Peer, what: str) -> object:
        """One message that follows a reply from `peer` (its death or silence fails the
        engine, as in gather)."""
        try:
            return wire.receive(peer.conn, timeout=self.timeout)
        except (EOFError, OSError, TimeoutError) as exc:
            self.fail(f"the worker running {peer.describe()} stopped during {what} ({exc})")
            raise wire.WorkerFailed(f"The worker running {peer.describe()} stopped during "
                                    f"{what}: {exc}") from None

    def interrupt(self) -> None:
        """Ctrl-C during a call: stop the workers now and discard the call. With one host
        process the next use starts new workers from the last completed call's state; with
        several, the others' workers wait for this one's, so it cannot restart alone."""
        if self.lost is not None:
            return
        if self.num_processes > 1:
            self.fail(f"interrupted by Ctrl-C; with {self.num_processes} host processes this "
                      "one cannot restart its workers alone, as the other processes' workers "
                      "exchange gradients with them")
            return
        self.on_loss()  # before the workers and their files go
        self.lost, self.interrupted = "interrupted by Ctrl-C", True
        self.stop(grace=0.0, remove=False)

    def fail(self, reason: str) -> None:
        if self.lost is None:
            self.on_loss()  # before the workers and their files go
        if self.link is not None:
            self.link.fail(reason)
        self.lost = reason
        self.stop(grace=0.0)

    def across(self, round_: Callable[[host_link.HostLink], _T]) -> _T:
        """A round with the pipeline's other host processes; their failure, death or silence,
        or rounds out of step, fail these workers too (different inputs do not: no call
        started)."""
        assert self.link is not None
        try:
            return round_(self.link)
        except DeviceError as exc:
            self.fail(str(exc).splitlines()[0])
            raise DeviceError(f"On {self.link.name}: {exc}") from None

    def stop(self, *, grace: float = _STOP_GRACE, remove: bool = True) -> None:
        """Stop the workers (`remove`: and their files); new ones may start later."""
        _shutdown(self.peers, self.folder, grace=grace, remove=remove)

    def close(self) -> None:
        """Stop the workers (killing any that do not stop) and remove their files; once."""
        self._finalizer()

    def describe(self, failure: wire.Failure) -> str:
        """A worker's exception as the user reads it: where in the schedule and the model."""
        where = "outside the schedule"
        if failure.action is not None:
            names = {"F": "the forward", "B": "the backward", "STEP": "the optimiser step"}
            what = names.get(failure.action, f"the transfer {failure.action}")
            where = f"in {what}"
            if failure.micro_batch is not None:
                micro = failure.micro_batch * self.replicas + failure.replica
                where += f" of micro-batch {micro} ({self._locate(micro)})"
        replica = f" of replica {failure.replica}" if self.replicas > 1 else ""
        return (f"Stage {failure.stage}{replica} on {failure.device} (pid {failure.pid}) failed "
                f"{where}: {failure.error}{_explained(failure, self.pipeline.now.staged)}"
                f"\n\nWorker traceback:\n{failure.traceback}")

    def _locate(self, micro: int) -> str:
        b = self.batching
        step, replica = divmod(micro, b.replication_factor)
        iteration, accumulation = divmod(step, b.gradient_accumulation)
        return f"device iteration {iteration}, accumulation step {accumulation}, replica {replica}"


def _explained(failure: wire.Failure, staged: StagedModel) -> str:
    """The user's line of the failing operation and, for torch's common failures (dtype,
    shape, target out of range), what to check; "" when neither is known."""
    source = _model_source(failure, staged)
    line = user_line_in(source) if source else user_line_in(failure.traceback)
    kind = error_kind(failure.error)
    hint = HINTS.get(kind) if kind is not None else None
    if hint is not None and failure.micro_batch is not None:
        hint += " (the failing samples are in the micro-batch named above)"
    return (f"\n  at {line}" if line else "") + (f"\n  {hint}" if hint else "")


# A line of a stage's generated forward, as a traceback shows it: `name = torch.ops...`.
_GENERATED = re.compile(r'File "<eval_with_key>[^"]*", line \d+, in \w+\n\s+(\w+) = ')


def _model_source(failure: wire.Failure, staged: StagedModel) -> str | None:
    """Where in the user's model the failing operation was traced from: a worker's
    traceback shows only the stage's generated code, whose line names the graph node; the
    host's copy of the graph keeps that node's stack trace (the model's source lines)."""
    names = _GENERATED.findall(failure.traceback)
    if not names or not 0 <= failure.stage < len(staged.modules):
        return None
    graph = getattr(staged.modules[failure.stage], "graph", None)
    node = next((n for n in graph.nodes if n.name == names[-1]), None) if graph else None
    return node.meta.get("stack_trace") if node is not None else None


def _shutdown(peers: list[wire.Peer], folder: str, *, grace: float = _STOP_GRACE,
              remove: bool = True) -> None:
    """Ask every live worker to stop, then kill whatever is left; idempotent."""
    live = [p for p in peers if p.process.poll() is None]
    if grace > 0 and live:
        try:
            for peer in live:
                wire.send(peer.conn, m.Stop())
            wire.gather(live, timeout=grace, what="shutdown")
        except Exception:
            pass
    for peer in peers:
        if peer.process.poll() is None:
            peer.process.kill()
        try:
            peer.process.wait(timeout=grace + 5.0)
        except subprocess.TimeoutExpired:
            logger.error("Worker pid %d did not exit after SIGKILL", peer.process.pid)
        places.unregister(peer.process.pid)
        peer.conn.close()
    peers.clear()
    if remove:
        shutil.rmtree(folder, ignore_errors=True)
