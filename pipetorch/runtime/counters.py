"""PopTorch's performance counters (`getPerfCounters`, `getLatency`) from a call's timings.

A PopTorch call streams each device iteration's inputs and outputs separately, and the IPU
stamps each transfer. pipetorch moves a call's inputs to its devices at once, runs every
iteration, then returns every output at once, so each iteration carries the call's four
stamps: inputs requested, inputs on the device, outputs requested, outputs on the host
(`time.perf_counter()` seconds: differences are meaningful, the origin is not).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

__all__: list[str] = []

EVENTS = ("input", "input_complete", "output", "output_complete")


@dataclass
class CallTimes:
    """The four stamps of one host call, in `time.perf_counter()` seconds."""

    input: float = field(default_factory=time.perf_counter)
    input_complete: float = 0.0
    output: float = 0.0
    output_complete: float = 0.0

    def stamp(self, event: str) -> None:
        setattr(self, event, time.perf_counter())


def perf_counters(times: CallTimes | None, *, inputs: int, outputs: int,
                  iterations: int) -> dict[str, list[list[float]]]:
    """{event: [per input (or output) index: [per iteration: seconds]]}, as PopTorch's."""
    if times is None:
        return {event: [] for event in EVENTS}
    counts = {"input": inputs, "input_complete": inputs, "output": outputs,
              "output_complete": outputs}
    return {event: [[getattr(times, event)] * iterations for _ in range(counts[event])]
            for event in EVENTS}


def latency(times: CallTimes | None) -> tuple[float, float, float]:
    """(min, max, mean) seconds from an input's request to its output's arrival; every
    iteration of a call has the call's latency. (0, 0, 0) before any call."""
    if times is None:
        return 0.0, 0.0, 0.0
    value = times.output_complete - times.input
    return value, value, value
