"""Simulated runs of every schedule: deadlock freedom, dependency order, stash and bubble."""
import pytest

from pipetorch.schedule.actions import Action, Kind
from pipetorch.schedule.simulator import DeadlockError, ScheduleError, check, simulate
from pipetorch.schedule.plans import fill_drain, one_f_one_b, plan, sharded, zero_bubble

SIZES = [(s, g) for s in (2, 4) for g in (s, 2 * s, 4 * s)]


@pytest.mark.parametrize("stages,micro_batches", SIZES)
@pytest.mark.parametrize("kind,training", [("1f1b", True), ("zero_bubble", True),
                                           ("fill_drain", True),
                                           ("fill_drain", False), ("sharded", True),
                                           ("sharded", False)])
def test_every_schedule_is_deadlock_free_and_ordered(kind, training, stages, micro_batches):
    report = check(plan(kind, stages, micro_batches, training=training))
    assert report.training is training
    assert report.micro_batches == micro_batches


@pytest.mark.parametrize("stages,micro_batches", SIZES)
@pytest.mark.parametrize("forward,backward", [(1, 1), (1, 2)])
def test_one_f_one_b_stash_bubble_and_length(stages, micro_batches, forward, backward):
    report = check(one_f_one_b(stages, micro_batches), forward=forward, backward=backward)
    assert report.peak_stash == tuple(stages - i for i in range(stages))
    assert report.makespan == (micro_batches + stages - 1) * (forward + backward)
    assert report.bubble_fraction == pytest.approx(
        (stages - 1) / (micro_batches + stages - 1))


@pytest.mark.parametrize("stages,micro_batches", SIZES)
@pytest.mark.parametrize("forward,backward,weight", [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1)])
def test_zero_bubble_is_shorter_than_one_f_one_b(stages, micro_batches, forward, backward,
                                                 weight):
    # 1F1B runs each backward whole (backward + weight ticks); ZB-H1 splits it, and its bubble
    # is (S-1)(f+b) instead of (S-1)(f+b+w), holding S graphs per stage, 1F1B's stage 0's.
    zb = check(zero_bubble(stages, micro_batches), forward=forward, backward=backward,
               weight=weight)
    f1b = check(one_f_one_b(stages, micro_batches), forward=forward, backward=backward + weight)
    work = forward + backward + weight
    assert zb.makespan == micro_batches * work + (stages - 1) * (forward + backward)
    assert f1b.makespan == (micro_batches + stages - 1) * work
    assert zb.makespan < f1b.makespan and zb.bubble_fraction < f1b.bubble_fraction
    assert zb.peak_stash == (stages,) * stages


def test_zero_bubble_any_size_is_deadlock_free_and_never_longer():
    for stages in range(1, 6):
        for micro_batches in range(1, 11):
            zb = check(zero_bubble(stages, micro_batches))
            f1b = check(one_f_one_b(stages, micro_batches), backward=2)
            assert zb.makespan <= f1b.makespan


def test_a_split_backward_needs_every_w_after_its_b():
    p = zero_bubble(2, 2)
    w0 = Action(Kind.BACKWARD_WEIGHT, 1, 0)
    with pytest.raises(ScheduleError, match=r"lacks \['W0'\]"):
        check([p[0], [a for a in p[1] if a != w0]])
    early = [a for a in p[1] if a != w0]
    early.insert(0, w0)  # W0 before B0: nothing to compute yet
    with pytest.raises(ScheduleError, match=r"Stage 1 runs W0 \(action 0\) before B0"):
        check([p[0], early])


@pytest.mark.parametrize("stages,micro_batches", SIZES)
def test_fill_drain_has_the_same_length_but_stashes_more(stages, micro_batches):
    for forward, backward in ((1, 1), (1, 2)):
        fd = check(fill_drain(stages, micro_batches, training=True),
                   forward=forward, backward=backward)
        f1b = check(one_f_one_b(stages, micro_batches), forward=forward, backward=backward)
        assert fd.makespan == f1b.makespan
        assert fd.bubble_fraction == pytest.approx((stages - 1) / (micro_batches + stages - 1))
    assert fd.peak_stash == (micro_batches,) * stages
    assert all(a <= b for a, b in zip(f1b.peak_stash, fd.peak_stash))
    assert sum(f1b.peak_stash) < sum(fd.peak_stash)


@pytest.mark.parametrize("stages,micro_batches", SIZES)
def test_fill_drain_inference_bubble(stages, micro_batches):
    report = check(fill_drain(stages, micro_batches, training=False))
    assert report.makespan == micro_batches + stages - 1
    assert report.peak_stash == (0,) * stages
    assert report.bubble_fraction == pytest.approx((stages - 1) / (micro_batches + stages - 1))


@pytest.mark.parametrize("stages,micro_batches", SIZES)
@pytest.mark.parametrize("training", [True, False])
def test_sharded_keeps_one_stage_busy_at_a_time(stages, micro_batches, training):
    timeline = simulate(sharded(stages, micro_batches, training=training), backward=2)
    busy = [tick for row in timeline.events for e in row if e.action.kind.is_compute
            for tick in range(e.start, e.end)]
    assert len(busy) == len(set(busy))
    per_micro_batch = stages * (1 + 2 * training)
    assert timeline.makespan == micro_batches * per_micro_batch == len(busy)


def test_any_stage_and_micro_batch_count_is_deadlock_free():
    for stages in range(1, 6):
        for micro_batches in range(1, 11):
            report = check(one_f_one_b(stages, micro_batches))
            assert report.peak_stash == tuple(min(stages - i, micro_batches)
                                              for i in range(stages))


def test_sending_activations_before_receiving_the_gradient_deadlocks():
    p = one_f_one_b(2, 3)
    # The natural-looking order F1, S>F1, R>B0 waits for stage 1, which waits to send B0.
    i = p[0].index(Action(Kind.RECV_GRAD, 0, 0, 1))
    p[0][i], p[0][i + 1] = p[0][i + 1], p[0][i]
    with pytest.raises(DeadlockError) as info:
        simulate(p)
    assert str(info.value) == (
        "The schedule deadlocks: stage 0 waits at action 3 S>F1 for stage 1, which is at "
        "S<B0 (action 3); pending on stage 0: S>F1 R>B0 B0 F2 R>B1 S>F2; stage 1 waits at "
        "action 3 S<B0 for stage 0, which is at S>F1 (action 3); pending on stage 1: S<B0 "
        "R<F1 F1 B1 S<B1 R<F2. Each pair of neighbouring stages must post their sends and "
        "receives in the same order.")


def test_a_receive_nobody_sends_deadlocks_naming_the_finished_peer():
    p = fill_drain(2, 1, training=False)
    p[1].append(Action(Kind.RECV_ACT, 1, 1, 0))
    with pytest.raises(DeadlockError, match="stage 1 waits at action 2 R<F1 for stage 0, "
                                            "which has finished"):
        simulate(p)


def test_check_rejects_missing_and_misordered_work():
    p = one_f_one_b(2, 2)
    p[1].remove(Action(Kind.BACKWARD, 1, 1))
    with pytest.raises(ScheduleError, match=r"Stage 1 of a training plan with 2 micro-batches "
                                            r"has unexpected actions \[\] and lacks \['B1'\]"):
        check(p)
    p = one_f_one_b(2, 2)
    assert [str(a) for a in p[0][6:8]] == ["R>B1", "B1"]
    p[0][6], p[0][7] = p[0][7], p[0][6]  # B1 before R>B1: would run without its gradient
    with pytest.raises(ScheduleError, match=r"Stage 0 runs B1 \(action 6\) before R>B1 "
                                            r"\(action 7\), which it depends on"):
        check(p)
    p = one_f_one_b(2, 2)
    p[0].insert(0, p[0].pop())
    with pytest.raises(ScheduleError, match="Stage 0 must end with STEP after its backwards, "
                                            "got B1 last"):
        check(p)


def test_malformed_plans_are_rejected():
    with pytest.raises(ScheduleError, match=r"plan\[1\] holds .*not an Action of stage 1"):
        simulate([[Action(Kind.FORWARD, 0, 0)], [Action(Kind.FORWARD, 0, 0)]])
    with pytest.raises(ScheduleError, match="names peer stage 1 but the plan has 1 stages"):
        simulate([[Action(Kind.SEND_ACT, 0, 0, 1)]])
    with pytest.raises(ValueError, match="backward cost must be an int >= 0 ticks, got 1.5"):
        simulate(one_f_one_b(2, 2), backward=1.5)


def test_transfers_can_take_time():
    timeline = simulate(sharded(2, 1, training=True), transfer=1)
    # F0 [0,1], S>F0 [1,2], F0 [2,3], B0 [3,4], S<B0 [4,5], B0 [5,6]
    assert [(str(e.action), e.start, e.end) for e in timeline.events[0]] == [
        ("F0", 0, 1), ("S>F0", 1, 2), ("R>B0", 4, 5), ("B0", 5, 6), ("STEP", 6, 6)]
    assert timeline.makespan == 6
    assert timeline.bubble_fraction == pytest.approx(1 - 4 / 12)
