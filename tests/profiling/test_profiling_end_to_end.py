"""Profiling real two-stage runs (stage workers): trace, overlap, compare, and report.html in a
real headless browser (Debian's chromium; the screenshot is kept in test-artifacts/)."""
import json
import os
import re
import shutil
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from helpers.models import MnistNetwork, WithLoss, mnist_data

import pipetorch as poptorch
from pipetorch.cli import report as report_cli
from pipetorch.profiling.chrome_trace import device_lanes
from pipetorch.profiling.recorder import Profiler

pytestmark = pytest.mark.slow

D, G, MICRO = 2, 4, 32  # a micro-batch big enough for stage 0's convolutions to take a while
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"


def profiled_run(directory: Path, strategy) -> Path:
    """Three recorded calls of a 2-stage trainingModel, timed as the executor will time them."""
    torch.manual_seed(0)
    model = WithLoss(MnistNetwork())
    opts = poptorch.Options().deviceIterations(D).showCompilationProgressBar(False)
    opts.Training.gradientAccumulation(G)
    opts.setExecutionStrategy(strategy(poptorch.Stage("B1", "B2").ipu(0),
                                       poptorch.Stage("B3", "B4").ipu(1)))
    wrapper = poptorch.trainingModel(model, opts,
                                     optimizer=torch.optim.SGD(model.parameters(), lr=0.01))
    x, y = mnist_data(D * G * MICRO)
    try:
        wrapper.compile(x, y)
        profiler = Profiler(directory, wrapper._compiled, training=True, options=wrapper.options,
                            sample=((x[:MICRO], y[:MICRO]), {}))
        for _ in range(3):
            start = time.monotonic_ns()
            wrapper(x, y)
            profiler.record_call(start, time.monotonic_ns(), len(x))
        return profiler.write()
    finally:
        wrapper.destroy()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("profiles")
    return {"pipelined": profiled_run(root / "pipelined", poptorch.PipelinedExecution),
            "sharded": profiled_run(root / "sharded", poptorch.ShardedExecution)}


def compute_spans(directory: Path) -> dict[int, list[dict]]:
    """Forward and backward events of every recorded call, by call."""
    trace = json.loads((directory / "trace.json").read_text())
    by_call: dict[int, list[dict]] = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X" and e["cat"] in ("forward", "backward"):
            by_call.setdefault(e["args"]["call"], []).append(e)
    return by_call


def overlapping(events: list[dict]) -> list[tuple[dict, dict]]:
    """Pairs of compute spans on different devices that run at the same time."""
    return [(a, b) for a in events for b in events if a["pid"] < b["pid"]
            and a["ts"] < b["ts"] + b["dur"] and b["ts"] < a["ts"] + a["dur"]]


@pytest.mark.parametrize("schedule", ["pipelined", "sharded"])
def test_one_lane_per_device_and_one_forward_and_backward_per_micro_batch(runs, schedule):
    trace = json.loads((runs[schedule] / "trace.json").read_text())
    assert [name for _, _, name in device_lanes(trace)] == ["IPU 0 (cpu) · stage 0",
                                                           "IPU 1 (cpu) · stage 1"]
    calls = compute_spans(runs[schedule])
    assert sorted(calls) == [0, 1, 2]
    for events in calls.values():
        for pid in (1, 2):
            seen = Counter((e["args"]["kind"], e["args"]["micro_batch"]) for e in events
                           if e["pid"] == pid)
            assert seen == Counter({(k, m): 1 for k in "FB" for m in range(D * G)})


def stage_order(events: list[dict], pid: int) -> list[tuple[str, int]]:
    """What one stage worker computed, in the order it computed it (one process: program order)."""
    return [(e["args"]["kind"], e["args"]["micro_batch"])
            for e in sorted(events, key=lambda e: e["ts"]) if e["pid"] == pid]


def test_pipelined_stage_0_runs_ahead_of_stage_1_and_sharded_never_overlaps(runs):
    # Whether two processes' spans meet in wall time depends on what else the machine runs (on
    # a loaded 2-core CI machine they may not), so the test reads the schedule instead: in 1F1B
    # stage 0 starts micro-batch m+1's forward before it has micro-batch m's gradient, that is
    # while stage 1 works on m; sharded finishes each micro-batch before the next one starts.
    for events in compute_spans(runs["pipelined"]).values():
        order = stage_order(events, pid=1)
        for step in range(D):
            m = step * G
            assert order.index(("F", m + 1)) < order.index(("B", m)), order
    for events in compute_spans(runs["sharded"]).values():
        order = stage_order(events, pid=1)
        assert order == [(k, m) for m in range(D * G) for k in "FB"], order
        assert overlapping(events) == []
    summary = json.loads((runs["sharded"] / "summary.json").read_text())
    assert summary["timing"]["concurrency"] == 0.0


def test_reports_size_memory_and_bubble(runs):
    for schedule, stashed, ideal in (("pipelined", [2, 1], 0.2), ("sharded", [1, 1], 0.5)):
        summary = json.loads((runs[schedule] / "summary.json").read_text())
        memory = json.loads((runs[schedule] / "memory.json").read_text())
        assert [s["parameters"] for s in summary["stages"]] == [5280, 84746]
        assert summary["throughput"]["items"] == 3 * D * G * MICRO
        assert summary["timing"]["bubble"]["theoretical"] == pytest.approx(ideal)
        assert 0 < summary["timing"]["bubble"]["measured"] < 1
        assert [d["peak_stashed_micro_batches"] for d in memory["devices"]] == stashed
        assert all(d["activations_per_micro_batch"] > 0 for d in memory["devices"])


def test_compare_sharded_and_pipelined(runs, tmp_path):
    a, b = runs["sharded"], runs["pipelined"]
    text = report_cli.compare_reports(a, b, output=tmp_path / "compare.html")
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (a, b))
    ta, tb = (s["throughput"]["items_per_second"] for s in (sa, sb))
    assert re.search(rf"performance: throughput +{ta:.1f} items/s +{tb:.1f} items/s +"
                     rf"[+-]{abs(tb - ta):.1f} items/s", text)
    for i in (0, 1):
        ia, ib = (s["timing"]["per_device"][i]["idle_ms"] / 3 for s in (sa, sb))
        assert re.search(rf"device {i}: idle per call +{ia:.2f} ms +{ib:.2f} ms", text)
    assert re.search(r"performance: bubble \(theoretical\) +50.0% +20.0% +-30.0 pts", text)
    # 1F1B keeps two micro-batches' activations on stage 0 where sharded keeps one.
    assert re.search(r"memory 0: activations \(stashed\) .* \(\+100.0%\)", text)
    assert re.search(r"memory 1: activations \(stashed\) .* same", text)
    assert (tmp_path / "compare.html").is_file()


# -- a real browser ------------------------------------------------------------------------------
def chromium() -> str:
    """Debian's chromium, installed with apt-get when missing and allowed; else skip."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip("chromium is missing and apt-get cannot install it here (not root or no apt)")
    for command in (["apt-get", "install", "-y", "chromium"], ["apt-get", "update"],
                    ["apt-get", "install", "-y", "chromium"]):
        try:
            subprocess.run(command, check=False, timeout=300, capture_output=True,
                           env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
        except subprocess.TimeoutExpired:
            pytest.skip(f"{' '.join(command)} took more than 300 s")
        if shutil.which("chromium"):
            return shutil.which("chromium")
    pytest.skip("apt-get install -y chromium did not install chromium")


# Run inside the page after the report's own script: counts the lanes the browser laid out
# and clicks micro-batch 3 to exercise the highlighting.
PROBE = """<script>
var lanes = Array.from(document.querySelectorAll('g.lane.device'))
  .filter(function (g) { return g.getBBox().width > 0; });
document.documentElement.dataset.lanes = lanes.length;
document.documentElement.dataset.names = lanes.map(function (g) {
  return g.querySelector('text.label').textContent; }).join('|');
document.querySelector('svg.timeline rect[data-mb="3"]').dispatchEvent(
  new MouseEvent('click', {bubbles: true}));
document.documentElement.dataset.highlighted =
  document.querySelectorAll('svg.timeline .span.hl').length;
</script></body>"""


def browse(browser: str, page: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [browser, "--headless", "--disable-gpu", "--no-sandbox", "--enable-logging=stderr",
         "--v=0", "--window-size=1280,1700", *extra, page.as_uri()],
        capture_output=True, text=True, timeout=120)


def test_report_html_in_headless_chromium(runs, tmp_path):
    browser = chromium()
    page = runs["pipelined"] / "report.html"
    probe = tmp_path / "probe.html"
    probe.write_text(page.read_text().replace("</body>", PROBE))
    dom = browse(browser, probe, "--dump-dom")
    console = [line for line in dom.stderr.splitlines() if ":CONSOLE" in line]
    assert console == [], console  # the page logs nothing: any console line is an error
    root = re.search(r"<html[^>]*>", dom.stdout).group(0)
    assert 'data-lanes="2"' in root
    assert 'data-names="IPU 0 (cpu) · stage 0|IPU 1 (cpu) · stage 1"' in root
    assert 'data-highlighted="8"' in root  # F3, B3 and their two transfers on each device
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "profiling-report.png"
    shot.unlink(missing_ok=True)
    taken = browse(browser, page, f"--screenshot={shot}")
    assert [line for line in taken.stderr.splitlines() if ":CONSOLE" in line] == []
    assert shot.is_file() and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
