"""pipelineSchedule("auto") after the first call: tick costs from the measured spans."""
from pipetorch.parallel.engine import measured_costs
from pipetorch.parallel.stage import Span, Trace

MS = 1_000_000


def _trace(stage, kinds):
    spans, t = [], 0
    for m, (kind, ms) in enumerate(kinds):
        spans.append(Span(kind, m, t, t + ms * MS))
        t += ms * MS
    return Trace(stage, spans)


def test_a_whole_backward_is_priced_in_parts_as_the_split_costs_say():
    traces = [_trace(0, [("F", 2), ("F", 2), ("B", 4), ("B", 4), ("S>F", 9)]),
              _trace(1, [("F", 2), ("B", 4), ("STEP", 50)])]
    # B = 2 F; split, its parts would take 4 x 10/8 between them
    assert measured_costs(traces) == dict(forward=10, backward=12, weight=12, whole=20)


def test_a_split_backward_prices_the_whole_one_from_its_parts():
    traces = [_trace(0, [("F", 2), ("B", 2), ("W", 3)])]
    assert measured_costs(traces) == dict(forward=10, backward=10, weight=15, whole=20)


def test_no_spans_no_costs():
    assert measured_costs([Trace(0, [])]) is None
