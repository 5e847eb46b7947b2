"""Timing shared by the benchmarks: steady-state host calls, after one warm-up call."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def time_calls(call: Callable[[], object], calls: int,
               after: Callable[[], None] = lambda: None) -> list[float]:
    """Seconds of `calls` calls after one warm-up call; `after` runs after each timed one."""
    call()
    seconds = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - start)
        after()
    return seconds


def median_rate(call: Callable[[], object], images: int, calls: int) -> tuple[float, float]:
    """(median images/s over `calls` calls after one warm-up call, last call's seconds)."""
    seconds = time_calls(call, calls)
    return images / statistics.median(seconds), seconds[-1]
