"""pipelineSchedule("auto") after the first call: per-stage tick costs from the measured spans."""
from pipetorch.parallel.host.schedule_choice import measured_costs
from pipetorch.parallel.comm.payloads import Span, Trace
from pipetorch.schedule import device_plans

MS = 1_000_000


def _trace(stage, kinds):
    spans, t = [], 0
    for m, (kind, ms) in enumerate(kinds):
        spans.append(Span(kind, m, t, t + ms * MS))
        t += ms * MS
    return Trace(stage, spans)


def test_a_whole_backward_is_priced_in_parts_as_the_split_costs_say():
    traces = [_trace(0, [("F", 2), ("F", 2), ("B", 4), ("B", 4), ("S>F", 9)]),
              _trace(1, [("F", 4), ("B", 8), ("STEP", 50)])]
    # the stages' median forward (3 ms) is 10 ticks; split, a backward's parts would take
    # 10/8 of it between them
    assert measured_costs(traces) == dict(forward=(7, 13), backward=(8, 17), weight=(8, 17),
                                          whole=(13, 27))


def test_a_split_backward_prices_the_whole_one_from_its_parts():
    traces = [_trace(0, [("F", 2), ("B", 2), ("W", 3)])]
    assert measured_costs(traces) == dict(forward=(10,), backward=(10,), weight=(15,),
                                          whole=(20,))


def test_no_spans_no_costs():
    assert measured_costs([Trace(0, [])]) is None


def test_measured_unbalanced_stages_steer_auto_away_from_interleaving():
    # seed 000's CNN blocks on ipus 0,1,0,1 (benchmarks/pipeline.py): two heavy stages, two
    # light ones; interleaved rounds assume balanced ones and wait
    split = (8, 14, 4, 3)  # each part of a split backward: 1.2x the whole one between them
    costs = dict(forward=(25, 13, 3, 3), whole=(12, 22, 6, 4), backward=split, weight=split)
    assert device_plans.choose(4, 10, (0, 1, 0, 1), **costs)[0] in ("pipelined", "zero_bubble")
    balanced = dict(forward=10, whole=20, backward=12, weight=12)
    assert device_plans.choose(4, 10, (0, 1, 0, 1), **balanced)[0] == "interleaved"
