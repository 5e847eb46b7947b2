"""Pre-started workers: a warm zygote process forks the stage workers.

Starting a worker as a fresh interpreter costs seconds (importing torch, torch.distributed and
torch._dynamo). Instead, the first multi-process wrapper of a user process starts one zygote
(`python -m pipetorch.parallel.host.pool FD`) that imports all of that once, runs no tensor op (so
no OpenMP or intra-op thread pool exists to be broken by fork) and stays single-threaded.
Each stage worker is then a fork of the zygote, ready in milliseconds; the zygote serves every
later wrapper of the process too.

    user process --- ("fork", env, cwd, path, libraries) + a socket --->  zygote
                 <-- ("ok", pid) -------------------------------------   | import, fork
                 <================ the worker's socket ================> worker.main

Guarantees, as for fresh workers: no `__main__` guard (the zygote is exec'd, not forked from
the user's process); the model's installed libraries (`preload.libraries`: `transformers` for a
HuggingFace model) are imported in the zygote before the fork, once for all its workers and
wrappers, as torch is; the zygote exits when the user's process does (it polls its parent) or
closes its end of the socket; a worker exits when the user's process does (it holds a pidfd
of the user's process, inherited from the zygote), not when the zygote does. The zygote reaps
its children and tells the host their exit status. `PIPETORCH_WORKER_POOL=early` starts the
zygote at `import pipetorch` (its imports then overlap the user's); `PIPETORCH_WORKER_POOL=0`
starts every worker as a fresh process instead.
"""
from __future__ import annotations

import atexit
import importlib
import logging
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any, Sequence, Union

from pipetorch import environment
from pipetorch.errors import DeviceError

__all__: list[str] = []

logger = logging.getLogger(__name__)

_PERIOD = 0.25     # seconds between the zygote's checks that the user's process is there
_MESSAGE = 1 << 20  # the largest request or reply (a seqpacket datagram)
UNKNOWN_EXIT = 255  # exit status of a worker whose zygote died before telling it

# What the host asks the zygote: ("fork", (environment, cwd, sys.path, libraries)),
# ("threads", None), ("status", pid)
Fork = tuple[dict[str, str], str, list[str], tuple[str, ...]]
Request = tuple[str, Union[Fork, int, None]]


def enabled() -> bool:
    """$PIPETORCH_WORKER_POOL: 1 (default) forks workers from the zygote, started by the first
    multi-process wrapper; early starts it at `import pipetorch`; 0 starts workers fresh."""
    return environment.get("worker_pool") != "0"


def worker_env() -> dict[str, str]:
    """The user's environment, with every sys.path entry on PYTHONPATH (for the stages' code)."""
    env = dict(os.environ)
    paths = [p for p in sys.path if p] + env.get("PYTHONPATH", "").split(os.pathsep)
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if p))
    return env


def python_command(*args: str) -> list[str]:
    """This Python run with `args` (`-m module ...`, `-c code ...`) as a new worker, zygote or
    probe, without the current folder first on its import path (-P, Python 3.11 on), where a
    folder named like a module (a `pipetorch` checkout, a script's `copy.py`) would take the
    place of the one the user's process imported; the user's import path comes through
    PYTHONPATH (worker_env)."""
    safe = ["-P"] if sys.version_info >= (3, 11) else []
    return [sys.executable, *safe, *args]


# Variables a tool changes at every step of its own and no import reads: pytest names the test
# running in PYTEST_CURRENT_TEST, so a zygote restarted on its change would start afresh for
# every test of a user's suite (seconds each) though its imports saw nothing new.
_PER_STEP = frozenset({"PYTEST_CURRENT_TEST"})


def _imported_at_start(env: dict[str, str]) -> dict[str, str]:
    """The variables a zygote cannot take on after its imports: all but pipetorch's own (read
    when used), PYTHONPATH (a worker takes the user's sys.path as it is when forked) and those
    of _PER_STEP (a worker gets their value of the moment with the rest of the environment)."""
    return {k: v for k, v in env.items()
            if not k.startswith("PIPETORCH_") and k != "PYTHONPATH" and k not in _PER_STEP}


class PooledProcess:
    """A forked worker, with the part of subprocess.Popen the engine uses: pid, poll, kill,
    wait. Watched through a pidfd (never a reused pid); its exit status comes from the zygote."""

    def __init__(self, pid: int, zygote: Zygote) -> None:
        self.pid, self._zygote = pid, zygote
        self.returncode: int | None = None
        self._fd: int | None = os.pidfd_open(pid)

    def poll(self) -> int | None:
        if self.returncode is None and self._fd is not None and _readable(self._fd, 0.0):
            status = self._zygote.exit_status(self.pid)
            self.returncode = UNKNOWN_EXIT if status is None else status
            os.close(self._fd)
            self._fd = None
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self._fd is not None and not _readable(self._fd, timeout):
            raise subprocess.TimeoutExpired(f"stage worker {self.pid}", timeout or 0.0)
        code = self.poll()
        assert code is not None
        return code

    def kill(self) -> None:
        if self._fd is not None:
            try:
                signal.pidfd_send_signal(self._fd, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def __del__(self) -> None:
        if self._fd is not None:
            os.close(self._fd)


def _readable(fd: int, timeout: float | None) -> bool:
    return bool(select.select([fd], [], [], timeout)[0])


class Zygote:
    """The host's handle on its zygote process: forks workers, reports their exit status."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.env = worker_env()
        try:  # (not "early" in there: its `import pipetorch` must not start another zygote)
            self.process = subprocess.Popen(
                python_command("-m", "pipetorch.parallel.host.pool", str(theirs.fileno())),
                pass_fds=(theirs.fileno(),), env=self.env | {"PIPETORCH_WORKER_POOL": "1"},
                stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        self.sock = ours
        self.lock = threading.Lock()
        self.threads: int | None = None  # the zygote's thread count when it was ready

    def alive(self) -> bool:
        return self.process.poll() is None

    def fork(self, timeout: float, libraries: tuple[str, ...] = ()) -> tuple[Connection,
                                                                              PooledProcess]:
        """A new worker, connected to the returned end of a socket pair; the zygote imports
        `libraries` first (those it has not yet)."""
        ours, theirs = socket.socketpair()
        try:
            request = ("fork", (worker_env(), os.getcwd(), list(sys.path), libraries))
            pid = self._ask(request, timeout, fds=[theirs.fileno()])
        finally:
            theirs.close()
        return Connection(ours.detach()), PooledProcess(pid, self)

    def thread_count(self, timeout: float) -> int:
        """The most threads the zygote had as it forked (or now, before its first fork): those
        its imports make (OpenBLAS's, which OpenBLAS stops for a fork), no intra-op pool."""
        return self._ask(("threads", None), timeout)

    def exit_status(self, pid: int) -> int | None:
        """How worker `pid` (exited) ended, as a Popen returncode; None if nobody can tell."""
        try:
            return self._ask(("status", pid), timeout=5.0)
        except DeviceError:
            return None

    def _ask(self, request: Request, timeout: float, fds: Sequence[int] = ()) -> Any:
        with self.lock:
            try:
                socket.send_fds(self.sock, [pickle.dumps(request)], list(fds))
                deadline = time.monotonic() + timeout
                while not _readable(self.sock.fileno(), _PERIOD):
                    if not self.alive() or time.monotonic() > deadline:
                        break
                else:
                    reply = self.sock.recv(_MESSAGE)
                    if reply:
                        kind, value = pickle.loads(reply)
                        if kind == "ok":
                            return value
                        raise DeviceError(f"The worker pool process (pid {self.process.pid}) "
                                          f"could not start a stage worker: {value}")
            except OSError:
                pass
        if not self.alive():
            raise DeviceError(
                f"The worker pool process (pid {self.process.pid}) died (exit code "
                f"{self.process.returncode}) while starting stage workers; the next wrapper "
                "starts a new one. Set PIPETORCH_WORKER_POOL=0 to start workers as fresh processes")
        raise DeviceError(
            f"The worker pool process (pid {self.process.pid}) did not answer within "
            f"{timeout:.0f}s; raise PIPETORCH_TIMEOUT if this machine is very slow, or set "
            "PIPETORCH_WORKER_POOL=0")

    def close(self) -> None:
        """Stop the zygote (its workers live on until their wrappers stop them)."""
        self.sock.close()  # the zygote's end reads EOF and exits
        try:
            self.process.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5.0)


_zygote: Zygote | None = None
_zygote_lock = threading.Lock()


def zygote() -> Zygote:
    """This process's zygote, started (again) if there is none, it died, or the environment
    it imported torch under has changed."""
    global _zygote
    with _zygote_lock:
        if _zygote is not None:
            now, then = worker_env(), _imported_at_start(_zygote.env)
            # changed or removed; added ones (torch sets TORCHINDUCTOR_CACHE_DIR) reach the
            # workers with the rest of the environment
            stale = any(now.get(k) != v for k, v in then.items())
            if not _zygote.alive() or stale:
                if not _zygote.alive():
                    logger.warning("The worker pool process (pid %d) has exited (code %s): "
                                   "starting a new one", _zygote.process.pid,
                                   _zygote.process.returncode)
                _zygote.close()
                _zygote = None
        if _zygote is None:
            _zygote = Zygote()
        return _zygote


def prestart() -> None:
    """Start the zygote now (if the pool is on), so its imports overlap the host's work."""
    if enabled():
        zygote()


def start_worker(timeout: float, libraries: tuple[str, ...]) -> tuple[Connection, PooledProcess]:
    """A worker forked from this process's zygote, once it has imported `libraries`."""
    return zygote().fork(timeout, libraries)


@atexit.register
def shutdown() -> None:
    """Stop this process's zygote (at exit; the zygote also notices its parent going)."""
    global _zygote
    with _zygote_lock:
        if _zygote is not None:
            _zygote.close()
            _zygote = None


# -- the zygote process -----------------------------------------------------------------------
def _warm() -> None:
    """Import everything a worker needs (running no tensor op: no intra-op thread pool may
    exist when this process forks)."""
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401 - torch.optim imports it on the first step
    import torch.distributed  # noqa: F401
    import torch.optim  # noqa: F401

    import pipetorch.parallel.worker.serve  # noqa: F401


def _import(libraries: tuple[str, ...], path: list[str]) -> None:
    """Import the model's libraries a worker would import itself, from the user's import
    path; one that fails is left for the worker, which then raises the error where the user
    sees it."""
    own = sys.path[:]
    sys.path[:] = path
    try:
        for name in libraries:
            if name not in sys.modules:
                try:
                    importlib.import_module(name)
                except Exception:  # noqa: BLE001 - the worker's own import reports it
                    pass
    finally:
        sys.path[:] = own


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


_most_threads = 0  # in the zygote: the most threads it had as it forked


def _reap(statuses: dict[int, int]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        statuses[pid] = os.waitstatus_to_exitcode(status)


def _fork(conn_fd: int, env: dict[str, str], cwd: str, path: list[str],
          libraries: tuple[str, ...], *, host: int, sock: socket.socket) -> int:
    global _most_threads
    _import(libraries, path)
    _most_threads = max(_most_threads, _threads())
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:  # the worker: the user's current environment, folder and import path
        sock.close()
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        sys.path[:] = path
        from pipetorch.parallel.worker import serve as worker

        worker.main(Connection(conn_fd), host=host)
        code = 0
    except BaseException:  # noqa: BLE001 - reported on stderr, as a fresh worker would
        traceback.print_exc()
    finally:
        os._exit(code)


def serve(sock: socket.socket) -> None:
    """The zygote: fork a worker per request, until the user's process goes away."""
    parent = os.getppid()
    host = os.pidfd_open(parent)  # inherited by the workers: they watch the user's process
    if os.getppid() != parent:
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the host's to handle
    _warm()
    statuses: dict[int, int] = {}
    while os.getppid() == parent:
        _reap(statuses)
        if not _readable(sock.fileno(), _PERIOD):
            continue
        data, fds, _, _ = socket.recv_fds(sock, _MESSAGE, 4)
        if not data:
            return  # the host closed its end
        kind, payload = pickle.loads(data)
        try:
            if kind == "fork":
                reply: Any = ("ok", _fork(fds[0], *payload, host=host, sock=sock))
            elif kind == "threads":
                reply = ("ok", max(_most_threads, _threads()))
            else:
                _reap(statuses)
                reply = ("ok", statuses.pop(payload, None))
        except Exception as exc:  # noqa: BLE001 - the host raises it
            reply = ("error", f"{type(exc).__name__}: {exc}")
        finally:
            for fd in fds:
                os.close(fd)
        sock.send(pickle.dumps(reply))


if __name__ == "__main__":
    # python -m pipetorch.parallel.host.pool FD: FD is this end of a seqpacket socket pair.
    serve(socket.socket(fileno=int(sys.argv[1])))
