"""trace.json in Chrome's trace-event format (Perfetto, chrome://tracing): one lane per device.

Each device is a trace "process" (pid 1 + its IPU id) and each stage on it a "thread"
(tid = stage); the host's calls sit on pid 0. Every span is a complete ("X") event whose
timestamps are microseconds since the first recorded call; `args` carry the call, the
micro-batch and the bytes moved.
"""
from __future__ import annotations

import os
from typing import Sequence, TypedDict

from pipetorch.profiling.lanes import Lane
from pipetorch.profiling.timing import COMPUTE, TRANSFER, CallRecord

__all__: list[str] = []

HOST_PID = 0
CATEGORIES = {"F": "forward", "B": "backward", "W": "weight-gradient", "STEP": "step",
              "H2D": "host-to-device", "D2H": "device-to-host", "AR": "all-reduce",
              "TR": "all-reduce"}


class TraceEvent(TypedDict, total=False):
    """One event: metadata ("M": name, pid, tid and args) or a complete span ("X", with its
    category, start and duration). A span's args: call, items (the host's), stage, kind,
    micro_batch, bytes; metadata's: name or sort_index."""

    name: str
    cat: str
    ph: str
    pid: int
    tid: int
    ts: float
    dur: float
    args: dict[str, str | int | None]


class OtherData(TypedDict):
    """trace.json's `otherData`: its producer, and the calls kept."""

    producer: str
    calls: list[int]


class ChromeTrace(TypedDict):
    """trace.json (`build`), as written and as `recorder.load` reads it back."""

    traceEvents: list[TraceEvent]
    displayTimeUnit: str
    otherData: OtherData


def category(kind: str) -> str:
    """forward, backward, weight-gradient (the W a zero-bubble schedule defers), step,
    host-to-device, device-to-host, all-reduce, or transfer
    (sends and receives between stages, and the waits inside them)."""
    if kind in CATEGORIES:
        return CATEGORIES[kind]
    if kind in TRANSFER:
        return "transfer"
    raise ValueError(f"Unknown span kind {kind!r}")


def device_pid(lane: Lane) -> int:
    return 1 + lane.ipu


def lane_tid(lane: Lane) -> int:
    return 0 if lane.stage is None else lane.stage


def build(calls: Sequence[CallRecord], lanes: Sequence[Lane]) -> ChromeTrace:
    """The trace of the kept calls: metadata naming the lanes, then one X event per span."""
    origin = calls[0].start if calls else 0
    events: list[TraceEvent] = [
        _meta("process_name", HOST_PID, 0, name=f"host (pid {os.getpid()})"),
        _meta("process_sort_index", HOST_PID, 0, sort_index=0),
        _meta("thread_name", HOST_PID, 0, name="host calls"),
    ]
    by_stage = {lane.stage: lane for lane in lanes}
    named: set[int] = set()
    for lane in lanes:
        pid = device_pid(lane)
        if pid not in named:
            named.add(pid)
            events += [_meta("process_name", pid, 0, name=f"IPU {lane.ipu} ({lane.device})"),
                       _meta("process_sort_index", pid, 0, sort_index=pid)]
        where = "all stages" if lane.stage is None else f"stage {lane.stage}"
        events.append(_meta("thread_name", pid, lane_tid(lane), name=where))
    for call in calls:
        events.append({
            "name": f"call {call.index}", "cat": "host", "ph": "X", "pid": HOST_PID, "tid": 0,
            "ts": _us(call.start - origin), "dur": _us(call.end - call.start),
            "args": {"call": call.index, "items": call.items}})
        for trace in call.traces:
            lane = by_stage[trace.stage]
            for span in trace.spans:
                events.append({
                    "name": span.kind if span.micro_batch is None
                    else f"{span.kind}{span.micro_batch}",
                    "cat": category(span.kind), "ph": "X",
                    "pid": device_pid(lane), "tid": lane_tid(lane),
                    "ts": _us(span.start - origin), "dur": _us(span.end - span.start),
                    "args": {"call": call.index, "stage": trace.stage, "kind": span.kind,
                             "micro_batch": span.micro_batch, "bytes": span.nbytes}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"producer": "pipetorch", "calls": [c.index for c in calls]}}


def _meta(event: str, pid: int, tid: int, **args: str | int | None) -> TraceEvent:
    return {"name": event, "ph": "M", "pid": pid, "tid": tid, "args": args}


def _us(ns: int) -> float:
    return ns / 1000.0


# -- reading a trace back (report.html, compare) --------------------------------------------------
def device_lanes(trace: ChromeTrace) -> list[tuple[int, int, str]]:
    """(pid, tid, name) of every device lane (the host's excluded), in display order."""
    processes = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
                 if e["ph"] == "M" and e["name"] == "process_name"}
    lanes = [(e["pid"], e["tid"], f"{processes.get(e['pid'], e['pid'])} · {e['args']['name']}")
             for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] != HOST_PID]
    return sorted(lanes)


def spans_of_call(trace: ChromeTrace, call: int) -> list[TraceEvent]:
    """The X events of host call `call`, the host's call span included."""
    return [e for e in trace["traceEvents"] if e["ph"] == "X" and e["args"].get("call") == call]


def is_compute(event: TraceEvent) -> bool:
    return event["args"].get("kind") in COMPUTE
