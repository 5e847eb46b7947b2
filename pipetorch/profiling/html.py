"""report.html: one self-contained page (inline CSS, SVG and a few lines of JS, no network).

It shows the summary, the pipeline timeline of the last recorded call with one lane per device
(forwards green and backwards red, like the Graph Analyser's execution trace, each labelled
with its micro-batch; clicking a span highlights that micro-batch on every device), the
utilisation of each device with the measured bubble against the theoretical one, and the
memory of each device as stacked bars.
"""
from __future__ import annotations

from html import escape
from typing import TYPE_CHECKING, Literal

from pipetorch.profiling.summary import mib
from pipetorch.profiling.chrome_trace import (
    HOST_PID, ChromeTrace, TraceEvent, device_lanes, spans_of_call,
)

if TYPE_CHECKING:
    from pipetorch.profiling.memory import MemoryReport
    from pipetorch.profiling.summary import Summary

__all__: list[str] = []

COLOURS = {"forward": "#2e9e44", "backward": "#d8413a", "weight-gradient": "#f08a84",
           "transfer": "#8796a8",
           "host-to-device": "#3b7dd8", "device-to-host": "#1aa3a3", "all-reduce": "#e07b00",
           "step": "#7d4fb0", "host": "#c99a1d"}
THIN = ("transfer", "host-to-device", "device-to-host", "all-reduce")  # drawn as thin bars
# drawn full height and labelled with the micro-batch; W: a zero-bubble schedule's deferred
# weight gradients
COMPUTE = ("forward", "backward", "weight-gradient")
# the DeviceReport (memory.json) parts drawn: key, name, colour
_Part = Literal["parameters", "buffers", "gradients", "optimiser_state", "activations"]
MEMORY_PARTS: tuple[tuple[_Part, str, str], ...] = (
    ("parameters", "parameters", "#4e79a7"), ("buffers", "buffers", "#a0cbe8"),
    ("gradients", "gradients", "#f28e2b"), ("optimiser_state", "optimiser state", "#e15759"),
    ("activations", "activations (stashed)", "#59a14f"))

CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:24px auto;max-width:1180px;color:#222;
padding:0 16px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:6px 0}td,th{padding:3px 10px;border-bottom:1px solid #eee;
text-align:left;vertical-align:top}th{background:#f6f6f6}
td.num{text-align:right;font-variant-numeric:tabular-nums}
.note{background:#fff7e0;border-left:4px solid #e0b030;padding:6px 10px;margin:8px 0}
.muted{color:#777}.legend span{display:inline-block;margin-right:14px}
.legend i{display:inline-block;width:12px;height:12px;margin-right:4px;vertical-align:-1px}
svg text{font:11px system-ui,sans-serif}svg .label{font-size:12px}
.span{cursor:pointer}.dim .span{opacity:.25}.dim .span.hl{opacity:1;stroke:#000;stroke-width:1}
.bar{display:flex;height:18px;background:#f1f1f1;min-width:2px}.bar div{height:100%}
.meter{background:#eee;width:160px;height:12px;display:inline-block;vertical-align:middle}
.meter div{height:100%;background:#2e9e44}
"""

SCRIPT = """
(function () {
  'use strict';
  document.querySelectorAll('svg.timeline').forEach(function (svg) {
    var chosen = null;
    svg.addEventListener('click', function (event) {
      var mb = event.target.getAttribute('data-mb');
      chosen = (mb === null || mb === chosen) ? null : mb;
      svg.classList.toggle('dim', chosen !== null);
      svg.querySelectorAll('.span').forEach(function (el) {
        el.classList.toggle('hl', chosen !== null && el.getAttribute('data-mb') === chosen);
      });
    });
  });
})();
"""


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} ms"


def percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _table(rows: list[tuple[str, str]]) -> str:
    body = "".join(f"<tr><th>{escape(k)}</th><td>{escape(str(v))}</td></tr>" for k, v in rows)
    return f"<table>{body}</table>"


def summary_section(summary: Summary) -> str:
    b, t = summary["batch"], summary["throughput"]
    rows = [
        ("model", f"{summary['model']} ({summary['mode']})"),
        ("engine / schedule", f"{summary['engine']} / {summary['schedule']} "
                              f"({summary['execution_strategy'] or '-'})"),
        ("devices / replicas", f"{summary['devices']} / {summary['replicas']}"),
        ("parameters", f"{summary['parameters']:,}"),
        ("deviceIterations / gradientAccumulation / replicationFactor",
         f"{b['device_iterations']} / {b['gradient_accumulation']} / {b['replication_factor']}"),
        ("micro-batches per call / micro-batch size",
         f"{b['micro_batches_per_call']} / {_count(b['micro_batch_size'])}"),
        ("compile time", f"{summary['compile_seconds']:.2f} s"),
        ("calls / items", f"{t['calls']} / {t['items']}"),
        ("throughput", _rate(t["items_per_second"])),
        ("throughput after the first call", _rate(t["steady_items_per_second"])),
        ("mean call", _ms(t["mean_call_ms"])),
    ]
    stages = "".join(
        f"<tr><td>{s['index']}</td><td>{s['ipu']}</td>"
        f"<td>{escape(', '.join(s['blocks']) or '-')}</td>"
        f"<td class=num>{_count(s['parameters'])}</td></tr>" for s in summary["stages"])
    return (_table(rows) + "<table><tr><th>stage</th><th>IPU</th><th>blocks</th>"
            f"<th>parameters</th></tr>{stages}</table>")


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} items/s"


def _count(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


# -- timeline ----------------------------------------------------------------------------------
LABEL_W, PLOT_W, ROW_H, AXIS_H = 250, 960, 34, 26


def _nice_step(span_us: float) -> float:
    """A round tick spacing (1, 2 or 5 x 10^k microseconds) giving about 8 ticks."""
    raw, scale = max(span_us / 8, 1e-3), 1e-3
    while scale * 10 <= raw:
        scale *= 10
    return next(m * scale for m in (1, 2, 5, 10) if m * scale >= raw)


def timeline_svg(trace: ChromeTrace) -> str:
    """The last recorded call, one lane per device (and the host's lane on top)."""
    calls = trace.get("otherData", {}).get("calls") or []
    lanes = device_lanes(trace)
    events = spans_of_call(trace, calls[-1]) if calls else []
    if not any(e["pid"] != HOST_PID for e in events):  # local engine: every host call
        events = [e for c in calls for e in spans_of_call(trace, c)]
    if not events:
        return "<p class=muted>No calls were recorded.</p>"
    t0 = min(e["ts"] for e in events)
    t1 = max(e["ts"] + e["dur"] for e in events)
    scale = PLOT_W / max(t1 - t0, 1e-3)
    rows = [(HOST_PID, 0, "host calls", "host")] + [(p, t, n, "device") for p, t, n in lanes]
    height = AXIS_H + ROW_H * len(rows) + 4
    out = [f'<svg class="timeline" viewBox="0 0 {LABEL_W + PLOT_W + 10} {height}" width="100%" '
           'role="img" aria-label="pipeline timeline">']
    step = _nice_step(t1 - t0)
    tick = 0.0
    while tick <= t1 - t0 + 1e-9:
        x = LABEL_W + tick * scale
        out.append(f'<line x1="{x:.1f}" y1="{AXIS_H - 6}" x2="{x:.1f}" y2="{height}" '
                   'stroke="#e4e4e4"/>'
                   f'<text x="{x:.1f}" y="{AXIS_H - 10}" text-anchor="middle">'
                   f'{tick / 1000:.4g} ms</text>')
        tick += step
    for row, (pid, tid, name, kind) in enumerate(rows):
        y = AXIS_H + row * ROW_H
        lane = [e for e in events if e["pid"] == pid and e["tid"] == tid]
        device = f' data-device="{pid}-{tid}"' if kind == "device" else ""
        out.append(f'<g class="lane {kind}"{device}><rect x="0" y="{y}" '
                   f'width="{LABEL_W + PLOT_W + 10}" height="{ROW_H}" '
                   f'fill="{"#fafafa" if row % 2 else "#ffffff"}"/>'
                   f'<text class="label" x="6" y="{y + ROW_H / 2 + 4}">{escape(name)}</text>')
        for event in lane:
            out.append(_span(event, y, t0, scale))
        out.append("</g>")
    out.append("</svg>")
    return "".join(out)


def _span(event: TraceEvent, y: float, t0: float, scale: float) -> str:
    cat, args = event["cat"], event["args"]
    x = LABEL_W + (event["ts"] - t0) * scale
    width = max(event["dur"] * scale, 2.0 if cat in COMPUTE else 0.8)
    top, tall = (y + ROW_H - 9, 5) if cat in THIN else (y + 4, ROW_H - 8)
    micro = args.get("micro_batch")
    title = (f"{event['name']} · {event['dur'] / 1000:.3f} ms"
             + (f" · {args['bytes']:,} bytes" if args.get("bytes") else "")
             + (f" · {args['items']} items" if "items" in args else ""))
    mb = f' data-mb="{micro}"' if micro is not None else ""
    text = ""
    if cat in COMPUTE and width >= 7 * len(str(micro)) + 4:
        text = (f'<text x="{x + width / 2:.1f}" y="{top + tall / 2 + 4:.1f}" '
                f'text-anchor="middle" fill="#fff" pointer-events="none">{micro}</text>')
    return (f'<rect class="span {cat}"{mb} x="{x:.2f}" y="{top:.1f}" width="{width:.2f}" '
            f'height="{tall}" fill="{COLOURS[cat]}"><title>{escape(title)}</title></rect>{text}')


def _legend(items: list[tuple[str, str]]) -> str:
    return "<p class=legend>" + "".join(
        f'<span><i style="background:{colour}"></i>{escape(name)}</span>'
        for name, colour in items) + "</p>"


# -- utilisation and memory --------------------------------------------------------------------
def utilisation_section(summary: Summary) -> str:
    timing = summary["timing"]
    if not timing["spans"]:
        return f"<p class=note>{escape(timing['note'] or '')}</p>"
    rows = "".join(
        f"<tr><td>{escape(lane['label'])}</td><td class=num>{_ms(r['compute_ms'])}</td>"
        f"<td class=num>{_ms(r['idle_ms'])}</td><td class=num>{_ms(r['transfer_ms'])}</td>"
        f"<td class=num>{_ms(r['step_ms'])}</td><td class=num>{_ms(r['untracked_ms'])}</td>"
        f"<td class=num>{percent(r['utilisation'])}</td>"
        f"<td><span class=meter><div style=\"width:{100 * (r['utilisation'] or 0):.1f}%\">"
        "</div></span></td></tr>"
        for lane, r in zip(summary["lanes"], timing["per_device"], strict=True))
    bubble = timing["bubble"]
    return (f"<p>Over the last {timing['calls_analysed']} call(s). Idle is the devices' window "
            "less compute: sends and receives (including the wait for the peer's half), the "
            "optimiser step, and gaps between actions.</p>"
            "<table><tr><th>device</th><th>compute</th><th>idle</th><th>of which transfers"
            "</th><th>optimiser</th><th>gaps</th><th>utilisation</th><th></th></tr>"
            f"{rows}</table>"
            f"<p><b>Bubble</b> (device time not computing): measured "
            f"<b>{percent(bubble['measured'])}</b>, theoretical {percent(bubble['theoretical'])} "
            f"for balanced stages ({escape(bubble['formula'] or '-')}, S = {bubble['stages']}, "
            f"G = {bubble['micro_batches_per_plan']} micro-batches per plan). Two or more "
            f"devices computed at once during {percent(timing['concurrency'])} of the window.</p>")


def memory_section(memory: MemoryReport) -> str:
    devices = memory["devices"]
    largest = max((d["total"] for d in devices), default=0) or 1
    bars, rows = [], []
    for d in devices:
        parts = "".join(
            f'<div title="{escape(name)}: {mib(d[key])}" style="width:'
            f'{100 * (d[key] or 0) / largest:.2f}%;background:{colour}"></div>'
            for key, name, colour in MEMORY_PARTS)
        bars.append(f"<tr><td>{escape(d['label'])}</td><td style=\"width:60%\">"
                    f"<div class=bar>{parts}</div></td><td class=num>{mib(d['total'])}</td></tr>")
        rows.append("<tr><td>" + escape(d["label"]) + "</td>" + "".join(
            f"<td class=num>{mib(d[key])}</td>" for key, _, _ in MEMORY_PARTS)
            + f"<td class=num>{d['peak_stashed_micro_batches']}</td>"
            + f"<td class=num>{mib(d['measured_peak'])}</td></tr>")
    head = "".join(f"<th>{escape(name)}</th>" for _, name, _ in MEMORY_PARTS)
    notes = [f"Method: {memory['method']}.", f"Activations: {memory['activations_method']}.",
             f"Optimiser state: {memory['optimiser_method']}."]
    if note := memory.get("optimiser_note"):
        notes.append(note + ".")
    return (_legend([(name, colour) for _, name, colour in MEMORY_PARTS])
            + f"<table style=\"width:100%\">{''.join(bars)}</table>"
            + f"<table><tr><th>device</th>{head}<th>peak stashed micro-batches</th>"
            + f"<th>measured peak</th></tr>{''.join(rows)}</table>"
            + "".join(f"<p class=muted>{escape(n)}</p>" for n in notes))


def report_page(summary: Summary, memory: MemoryReport, trace: ChromeTrace, *,
                title: str) -> str:
    """The whole report.html."""
    timing = summary["timing"]
    timeline_note = "" if timing["spans"] else f"<p class=note>{escape(timing['note'] or '')}</p>"
    calls = trace.get("otherData", {}).get("calls") or []
    which = f"host call {calls[-1]}" if calls and timing["spans"] else "the kept host calls"
    legend = _legend([(c, COLOURS[c]) for c in (*COMPUTE, *THIN, "step", "host")])
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,">
<title>pipetorch report: {escape(title)}</title><style>{CSS}</style></head>
<body>
<h1>pipetorch report: {escape(title)}</h1>
<p class=muted>summary.json, memory.json and trace.json (Chrome trace format: open it in
Perfetto or chrome://tracing) sit beside this page.</p>
<h2>Summary</h2>{summary_section(summary)}
<h2>Pipeline timeline</h2>
<p>{escape(which)}: one lane per device; numbers are micro-batches. Click a span to follow its
micro-batch across the devices.</p>{timeline_note}{legend}{timeline_svg(trace)}
<h2>Utilisation</h2>{utilisation_section(summary)}
<h2>Memory per device</h2>{memory_section(memory)}
<script>{SCRIPT}</script>
</body></html>
"""
