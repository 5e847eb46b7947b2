"""Resident memory of a whole process tree, sampled while a benchmark runs: the sum of every
process's RSS and of its Pss (a page shared by n processes counts 1/n in each), per phase.
benchmarks/memory.py measures with it (tests/test_benchmark_memory.py checks it); the library
itself reads only its own process's memory (pipetorch.parallel.comm.resident)."""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

from pipetorch.parallel.comm.resident import rss

_PROC = "/proc"


def pss(pid: int) -> int | None:
    """The process's proportional share of resident memory (Pss: a page shared by n
    processes counts 1/n in each), None when unreadable; a tree's sum of these is what it
    occupies, where a sum of RSS counts shared pages (libraries, shared memory) repeatedly."""
    try:
        with open(f"{_PROC}/{pid}/smaps_rollup") as rollup:
            for line in rollup:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir(_PROC)
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"{_PROC}/{entry}/stat") as stat:
                # the parent is the 2nd field after the parenthesised command name
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


@dataclass
class TreePeaks:
    """Peak resident bytes seen, per phase: the whole tree (sum of RSS, and of Pss), the root,
    each descendant."""

    tree: dict[str, int] = field(default_factory=dict)
    tree_pss: dict[str, int] = field(default_factory=dict)  # the tree's sum of Pss
    root: dict[str, int] = field(default_factory=dict)
    processes: dict[str, dict[int, int]] = field(default_factory=dict)


class TreeSampler:
    """A thread that samples the RSS of `pid` and its descendants every `interval` seconds,
    keeping the peaks of the phase set last (`phase(name)`); with `shares`, their Pss too
    (smaps_rollup walks every page: on a loaded CPU it slows what it measures)."""

    def __init__(self, pid: int | None = None, *, interval: float = 0.1,
                 shares: bool = True) -> None:
        self.pid = os.getpid() if pid is None else pid
        self.interval, self.shares = interval, shares
        self.peaks = TreePeaks()
        self._phase = "start"
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="rss-sampler", daemon=True)

    def __enter__(self) -> TreeSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        self.sample()

    def phase(self, name: str) -> None:
        """Sample once (closing the phase before), then attribute samples to `name`."""
        self.sample()
        with self._lock:
            self._phase = name
        self.sample()

    def sample(self) -> None:
        sizes = {p: rss(p) for p in [self.pid, *descendants(self.pid)]}
        live = {p: s for p, s in sizes.items() if s is not None}
        shares = sum(pss(p) or 0 for p in live) if self.shares else 0
        with self._lock:
            phase, peaks = self._phase, self.peaks
            peaks.tree[phase] = max(peaks.tree.get(phase, 0), sum(live.values()))
            peaks.tree_pss[phase] = max(peaks.tree_pss.get(phase, 0), shares)
            peaks.root[phase] = max(peaks.root.get(phase, 0), live.get(self.pid, 0))
            own = peaks.processes.setdefault(phase, {})
            for p, s in live.items():
                if p != self.pid:
                    own[p] = max(own.get(p, 0), s)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()
