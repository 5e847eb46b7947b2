"""The workers' recorded spans show the schedule that ran: pipelined stages run ahead, sharded do not.

Spans are time.monotonic_ns() stamps taken inside each worker (one system-wide clock), so
they are compared across processes directly; wall time is never used.
"""
from collections import Counter

import pytest
import torch

import pipetorch as poptorch
from fault_cases import registry  # noqa: F401 - the fixture
from fault_cases import HeavyNet, heavy_data, options

pytestmark = pytest.mark.slow

D, G, B, WIDTH = 2, 8, 64, 384
BUNDLE = B * WIDTH * 4  # bytes of the activation (and of its gradient) crossing the stages


def _traces(*, sharded: bool):
    torch.manual_seed(0)
    model = HeavyNet(WIDTH)
    wrapper = poptorch.trainingModel(model, options(D=D, G=G, sharded=sharded),
                                     optimizer=torch.optim.SGD(model.parameters(), lr=0.01))
    try:
        x, y = heavy_data(D * G * B, width=WIDTH)
        wrapper(x, y)  # compiles and warms up
        wrapper(x, y)
        traces = wrapper._compiled.engine.last_trace
    finally:
        wrapper.destroy()
    assert [t.stage for t in traces] == [0, 1]
    return [t.spans for t in traces]


def _compute(spans):
    return [s for s in spans if s.kind in ("F", "B")]


def _by(spans, kind):
    """kind's span of each micro-batch; each micro-batch must have exactly one."""
    counts = Counter(s.micro_batch for s in spans if s.kind == kind)
    assert counts == Counter(range(D * G)), (kind, counts)
    return {s.micro_batch: s for s in spans if s.kind == kind}


def _check_schedule(stages):
    """What holds for every schedule: each stage runs one action at a time; each micro-batch
    has one F and one B per stage, F before B; data flows 0 -> 1 forward and 1 -> 0 backward;
    an iteration's steps come after its backwards and before the next iteration."""
    for spans in stages:
        for before, after in zip(spans, spans[1:]):
            assert before.start <= before.end <= after.start, (before, after)
        forwards, backwards = _by(spans, "F"), _by(spans, "B")
        for m in range(D * G):
            assert forwards[m].end <= backwards[m].start, m
        steps = [s for s in spans if s.kind == "STEP"]
        assert len(steps) == D and all(s.micro_batch is None for s in steps)
        for d, step in enumerate(steps):
            mine = [s for s in _compute(spans) if s.micro_batch // G == d]
            later = [s for s in _compute(spans) if s.micro_batch // G > d]
            assert max(s.end for s in mine) <= step.start
            assert all(step.end <= s.start for s in later)
        # the call's inputs arrive first (H2D), the reply to the host leaves last (D2H)
        assert spans[0].kind == "H2D" and spans[-1].kind == "D2H" and spans[-1].nbytes > 0
        for s in spans[:-1]:
            expected = BUNDLE if s.kind in ("S>F", "R<F", "S<B", "R>B") else 0
            assert s.nbytes == expected or s.kind == "H2D", s
    first, last = stages
    assert first[0].nbytes == D * G * B * WIDTH * 4  # the images, float32
    assert last[0].nbytes == D * G * B * 8  # the labels, int64
    assert Counter(s.kind for s in first) == Counter({"F": D * G, "B": D * G, "S>F": D * G,
                                                      "R>B": D * G, "STEP": D, "H2D": 1,
                                                      "D2H": 1})
    assert Counter(s.kind for s in last) == Counter({"F": D * G, "B": D * G, "R<F": D * G,
                                                     "S<B": D * G, "STEP": D, "H2D": 1,
                                                     "D2H": 1})
    f0, b0, f1, b1 = _by(first, "F"), _by(first, "B"), _by(last, "F"), _by(last, "B")
    for m in range(D * G):
        assert f0[m].end <= f1[m].start  # stage 1 computes on what stage 0 sent
        assert b1[m].end <= b0[m].start  # stage 0's backward needs stage 1's gradient


def _overlap_ns(a, b):
    return max(0, min(a.end, b.end) - max(a.start, b.start))


def test_pipelined_training_lets_stage_0_run_ahead_of_stage_1(registry):
    stages = _traces(sharded=False)
    _check_schedule(stages)
    # Whether the two workers' spans meet in wall time depends on what else the machine runs
    # (a loaded 2-core CI machine may serialise them; benchmarks/ measure the overlap), so the
    # test reads the schedule: stage 0 starts micro-batch m+1's forward before it has m's
    # gradient, that is while stage 1 still works on m, in every step's steady state.
    first = [(s.kind, s.micro_batch) for s in _compute(stages[0])]
    for m in range(D * G):
        if m % G != G - 1:
            assert first.index(("F", m + 1)) < first.index(("B", m)), first


def test_sharded_training_computes_on_one_stage_at_a_time(registry):
    stages = _traces(sharded=True)
    _check_schedule(stages)
    first, last = (_compute(s) for s in stages)
    clashes = [(a, b) for a in first for b in last if _overlap_ns(a, b) > 0]
    assert clashes == []
    # One micro-batch at a time: F0 F1 B1 B0 of micro-batch m all end before m+1 starts.
    order = sorted([(s.start, 0, s) for s in first] + [(s.start, 1, s) for s in last],
                   key=lambda t: t[0])
    assert [(stage, s.kind, s.micro_batch) for _, stage, s in order] == [
        (stage, kind, m) for m in range(D * G)
        for stage, kind in ((0, "F"), (1, "F"), (1, "B"), (0, "B"))]
