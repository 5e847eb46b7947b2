"""Summarise a scripts/gpu-check.sh run: device, test counts per phase, benchmark rows.

    python3 scripts/gpu_summary.py OUT_DIR

reads OUT_DIR/device.json, OUT_DIR/phases.json (each phase's exit status), the pytest
JUnit files (OUT_DIR/<phase>.xml) and OUT_DIR/benchmark.json; writes OUT_DIR/summary.json
and OUT_DIR/summary.txt, prints the text, and exits 0 only when every phase passed.
Standard library only: it runs on the bare GPU machine.
"""
from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any


def junit_counts(path: Path) -> dict[str, Any]:
    """passed/failed/errors/skipped and the failing tests of one pytest --junitxml file."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {"tests": 0, "failed": 0, "errors": 0, "skipped": 0}
    failing = []
    for suite in suites:
        counts["tests"] += int(suite.get("tests", 0))
        counts["failed"] += int(suite.get("failures", 0))
        counts["errors"] += int(suite.get("errors", 0))
        counts["skipped"] += int(suite.get("skipped", 0))
        for case in suite.iter("testcase"):
            for kind in ("failure", "error"):
                found = case.find(kind)
                if found is not None:
                    message = (found.get("message") or "").strip().splitlines()
                    failing.append(f"{case.get('classname')}::{case.get('name')} ({kind}: "
                                   f"{message[0][:160] if message else 'no message'})")
    counts["passed"] = counts["tests"] - counts["failed"] - counts["errors"] - counts["skipped"]
    counts["failing"] = failing
    return counts


def read_json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.is_file() else None


def summarise(out: Path) -> tuple[dict[str, Any], str, bool]:
    device = read_json(out / "device.json") or {"error": "device.json missing"}
    phases = read_json(out / "phases.json") or {}
    summary: dict[str, Any] = {"device": device, "phases": {}}
    lines = [f"pipetorch GPU check: {device.get('name', device.get('error', '?'))}",
             f"  torch {device.get('torch', '?')}, CUDA {device.get('cuda', '?')}, "
             f"{device.get('gpus', 0)} GPU(s), python {device.get('python', '?')}"]
    ok = bool(phases)
    for phase, status in phases.items():
        entry: dict[str, Any] = {"exit_status": status}
        xml = out / f"{phase}.xml"
        if xml.is_file():
            entry.update(junit_counts(xml))
            lines.append(f"{phase}: {entry['passed']} passed, {entry['failed']} failed, "
                         f"{entry['skipped']} skipped, {entry['errors']} errors "
                         f"(exit status {status})")
            lines += [f"    FAILED {name}" for name in entry["failing"]]
        else:
            lines.append(f"{phase}: exit status {status}" + (
                f" ({status_note(status)})" if status_note(status) else ""))
            lines += [f"    | {line}" for line in log_tail(out, phase)]
        ok = ok and status == 0
        summary["phases"][phase] = entry
    bench = read_json(out / "benchmark.json")
    if bench is not None:
        summary["benchmark"] = bench
        lines.append(f"benchmark on {bench['device']} (torch {bench['torch']}"
                     f"{', quick' if bench.get('quick') else ''}):")
        for row in bench["rows"]:
            lines.append(f"    {row['group']:>9} | {row['name']}: {fmt(row)}"
                         + (f"  ({row['note']})" if row.get("note") else ""))
    summary["ok"] = ok
    lines.append("GPU check: " + ("PASSED" if ok else "FAILED"))
    return summary, "\n".join(lines) + "\n", ok


def log_tail(out: Path, phase: str) -> list[str]:
    """The last lines of a phase's log: a benchmark's table, or why tests did not report."""
    if phase == "bench":  # its rows come from benchmark.json
        return []
    log = out / f"{phase}.log"
    if not log.is_file():
        return []
    keep = 20 if phase in ("memory", "generate") else 3
    return [line.rstrip() for line in log.read_text(errors="replace").splitlines()[-keep:]]


def status_note(status: int) -> str:
    return {124: "timed out", 127: "command not found", 3: "pytest not installed"}.get(status, "")


def fmt(row: dict[str, Any]) -> str:
    value = row["value"]
    if value is None:
        return "n/a"
    if row["unit"] == "ratio":
        return f"{value:.3f}"
    if row["unit"] == "bytes":
        return f"{value / 2**20:.1f} MiB"
    return f"{value:,.0f} {row['unit']}"


def main() -> int:
    out = Path(sys.argv[1])
    summary, text, ok = summarise(out)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "summary.txt").write_text(text)
    sys.stdout.write(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
