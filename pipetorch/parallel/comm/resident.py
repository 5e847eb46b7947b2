"""Resident memory (RSS) of a process and of its whole tree, read from /proc (Linux)."""
from __future__ import annotations

import ctypes
import os

__all__: list[str] = []

_PROC = "/proc"


def _status_bytes(pid: int, key: str) -> int | None:
    """A `key:  N kB` line of /proc/PID/status in bytes; None when unreadable."""
    try:
        with open(f"{_PROC}/{pid}/status") as status:
            for line in status:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def rss(pid: int) -> int | None:
    """The process's resident bytes now (VmRSS), None when unreadable."""
    return _status_bytes(pid, "VmRSS")


def peak_rss(pid: int | None = None) -> int | None:
    """The process's resident high-water mark (VmHWM) in bytes, None off Linux."""
    return _status_bytes(os.getpid() if pid is None else pid, "VmHWM")


def reset_peak_rss() -> bool:
    """Start a new VmHWM period for this process (writes 5 to clear_refs); False when the
    kernel refuses (the peak then covers the process's life)."""
    try:
        with open(f"{_PROC}/self/clear_refs", "w") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


def give_back_freed() -> None:
    """Return this process's freed heap memory to the system now (glibc's malloc_trim;
    nothing elsewhere): freed tensors below malloc's mmap threshold otherwise stay resident."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
