"""The profiler a wrapper keeps while profiling: records host calls, writes the report directory.

    p = Profiler(directory, compiled, training=True, options=options)   # after compile
    start = time.monotonic_ns(); wrapper_call(...); end = time.monotonic_ns()
    p.record_call(start, end, items)                                      # after each call
    p.write()                                                             # idempotent

Each call's stage spans come from `compiled.engine.last_trace` (the worker processes time
every schedule action); only the last `keep_calls` calls' spans are kept, so memory stays
bounded however long training runs, while throughput counts every call. `write` produces
summary.json, memory.json, trace.json and report.html in `directory`.
"""
from __future__ import annotations

import json
import logging
import os
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING

from pipetorch.profiling import chrome_trace, html, memory, summary
from pipetorch.profiling.lanes import lanes_of
from pipetorch.profiling.timing import CallRecord

if TYPE_CHECKING:
    from pipetorch.options.options import Options
    from pipetorch.profiling.compiled import Compiled

__all__: list[str] = []

logger = logging.getLogger(__name__)

FILES = ("summary.json", "memory.json", "trace.json", "report.html")
# what the first three hold: (summary, memory, trace)
Reports = tuple[summary.Summary, memory.MemoryReport, chrome_trace.ChromeTrace]


class Profiler:
    """Records the host calls of one compiled wrapper and writes its report directory.

    `sample` is one micro-batch `(args, kwargs)` as the engine receives it; with it memory.json
    sizes the activations each stage keeps for backward (without it they are reported as not
    computed). `keep_calls` bounds how many calls' spans are kept for the trace and the
    utilisation figures.
    """

    def __init__(self, directory: str | os.PathLike, compiled: Compiled, *, training: bool,
                 options: Options, sample: tuple[tuple, dict] | None = None,
                 keep_calls: int = 3) -> None:
        if isinstance(keep_calls, bool) or not isinstance(keep_calls, int) or keep_calls < 1:
            raise ValueError(f"keep_calls must be an int >= 1 (calls whose spans are kept), "
                             f"got {keep_calls!r}")
        if sample is not None and not (isinstance(sample, tuple) and len(sample) == 2
                                       and isinstance(sample[1], dict)):
            raise TypeError(f"sample must be one micro-batch as (args, kwargs), got "
                            f"{type(sample).__name__}")
        self.directory = Path(directory)
        self.compiled, self.training, self.options = compiled, training, options
        self.sample = sample
        self._calls: deque[CallRecord] = deque(maxlen=keep_calls)
        memory.reset_peak(compiled)
        self._totals = {"calls": 0, "items": 0, "ns": 0, "first_items": 0, "first_ns": 0}

    @property
    def calls(self) -> list[CallRecord]:
        """The kept calls, oldest first."""
        return list(self._calls)

    def record_call(self, start_ns: int, end_ns: int, items: int) -> None:
        """Note one host call (time.monotonic_ns() around it) of `items` inputs."""
        if end_ns < start_ns:
            raise ValueError(f"A call cannot end ({end_ns} ns) before it starts ({start_ns} ns): "
                             "pass time.monotonic_ns() taken before and after the call")
        if isinstance(items, bool) or not isinstance(items, int) or items < 0:
            raise ValueError(f"items must be an int >= 0 (inputs in the call), got {items!r}")
        # Replicas run the same schedule on the same shapes: lanes show replica 0's devices
        # (its all-reduce spans, "AR", show the time spent with the other replicas).
        traces = tuple(t for t in getattr(self.compiled.engine, "last_trace", None) or ()
                       if getattr(t, "replica", 0) == 0)
        self._calls.append(CallRecord(self._totals["calls"], start_ns, end_ns, items, traces))
        if not self._totals["calls"]:
            self._totals["first_items"], self._totals["first_ns"] = items, end_ns - start_ns
        self._totals["calls"] += 1
        self._totals["items"] += items
        self._totals["ns"] += end_ns - start_ns

    def reports(self) -> Reports:
        """(summary, memory, trace) as they would be written now."""
        lanes = lanes_of(self.compiled)
        calls = self.calls
        summary_data = summary.build(self.compiled, calls, training=self.training,
                                     options=self.options, totals=dict(self._totals))
        memory_data = memory.build(self.compiled, training=self.training, options=self.options,
                                   sample=self.sample)
        return summary_data, memory_data, chrome_trace.build(calls, lanes)

    def write(self) -> Path:
        """Write (or rewrite) the report directory's four files; returns the directory."""
        summary_data, memory_data, trace_data = self.reports()
        self.directory.mkdir(parents=True, exist_ok=True)
        _write_json(self.directory / "summary.json", summary_data, indent=2)
        _write_json(self.directory / "memory.json", memory_data, indent=2)
        _write_json(self.directory / "trace.json", trace_data, indent=None)
        page = html.report_page(summary_data, memory_data, trace_data,
                                title=self.directory.resolve().name)
        _write_text(self.directory / "report.html", page)
        logger.info("Profiling report written to %s (%d call(s) recorded)", self.directory,
                    self._totals["calls"])
        return self.directory


def _write_json(path: Path,
                data: summary.Summary | memory.MemoryReport | chrome_trace.ChromeTrace, *,
                indent: int | None) -> None:
    _write_text(path, json.dumps(data, indent=indent, allow_nan=False) + "\n")


def _write_text(path: Path, text: str) -> None:
    # Write beside, then rename: a reader (or a crash at exit) never sees half a file.
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(text, encoding="utf-8")
    os.replace(temporary, path)


def load(directory: str | os.PathLike) -> Reports:
    """(summary, memory, trace) read from a report directory; ValueError naming what is missing."""
    folder = Path(directory)
    if not folder.is_dir():
        raise ValueError(f"{str(folder)!r} is not a directory: give the folder a profiled run "
                         "wrote (opts.enableProfiling(dir) or POPLAR_ENGINE_OPTIONS "
                         "autoReport.directory)")
    found = []
    for name in FILES[:3]:
        path = folder / name
        if not path.is_file():
            raise ValueError(f"{str(folder)!r} has no {name}: it is not a pipetorch report "
                             f"directory (expected {', '.join(FILES)})")
        try:
            found.append(json.loads(path.read_text(encoding="utf-8")))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{str(path)!r} is not valid JSON ({exc}); write the report "
                             "again") from None
    if found[0].get("format") != summary.FORMAT:
        raise ValueError(f"{str(folder / 'summary.json')!r} has format "
                         f"{found[0].get('format')!r}, expected {summary.FORMAT!r}")
    return found[0], found[1], found[2]
