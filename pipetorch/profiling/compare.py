"""Two report directories side by side: settings, throughput, idle time and memory per device.

Like the Graph Analyser's "compare two reports": every row shows run A, run B and the
difference (B - A, and the change relative to A). `render_text` is what
`pipetorch report compare A B` prints; `render_html` is compare.html.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from html import escape
from pathlib import Path
from typing import Any, Callable, Mapping

from pipetorch.profiling import html as report_html
from pipetorch.profiling.html import percent
from pipetorch.profiling.recorder import Reports, load

__all__: list[str] = []

# One compared quantity of a report: a name, a count, a time or a fraction, or None (absent)
Value = str | int | float | None
# How a row shows its quantity; each takes its own row's kind of Value (a fraction, bytes...)
Format = Callable[[Any], str]
# A loaded summary.json or memory.json, read by key (what it lacks raises, see `_safe`)
Json = Mapping[str, Any]


@dataclass(frozen=True)
class Row:
    """One compared quantity."""

    section: str
    name: str
    a: Value
    b: Value
    show: Format
    points: bool = False  # a fraction: differences in percentage points, not relative

    @property
    def numeric(self) -> bool:
        return all(isinstance(v, (int, float)) and not isinstance(v, bool)
                   for v in (self.a, self.b))

    @property
    def changed(self) -> bool:
        return self.a != self.b

    def difference(self) -> str:
        """B - A (and its share of A) for numbers that differ, else "changed" or "same"."""
        if not self.changed:
            return "same"
        if not self.numeric:
            return "changed"
        assert isinstance(self.a, (int, float)) and isinstance(self.b, (int, float))
        delta = self.b - self.a
        text = f"{100 * delta:.1f} pts" if self.points else self.show(delta)
        text = text if text.startswith("-") else "+" + text
        if self.a and not self.points:
            text += f" ({100 * delta / abs(self.a):+.1f}%)"
        return text


def _plain(value: Value) -> str:
    return "-" if value is None else str(value)


def _fixed(digits: int, unit: str = "") -> Format:
    return lambda v: "-" if v is None else f"{v:.{digits}f}{unit}"


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**20:.3f} MiB"


def _at(*path: str | int) -> Callable[[Json], Value]:
    """The getter of the value at `path` (keys and list indices) in a loaded report."""
    def get(data: Json) -> Value:
        value: Any = data
        for step in path:
            value = value[step]
        return value
    return get


def rows(a: Reports, b: Reports) -> list[Row]:
    """Every compared quantity of two loaded reports (summary, memory, trace)."""
    (sa, ma, _), (sb, mb, _) = a, b
    out = []

    def add(section: str, name: str, get: Callable[[Json], Value], show: Format = _plain,
            *, memory: bool = False) -> None:
        pair: tuple[Json, Json] = (ma, mb) if memory else (sa, sb)
        out.append(Row(section, name, _safe(get, pair[0]), _safe(get, pair[1]), show,
                       points=show is percent))

    for key in ("model", "mode", "engine", "schedule", "execution_strategy", "devices",
                "replicas", "parameters"):
        add("settings", key, _at(key))
    add("settings", "stages", lambda s: len(s["stages"]))
    for key in ("device_iterations", "gradient_accumulation", "replication_factor",
                "micro_batch_size", "micro_batches_per_call"):
        add("settings", key, _at("batch", key))
    add("settings", "compile time", lambda s: s["compile_seconds"], _fixed(2, " s"))
    add("performance", "throughput", lambda s: s["throughput"]["items_per_second"],
        _fixed(1, " items/s"))
    add("performance", "throughput after the first call",
        lambda s: s["throughput"]["steady_items_per_second"], _fixed(1, " items/s"))
    add("performance", "mean call", lambda s: s["throughput"]["mean_call_ms"], _fixed(2, " ms"))
    add("performance", "bubble (measured)", lambda s: s["timing"]["bubble"]["measured"], percent)
    add("performance", "bubble (theoretical)", lambda s: s["timing"]["bubble"]["theoretical"],
        percent)
    add("performance", "devices computing at once", lambda s: s["timing"]["concurrency"],
        percent)
    lanes = max(len(sa["timing"]["per_device"]), len(sb["timing"]["per_device"]))
    for i in range(lanes):
        section = f"device {i}"

        def timing(s: Json, key: str, i: int = i) -> float | None:
            calls = s["timing"]["calls_analysed"]
            return s["timing"]["per_device"][i][key] / calls if calls else None

        add(section, "idle per call", lambda s: timing(s, "idle_ms"), _fixed(2, " ms"))
        add(section, "idle fraction", _at("timing", "per_device", i, "idle_fraction"), percent)
        add(section, "compute per call", lambda s: timing(s, "compute_ms"), _fixed(2, " ms"))
        add(section, "transfers per call", lambda s: timing(s, "transfer_ms"), _fixed(2, " ms"))
    devices = max(len(ma["devices"]), len(mb["devices"]))
    for i in range(devices):
        for key, name in (("total", "memory total"), ("parameters", "parameters"),
                          ("gradients", "gradients"), ("optimiser_state", "optimiser state"),
                          ("activations", "activations (stashed)")):
            add(f"memory {i}", name, _at("devices", i, key), _mib, memory=True)
    return out


def _safe(get: Callable[[Json], Value], data: Json) -> Value:
    """The value, or None where a report lacks it (fewer devices, no spans)."""
    try:
        return get(data)
    except (KeyError, IndexError, TypeError):
        return None


def render_text(table: list[Row], *, a: str, b: str) -> str:
    """A fixed-width table: section, quantity, A, B, difference."""
    lines = [["", "A", "B", "B - A"]]
    lines += [[f"{r.section}: {r.name}", r.show(r.a), r.show(r.b), r.difference()] for r in table]
    widths = [max(len(line[c]) for line in lines) for c in range(4)]
    text = [f"A: {a}", f"B: {b}", ""]
    for n, line in enumerate(lines):
        text.append("  ".join(cell.ljust(w) if c == 0 else cell.rjust(w) for c, (cell, w)
                              in enumerate(zip(line, widths, strict=True))).rstrip())
        if n == 0:
            text.append("  ".join("-" * w for w in widths))
    return "\n".join(text)


def render_html(table: list[Row], reports: tuple[tuple, tuple], *, a: str, b: str) -> str:
    """compare.html: the table (changed rows marked) and both runs' timelines."""
    body = "".join(
        f"<tr{' class=changed' if r.changed else ''}><td>{escape(r.section)}</td>"
        f"<td>{escape(r.name)}</td><td class=num>{escape(r.show(r.a))}</td>"
        f"<td class=num>{escape(r.show(r.b))}</td><td class=num>{escape(r.difference())}</td></tr>"
        for r in table)
    timelines = "".join(
        f"<h3>{label}: {escape(name)}</h3>{report_html.timeline_svg(report[2])}"
        for label, name, report in (("A", a, reports[0]), ("B", b, reports[1])))
    css = report_html.CSS + "tr.changed td{background:#fff4d6}h3{font-size:15px}"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><link rel="icon" href="data:,">
<title>pipetorch compare</title><style>{css}</style></head><body>
<h1>pipetorch compare</h1><p>A: {escape(a)}<br>B: {escape(b)}</p>
<h2>Differences</h2><p class=muted>Highlighted rows differ. Differences are B - A.</p>
<table><tr><th>section</th><th>quantity</th><th>A</th><th>B</th><th>B - A</th></tr>{body}</table>
<h2>Timelines</h2>{timelines}
<script>{report_html.SCRIPT}</script></body></html>
"""


def compare(a: str | os.PathLike, b: str | os.PathLike, *,
            output: str | os.PathLike | None = None) -> tuple[str, Path]:
    """Compare report directories `a` and `b`: (the text table, the compare.html written).

    `output` is a file path, or a directory to hold compare.html (default: the current one;
    a path that does not exist and has no suffix is taken as a directory).
    """
    reports = (load(a), load(b))
    table = rows(*reports)
    target = Path(output) if output is not None else Path.cwd()
    if target.is_dir() or (not target.exists() and not target.suffix):
        target = target / "compare.html"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(render_html(table, reports, a=str(a), b=str(b)), encoding="utf-8")
    return render_text(table, a=str(a), b=str(b)), target
