"""Models, options and process checks shared by the fault, cleanup and trace tests.

Run as a script (`python fault_cases.py SCENARIO`) it plays a user's program in its own
interpreter, so a test can watch what the program's exit, death or Ctrl-C does to the stage
workers. Each scenario prints one JSON line {"host": pid, "pids": [...], "folder": ...} once
its workers run, then:
    exit       returns without destroy() (the interpreter's exit must stop the workers)
    linger     (an inferenceModel) sleeps until killed (the test SIGKILLs it)
    interrupt  prints "calling", runs calls of several seconds each (for up to 60 s) that the
               test interrupts with SIGINT, then prints {"interrupted": ..., "alive": [...]}
               and exits
"""
from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
import torch
import torch.nn as nn

import pipetorch as poptorch
from pipetorch.parallel.layout import placement

VOCAB = 10
CLASSES = 3
# A HeavyNet(depth=LONG_DEPTH) call of LONG_D x G=4 x B=32 samples lasts several seconds;
# the tests that use it kill or interrupt it once its last stage computes.
LONG_D, LONG_DEPTH = 100, 8


class TokenNet(nn.Module):
    """An embedding and a layer on ipu 0; the head and the loss on ipu 1."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, CLASSES)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor):
        with poptorch.Block(ipu_id=0):
            x = torch.relu(self.fc1(self.embed(tokens).mean(1)))
        with poptorch.Block(ipu_id=1):
            out = self.fc2(x)
            loss = nn.functional.cross_entropy(out, labels)
        return out, loss


def token_data(n: int, *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """n rows of 5 valid token ids and n valid labels."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (n, 5), generator=g)
    return tokens, torch.randint(0, CLASSES, (n,), generator=g)


class HeavyNet(nn.Module):
    """`depth` square layers per stage, wide enough that a forward takes milliseconds."""

    def __init__(self, width: int = 384, depth: int = 3) -> None:
        super().__init__()
        self.first = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])
        self.second = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])
        self.head = nn.Linear(width, CLASSES)

    def forward(self, x: torch.Tensor, labels: torch.Tensor):
        with poptorch.Block("S0", ipu_id=0):
            x = torch.tanh(self.first(x))
        with poptorch.Block("S1", ipu_id=1):
            out = self.head(torch.tanh(self.second(x)))
            loss = nn.functional.cross_entropy(out, labels)
        return out, loss


def heavy_data(n: int, *, width: int = 384, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, width, generator=g), torch.randint(0, CLASSES, (n,), generator=g)


def options(*, D: int = 1, G: int = 4, R: int = 1, mode: str = "All",
            sharded: bool = False) -> poptorch.Options:
    """Training options; two stages need G >= 3 when pipelined."""
    opts = poptorch.Options().deviceIterations(D).replicationFactor(R)
    opts.Training.gradientAccumulation(G)
    opts.outputMode(getattr(poptorch.OutputMode, mode))
    if sharded:
        opts.setExecutionStrategy(poptorch.ShardedExecution(poptorch.AutoStage.SameAsIpu))
    return opts.showCompilationProgressBar(False)


# -- processes -----------------------------------------------------------------------------
alive = placement.running  # a zombie (dead, not yet reaped) counts as gone


def wait_gone(pids: list[int], *, timeout: float = 5.0) -> list[int]:
    """The pids still alive after waiting up to `timeout` seconds for them to go."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in pids if alive(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def cpu_ticks(pid: int) -> int:
    """CPU time (clock ticks, user + system) that `pid` has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def wait_busy(pid: int, *, ticks: int = 20, timeout: float = 30.0) -> None:
    """Wait until `pid` has computed for `ticks` more clock ticks (0.2 s at 100 Hz): a stage
    worker that computes is inside a call, whose inputs the host has all sent."""
    base = cpu_ticks(pid)
    deadline = time.monotonic() + timeout
    while cpu_ticks(pid) - base < ticks:
        if time.monotonic() > deadline:
            raise AssertionError(f"worker {pid} did not compute within {timeout}s")
        time.sleep(0.02)


def memory_files() -> set[int]:
    """The inodes of the shared memory files (pipetorch/memfd.py, not the weights' file,
    which the host's parameters may keep mapped) this process holds open or mapped."""
    name = "/memfd:pipetorch (deleted)"
    held = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == name:
                held.add(os.stat(f"/proc/self/fd/{fd}").st_ino)
        except OSError:  # the listing's own descriptor, closed by now
            pass
    with open("/proc/self/maps") as maps:
        held |= {int(line.split()[4]) for line in maps if line.rstrip().endswith(name)}
    return held


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _links(pid: str) -> list[str]:
    """What the open descriptors of `pid` point at; one closed while it is read is skipped (a
    busy process, such as another test worker, opens and closes them all the time)."""
    links = []
    try:
        descriptors = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return links
    for fd in descriptors:
        try:
            links.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass
    return links


def _held_by_live_processes(names: set[str]) -> set[str]:
    """Those of `names` that a running process has open or mapped."""
    held = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as f:
                maps = f.read()
        except OSError:  # ended, or not ours to read
            maps = ""
        links = _links(pid)
        held |= {n for n in names if f"/dev/shm/{n}" in maps
                 or any(link.startswith(f"/dev/shm/{n}") for link in links)}
    return held


def new_shm_entries(before: set[str], patience: float = 3.0) -> set[str]:
    """Entries in /dev/shm that were not in `before`, stay for `patience` seconds and no running
    process holds: called once this test's processes have ended, so they are what it leaked
    (other programs, and the other test workers, make and hold entries of their own; a
    semaphore of a process that was killed lasts until its resource tracker removes it)."""
    deadline = time.monotonic() + patience
    while True:
        lasting = shm_entries() - before
        lasting -= _held_by_live_processes(lasting)
        if not lasting or time.monotonic() > deadline:
            return lasting
        time.sleep(0.1)


def script_env(registry: str) -> dict[str, str]:
    """Environment for a scenario subprocess: tests/ importable, a private worker registry."""
    env = dict(os.environ)
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (tests, env.get("PYTHONPATH", "")) if p)
    env["PIPETORCH_REGISTRY"] = registry
    env.setdefault("PIPETORCH_DEVICE", "cpu")
    env.setdefault("PIPETORCH_TIMEOUT", "60")
    return env


@pytest.fixture
def registry(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    """A private worker registry: workers started by this test register there."""
    folder = str(tmp_path / "registry")
    monkeypatch.setenv("PIPETORCH_REGISTRY", folder)
    return folder


def records_of(host_pid: int) -> list[dict[str, Any]]:
    """Live registry records of workers started by `host_pid`."""
    from pipetorch.parallel.layout import placement

    return [r for r in placement.live_workers() if r["host_pid"] == host_pid]


def wait_no_records(host_pid: int, *, timeout: float = 5.0) -> list[dict[str, Any]]:
    """Registry records of `host_pid`'s workers still listed as live after up to `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        left = records_of(host_pid)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


class Script:
    """A scenario of this file running in its own interpreter (and process group)."""

    def __init__(self, scenario: str, registry: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), scenario], env=script_env(registry),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        self._buffer = b""
        self.lines: list[str] = []

    def line(self, *, timeout: float = 60.0, prefix: str = "") -> str:
        """The next stdout line starting with `prefix` (others, like log lines, are kept)."""
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(self.process.stdout, selectors.EVENT_READ)  # type: ignore[arg-type]
            while True:
                while b"\n" in self._buffer:
                    raw, self._buffer = self._buffer.split(b"\n", 1)
                    text = raw.decode(errors="replace")
                    self.lines.append(text)
                    if text.startswith(prefix):
                        return text
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    raise AssertionError(f"no line starting with {prefix!r} within {timeout}s; "
                                         "output so far:\n" + "\n".join(self.lines))
                chunk = os.read(self.process.stdout.fileno(), 65536)  # type: ignore[union-attr]
                if not chunk:
                    raise AssertionError(
                        f"the script ended (exit {self.process.wait()}) before a line "
                        f"starting with {prefix!r}:\n" + "\n".join(self.lines))
                self._buffer += chunk

    def json(self, prefix: str, *, timeout: float = 60.0) -> dict[str, Any]:
        return json.loads(self.line(prefix=prefix, timeout=timeout))

    def finish(self, *, timeout: float = 30.0) -> int:
        """Wait for the script to end (killing it and its group after `timeout`)."""
        try:
            out, _ = self.process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            out, _ = self.process.communicate()
        self.lines += (self._buffer + out).decode(errors="replace").splitlines()
        self._buffer = b""
        return self.process.returncode

    def kill(self) -> None:
        """SIGKILL the script's whole process group if anything of it still runs (teardown)."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()

    def output(self) -> str:
        return "\n".join(self.lines)


def _wrapper_for(name: str) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """The scenario's wrapper, with its workers started, and one call's inputs."""
    torch.manual_seed(0)
    if name == "interrupt":
        model = HeavyNet(depth=LONG_DEPTH)
        x, y = heavy_data(LONG_D * 4 * 32)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        wrapper = poptorch.trainingModel(model, options(D=LONG_D, G=4), optimizer=optimizer)
        wrapper.compile(x, y)
        return wrapper, x, y
    model = TokenNet()
    x, y = token_data(8)
    if name == "linger":  # an inferenceModel: its workers start faster
        wrapper = poptorch.inferenceModel(model, options(D=2, G=1))
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        wrapper = poptorch.trainingModel(model, options(G=4), optimizer=optimizer)
    wrapper(x, y)
    return wrapper, x, y


def _terminal_ctrl_c() -> str:
    """Give this program Ctrl-C as in a terminal: Python's KeyboardInterrupt handler, SIGINT
    not blocked. A test runner may pass SIGINT on ignored or blocked (both survive exec);
    returns what was inherited, for the test's messages."""
    inherited = f"handler {signal.getsignal(signal.SIGINT)!r}, blocked " \
                f"{signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])}"
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
    return inherited


def _scenario(name: str) -> None:
    inherited = _terminal_ctrl_c()
    wrapper, x, y = _wrapper_for(name)
    engine = wrapper._compiled.engine
    pids = list(engine.worker_pids)
    print(json.dumps({"host": os.getpid(), "pids": pids, "folder": engine.workers.folder,
                      "sigint": inherited}), flush=True)
    if name == "exit":
        return
    if name == "linger":
        time.sleep(600)
        return
    assert name == "interrupt", name
    print("calling", flush=True)
    start = time.monotonic()
    try:
        # Calls of several seconds each, until interrupted: on a loaded machine the signal may
        # come after the first call has ended.
        while time.monotonic() - start < 60.0:
            wrapper(x, y)
        report = {"interrupted": False}
    except KeyboardInterrupt:
        report = {"interrupted": True}
    report["seconds"] = time.monotonic() - start
    report["alive"] = [p for p in pids if alive(p)]
    print(json.dumps(report), flush=True)
    wrapper.destroy()


if __name__ == "__main__":
    _scenario(sys.argv[1])
