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


# glibc's mallopt parameters, and the values a worker sets
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
# glibc's largest on 64 bits: a larger block is still mapped apart (and unmapped when freed)
MMAP_THRESHOLD = 32 << 20
_TRIM_THRESHOLD = 1 << 30


def reuse_freed() -> None:
    """Keep this process's freed heap memory for its next allocations instead of handing it
    back to the system at each free (glibc's mallopt; nothing elsewhere, nor where the user set
    MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_). A stage's gradients and activations are
    freed and allocated again every micro-batch: with glibc's defaults each time is fresh pages
    that the kernel faults in and zeroes. At width 2048 a stage worker took 35,000 page faults
    a call and a quarter more CPU than the same work without them (2026-12-07). The peak is the
    same: what is kept was in use before; `give_back_freed` still returns it when asked."""
    if any(f"MALLOC_{name}_" in os.environ for name in ("MMAP_THRESHOLD", "TRIM_THRESHOLD")):
        return
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
        libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)
    except (OSError, AttributeError):
        pass


def give_back_freed() -> None:
    """Return this process's freed heap memory to the system now (glibc's malloc_trim;
    nothing elsewhere): freed tensors below malloc's mmap threshold otherwise stay resident."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
