"""PopTorch's performance counters (`getPerfCounters`, the latencies) from a call's timings.

A PopTorch call streams each device iteration's inputs and outputs separately, and the IPU
stamps each transfer. pipetorch moves a call's inputs to its devices at once, runs every
iteration, then returns every output at once, so each iteration carries the call's four
stamps: inputs requested, inputs on the device, outputs requested, outputs on the host
(`time.perf_counter()` seconds: differences are meaningful, the origin is not). Latencies
are reduced from the counters as PopTorch reduces them.
"""
from __future__ import annotations

import logging
import os
import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from pipetorch.errors import ConfigError, IpuOnlyError, createPoptorchError
from pipetorch.losses import tensor_leaves
from pipetorch.runtime.batching import split_micro_batches, to_device

if TYPE_CHECKING:
    from pipetorch.options import Options
    from pipetorch.profiling.recorder import Profiler
    from pipetorch.runtime.batching import Signature
    from pipetorch.runtime.compile import Compiled

__all__: list[str] = []

logger = logging.getLogger("pipetorch.runtime.executor")

EVENTS = ("input", "input_complete", "output", "output_complete")
Counters = dict[str, list[list[float]]]


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
                  iterations: int) -> Counters:
    """{event: [per input (or output) index: [per iteration: seconds]]}, as PopTorch's
    (`[[]]` for every event before the first call)."""
    if times is None:
        return {event: [[]] for event in EVENTS}
    counts = {"input": inputs, "input_complete": inputs, "output": outputs,
              "output_complete": outputs}
    return {event: [[getattr(times, event)] * iterations for _ in range(counts[event])] or [[]]
            for event in EVENTS}


def latency(counters: Counters, start: str, start_reduce: Callable[[list[float]], float],
            end: str, end_reduce: Callable[[list[float]], float]) -> tuple[float, float, float]:
    """(min, max, mean) over iterations of `end` minus `start`, each reduced over the
    inputs/outputs; (0, 0, 0) before any call."""
    def per_step(event: str, reduce: Callable[[list[float]], float]) -> list[float]:
        rows = counters[event]
        return [reduce([row[step] for row in rows]) for step in range(len(rows[0]))]

    starts, ends = per_step(start, start_reduce), per_step(end, end_reduce)
    if not ends:
        return 0.0, 0.0, 0.0
    group = len(starts) // len(ends)  # several inputs per output (output modes): earliest
    durations = [e - min(starts[i * group:(i + 1) * group]) for i, e in enumerate(ends)]
    return min(durations), max(durations), sum(durations) / len(durations)


class PerfCounters:
    """A wrapper's timings: the last call's stamps, its counters and latencies, and its
    profiler (Options.enableProfiling)."""

    def __init__(self, options: Options, *, training: bool) -> None:
        self._options, self._training = options, training
        self.times: CallTimes | None = None  # the last call's
        self.profiler: Profiler | None = None
        self._profile_writer: weakref.finalize | None = None

    def start_profiler(self, compiled: Compiled, args: tuple, kwargs: dict) -> None:
        """Reports go to <profiling dir>/training or /inference, rewritten at detach/destroy/exit.
        A directory that cannot be made raises ConfigError (the caller destroys the model)."""
        from pipetorch.profiling.recorder import Profiler

        o = self._options
        assert o.profiling_dir  # the caller checked it
        sample = to_device(split_micro_batches(args, kwargs, compiled.engine.batching)[0],
                           compiled.engine.input_device)
        directory = os.path.join(o.profiling_dir, "training" if self._training else "inference")
        try:  # now, not at destroy(): a report that cannot be written must not be lost
            os.makedirs(directory, exist_ok=True)
        except OSError as error:
            raise ConfigError(
                f"The profiling report directory {directory!r} cannot be created "
                f"({error.strerror or error}); it comes from opts.enableProfiling() or "
                "POPLAR_ENGINE_OPTIONS autoReport.directory. Name a directory this process "
                "can write to, then wrap the model again") from error
        self.profiler = Profiler(directory, compiled, training=self._training, options=o,
                                 sample=sample)
        self._profile_writer = weakref.finalize(self, _write_report, self.profiler)

    def write_profile(self) -> None:
        if self._profile_writer is not None:
            self._profile_writer()  # at most once; a later call starts a new profiler
        self.profiler, self._profile_writer = None, None

    def counters(self, compiled: Compiled | None, signature: Signature | None) -> Counters:
        """PopTorch's counters of the last call of `compiled`, run with `signature`."""
        if compiled is None or signature is None:
            return perf_counters(None, inputs=0, outputs=0, iterations=0)
        outputs = len(tensor_leaves(compiled.capture.output))
        return perf_counters(
            self.times, inputs=sum(leaf.shape is not None for leaf in signature.leaves),
            outputs=outputs,
            iterations=self._options.device_iterations * self._options.replication_factor)

    def cycle_count(self, compiled: Compiled | None) -> int:
        """cycleCount()'s checks, as PopTorch's, then IpuOnlyError."""
        if not self._options.log_cycle_count:
            raise createPoptorchError("Cycle count logging is disabled. Please set option "
                                      "logCycleCount to True to enable.")
        if compiled is None or self.times is None:
            raise createPoptorchError("Please run the model at least once before obtaining "
                                      "cycle count.")
        raise IpuOnlyError(
            "cycleCount() reads the IPU's hardware cycle counter, which a CPU or GPU does not "
            "have: time the run with getComputeLatency() / getLatency() (seconds), or profile "
            "it with opts.enableProfiling(dir)")


def ipuHardwareIsAvailable(num_ipus: int = 1) -> bool:
    """PopTorch's check for `num_ipus` physical IPUs: always False, pipetorch runs on CPUs
    and GPUs (a script that falls back to `useIpuModel(True)` then takes its fallback)."""
    if isinstance(num_ipus, bool) or not isinstance(num_ipus, int) or num_ipus < 1:
        raise ValueError(f"ipuHardwareIsAvailable: num_ipus must be an int >= 1, got {num_ipus!r}")
    return False


class _NoIpuError(IpuOnlyError, AssertionError):
    """No IPU to ask: an IpuOnlyError, and the AssertionError PopTorch raises here."""


def ipuHardwareVersion() -> int:
    """PopTorch's IPU hardware version; with no IPU in the system, PopTorch's AssertionError
    (`useOfflineIpuTarget()` without an argument targets a Mk2 IPU, version 2)."""
    raise _NoIpuError("No IPU hardware available on this system: pipetorch runs on CPUs and "
                       "GPUs. Pass the version to useOfflineIpuTarget(2) (Mk2) or (21) (Bow) "
                       "yourself")


def _write_report(profiler: Profiler) -> None:
    try:
        path = profiler.write()
        logger.info("Profiling report written to %s", os.path.join(path, "report.html"))
    except Exception as exc:  # at exit: a report must not turn a clean exit into a crash
        logger.warning("Could not write the profiling report: %s", exc)
