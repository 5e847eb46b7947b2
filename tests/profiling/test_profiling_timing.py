"""Time accounting on synthetic spans: per-device times, the bubble and concurrency."""
import pytest
from profiling_fakes import MS, ideal_traces

from pipetorch.parallel.comm.payloads import Span, Trace
from pipetorch.profiling.timing import (
    CallRecord, concurrency, device_times, measured_bubble, theoretical_bubble, timing_summary,
)
from pipetorch.schedule.plans import Batching


def call(traces, index=0):
    spans = [s for t in traces for s in t.spans]
    return CallRecord(index, min(s.start for s in spans) - MS, max(s.end for s in spans) + MS,
                      8, tuple(traces))


def test_device_times_split_compute_transfer_step_and_idle():
    traces = [Trace(0, [Span("F", 0, 0, 2 * MS), Span("S>F", 0, 2 * MS, 3 * MS, 100),
                        Span("STEP", None, 9 * MS, 10 * MS)]),
              Trace(1, [Span("R<F", 0, 0, 3 * MS, 100), Span("F", 0, 3 * MS, 5 * MS),
                        Span("B", 0, 5 * MS, 8 * MS)])]
    times = device_times([call(traces)], 2)
    assert [(t.window, t.compute, t.transfer, t.step, t.untracked, t.idle) for t in times] == [
        (10 * MS, 2 * MS, MS, MS, 6 * MS, 8 * MS), (10 * MS, 5 * MS, 3 * MS, 0, 2 * MS, 5 * MS)]
    assert times[0].utilisation == pytest.approx(0.2)
    assert measured_bubble(times) == pytest.approx(1 - 7 / 20)
    row = times[1].as_dict()
    assert (row["idle_ms"], row["untracked_ms"], row["idle_fraction"]) == pytest.approx(
        (5.0, 2.0, 0.5))


@pytest.mark.parametrize("stages,micro_batches", [(2, 4), (3, 6), (4, 8)])
def test_an_ideal_pipelined_call_measures_the_theoretical_bubble(stages, micro_batches):
    traces = ideal_traces("pipelined", stages, micro_batches, iterations=2)
    times = device_times([call(traces)], stages)
    expected = (stages - 1) / (micro_batches + stages - 1)
    assert measured_bubble(times) == pytest.approx(expected)
    fraction, formula = theoretical_bubble("pipelined", stages, micro_batches, training=True)
    assert fraction == pytest.approx(expected)
    assert formula == f"(S-1)/(G+S-1) = {stages - 1}/{micro_batches + stages - 1}"


def test_sharded_bubble_and_no_concurrency():
    traces = ideal_traces("sharded", 2, 4)
    assert measured_bubble(device_times([call(traces)], 2)) == pytest.approx(0.5)
    assert theoretical_bubble("sharded", 2, 4, training=True) == (0.5, "(S-1)/S = 1/2")
    assert concurrency([call(traces)]) == 0.0


def test_concurrency_counts_time_with_two_devices_computing():
    traces = [Trace(0, [Span("F", 0, 0, 4 * MS), Span("B", 0, 4 * MS, 6 * MS)]),
              Trace(1, [Span("F", 1, 3 * MS, 5 * MS), Span("R<F", 2, 5 * MS, 10 * MS)])]
    assert concurrency([call(traces)]) == pytest.approx(2 / 10)  # 3..5 ms of a 0..10 ms window
    pipelined = ideal_traces("pipelined", 2, 4)
    assert concurrency([call(pipelined)]) > 0


def test_calls_without_spans_have_no_bubble_and_a_note():
    record = CallRecord(0, 0, 5 * MS, 4)
    summary = timing_summary([record], stages=1, schedule="local", batching=Batching(1, 1, 1),
                             training=True)
    assert summary["spans"] is False and summary["per_device"] == []
    assert summary["bubble"]["measured"] is None and summary["bubble"]["theoretical"] is None
    assert "need the stages on several devices" in summary["note"]
    assert summary["host_call_ms"] == pytest.approx(5.0)


def test_unknown_span_kind_is_rejected():
    traces = [Trace(0, [Span("X", 0, 0, MS)])]
    with pytest.raises(ValueError, match="Unknown span kind 'X'"):
        device_times([call(traces)], 1)


def test_plan_size_is_g_times_r_in_training_and_d_times_r_in_inference():
    summary = timing_summary([], stages=2, schedule="pipelined", batching=Batching(3, 4, 2),
                             training=True)
    assert summary["bubble"]["micro_batches_per_plan"] == 8
    assert summary["bubble"]["theoretical"] == pytest.approx(1 / 9)
    inference = timing_summary([], stages=2, schedule="pipelined", batching=Batching(3, 1, 2),
                               training=False)
    assert inference["bubble"]["micro_batches_per_plan"] == 6
    assert inference["bubble"]["theoretical"] == pytest.approx(1 / 7)


def test_an_interleaved_bubble_is_simulated_on_the_devices():
    # ipus 0,1,0,1, G=8: each device computes 2 x 8 x (1 + 2) ticks and waits one stage's 3
    fraction, formula = theoretical_bubble("interleaved", 4, 8, training=True,
                                           owners=(0, 1, 0, 1))
    assert fraction == pytest.approx(3 / 51)
    assert formula == "(N-1)/(VG+N-1) = 1/17 without the split"
    # stages not round-robin: the 1F1B that runs instead
    assert theoretical_bubble("interleaved", 2, 8, training=True, owners=(0, 1))[0] == \
        pytest.approx(1 / 9)
