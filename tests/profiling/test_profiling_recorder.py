"""Profiler on fake compiled models: the four files, lanes, bounded memory, throughput, errors."""
import json
from collections import Counter

import pytest
from profiling_fakes import MS, local_compiled, options, process_compiled, run_calls

from pipetorch.profiling.chrome_trace import device_lanes
from pipetorch.profiling.recorder import FILES, Profiler, load


@pytest.fixture
def written(tmp_path):
    compiled = process_compiled()
    profiler = Profiler(tmp_path / "report", compiled, training=True, options=options())
    run_calls(profiler, compiled, calls=5)
    return profiler, profiler.write()


def test_write_creates_the_four_files_and_returns_the_directory(written, tmp_path):
    profiler, directory = written
    assert directory == tmp_path / "report"
    assert sorted(p.name for p in directory.iterdir()) == sorted(FILES)
    summary, memory, trace = load(directory)
    assert summary["devices"] == 2 and summary["replicas"] == 1
    assert summary["engine"] == "processes" and summary["schedule"] == "pipelined"
    assert [(s["index"], s["ipu"], s["blocks"], s["parameters"]) for s in summary["stages"]] == [
        (0, 0, ["B1"], 6 * 8 + 8), (1, 1, ["B2"], 8 * 3 + 3)]
    assert summary["parameters"] == 6 * 8 + 8 + 8 * 3 + 3
    assert summary["compile_seconds"] == 1.25
    assert summary["batch"] == {"device_iterations": 2, "gradient_accumulation": 4,
                                "replication_factor": 1, "micro_batches_per_call": 8,
                                "items_per_call": 16, "micro_batch_size": 2}
    assert [d["label"] for d in memory["devices"]] == ["IPU 0 · stage 0 · cpu",
                                                     "IPU 1 · stage 1 · cpu"]


def test_throughput_counts_every_call_but_spans_are_kept_for_the_last_three(written):
    profiler, directory = written
    assert [c.index for c in profiler.calls] == [2, 3, 4]
    summary, _, trace = load(directory)
    durations = [c.end - c.start for c in profiler.calls]
    assert summary["throughput"]["calls"] == 5 and summary["throughput"]["items"] == 80
    # Every fake call lasts the same: 2 iterations x 15 ticks of 1 ms, plus 1 ms each side.
    assert set(durations) == {32 * MS}
    assert summary["throughput"]["items_per_second"] == pytest.approx(80 / (5 * 0.032))
    assert summary["throughput"]["steady_items_per_second"] == pytest.approx(64 / (4 * 0.032))
    assert summary["timing"]["calls_analysed"] == 3
    assert trace["otherData"]["calls"] == [2, 3, 4]
    assert summary["timing"]["bubble"]["measured"] == pytest.approx(0.2)
    assert summary["timing"]["bubble"]["theoretical"] == pytest.approx(0.2)


def test_trace_has_one_lane_per_device_and_one_f_and_b_per_micro_batch(written):
    _, directory = written
    trace = json.loads((directory / "trace.json").read_text())
    assert [name for _, _, name in device_lanes(trace)] == ["IPU 0 (cpu) · stage 0",
                                                           "IPU 1 (cpu) · stage 1"]
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] != 0]
    for call in (2, 3, 4):
        for pid in (1, 2):
            mine = Counter((e["args"]["kind"], e["args"]["micro_batch"]) for e in spans
                           if e["args"]["call"] == call and e["pid"] == pid
                           and e["cat"] in ("forward", "backward"))
            assert mine == Counter({(k, m): 1 for k in "FB" for m in range(8)})
    first = next(e for e in spans if e["name"] == "S>F0")
    assert first["cat"] == "transfer" and first["args"]["bytes"] == 64
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    host = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == 0]
    assert [e["args"]["items"] for e in host] == [16, 16, 16]


def test_write_is_idempotent(written):
    profiler, directory = written
    before = {name: (directory / name).read_bytes() for name in FILES}
    assert profiler.write() == directory
    assert {name: (directory / name).read_bytes() for name in FILES} == before
    assert not [p for p in directory.iterdir() if p.name.startswith(".")]  # no temporary left


def test_memory_without_a_sample_says_activations_were_not_computed(written):
    _, directory = written
    memory = json.loads((directory / "memory.json").read_text())
    assert memory["method"].startswith("computed from tensor sizes")
    stage0 = memory["devices"][0]
    assert stage0["parameters"] == (6 * 8 + 8) * 4 and stage0["gradients"] == (6 * 8 + 8) * 4
    assert stage0["optimiser_state"] == (6 * 8 + 8) * 4  # SGD momentum: one buffer
    assert stage0["activations"] is None and "no sample" in memory["activations_method"]
    assert [d["peak_stashed_micro_batches"] for d in memory["devices"]] == [2, 1]  # 1F1B, S=2


def test_sharded_stashes_one_micro_batch_per_stage(tmp_path):
    compiled = process_compiled("sharded")
    profiler = Profiler(tmp_path, compiled, training=True, options=options())
    run_calls(profiler, compiled, calls=1)
    summary, memory, _ = profiler.reports()
    assert [d["peak_stashed_micro_batches"] for d in memory["devices"]] == [1, 1]
    assert summary["timing"]["bubble"]["measured"] == pytest.approx(0.5)
    assert summary["timing"]["concurrency"] == 0.0


def test_local_engine_reports_host_calls_only(tmp_path):
    compiled = local_compiled()
    profiler = Profiler(tmp_path, compiled, training=True, options=options())
    run_calls(profiler, compiled, calls=2, items=4)
    summary, memory, trace = load(profiler.write())
    assert summary["engine"] == "local" and summary["timing"]["spans"] is False
    assert "per-stage spans need the stages on several devices" in summary["timing"]["note"]
    assert [(lane["stage"], lane["device"]) for lane in summary["lanes"]] == [(None, "cpu")]
    assert summary["stages"][0]["parameters"] == 6 * 8 + 8 + 8 * 3 + 3
    assert [e["name"] for e in trace["traceEvents"] if e["ph"] == "X"] == ["call 0", "call 1"]
    assert memory["devices"][0]["peak_stashed_micro_batches"] == 1
    page = (tmp_path / "report.html").read_text()
    assert "per-stage spans need the stages on several devices" in page


@pytest.mark.parametrize("args,message", [
    ((5, 4, 1), r"cannot end \(4 ns\) before it starts \(5 ns\)"),
    ((0, 4, -1), r"items must be an int >= 0 .* got -1"),
    ((0, 4, 2.5), r"items must be an int >= 0 .* got 2.5"),
])
def test_record_call_rejects_bad_values(tmp_path, args, message):
    profiler = Profiler(tmp_path, local_compiled(), training=True, options=options())
    with pytest.raises(ValueError, match=message):
        profiler.record_call(*args)


def test_constructor_rejects_bad_keep_calls_and_sample(tmp_path):
    with pytest.raises(ValueError, match=r"keep_calls must be an int >= 1 .* got 0"):
        Profiler(tmp_path, local_compiled(), training=True, options=options(), keep_calls=0)
    with pytest.raises(TypeError, match=r"sample must be one micro-batch as \(args, kwargs\)"):
        Profiler(tmp_path, local_compiled(), training=True, options=options(), sample=[1])


def test_load_names_what_is_missing(tmp_path):
    with pytest.raises(ValueError, match="is not a directory"):
        load(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="has no summary.json: it is not a pipetorch report"):
        load(tmp_path)


def test_a_report_without_calls(tmp_path):
    profiler = Profiler(tmp_path, process_compiled(), training=True, options=options())
    summary, _, trace = load(profiler.write())
    assert summary["throughput"]["calls"] == 0
    assert summary["throughput"]["items_per_second"] is None
    assert summary["batch"]["micro_batch_size"] is None
    assert [e for e in trace["traceEvents"] if e["ph"] == "X"] == []
    assert "No calls were recorded." in (tmp_path / "report.html").read_text()


def test_a_failing_sizing_forward_still_writes_the_report(tmp_path):
    compiled = local_compiled()  # Linear2 has no forward: the sizing forward raises
    profiler = Profiler(tmp_path, compiled, training=True, options=options(),
                        sample=((1,), {}))
    _, memory, _ = load(profiler.write())
    assert memory["devices"][0]["activations"] is None
    assert memory["activations_method"].startswith("not computed: the sizing forward failed "
                                                   "with NotImplementedError")
