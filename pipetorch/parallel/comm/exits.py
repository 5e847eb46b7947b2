"""How a worker process ended, in words: the signal that killed it, the out-of-memory killer
(a SIGKILL while the kernel's count of OOM kills rose), or an exit code, never guessed.

A worker that raises sends its exception to the user's process (worker.main); one that ends
without a word is described here from its exit status alone.
"""
from __future__ import annotations

import signal

__all__: list[str] = []

_VMSTAT = "/proc/vmstat"
_CRASHES = {signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT}


def oom_kills() -> int | None:
    """The kernel's count of processes its out-of-memory killer has ended (None where the
    system does not say)."""
    try:
        with open(_VMSTAT) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == "oom_kill":
                    return int(value)
    except (OSError, ValueError):
        pass
    return None


def status(code: int | None) -> str:
    """"exit code 1", "exit code -9, killed by SIGKILL", "exit code unknown"."""
    if code is None:
        return "exit code unknown"
    if code < 0:
        try:
            return f"exit code {code}, killed by {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"exit code {code}"


def cause(code: int | None, oom_before: int | None, oom_now: int | None = None) -> str:
    """What ended a worker with exit status `code` (a Popen returncode): `oom_before` and
    `oom_now` are `oom_kills()` when it started and now."""
    if code is None:
        return "Its exit status is unknown (the process that started it could not tell)"
    if code >= 0:
        return ("It exited without reporting an error to this process: its standard error "
                "shows the cause" if code else "It exited without replying")
    try:
        sent = signal.Signals(-code)
    except ValueError:
        return f"It was ended by signal {-code}"
    if sent in _CRASHES:
        return (f"It crashed ({sent.name}) in native code (torch or an extension): its standard "
                "error shows where")
    if sent != signal.SIGKILL:
        return f"Another process or a user sent it {sent.name}"
    now = oom_kills() if oom_now is None else oom_now
    if oom_before is None or now is None:
        return ("The kernel's out-of-memory killer sends SIGKILL, as may another process; this "
                "system does not report its out-of-memory kills")
    if now > oom_before:
        return (f"The kernel's out-of-memory killer ended it (its count of kills rose from "
                f"{oom_before} to {now} since the worker started): the machine ran out of "
                "memory. Use smaller micro-batches, fewer replicas or more memory")
    return ("No out-of-memory kill happened since it started: another process or a user sent "
            "the signal")
