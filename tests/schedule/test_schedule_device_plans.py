"""Device plans: several stages per device, interleaved from the per-stage plans, no processes."""
import pytest

import pipetorch.schedule.device_plans as device_plans
from pipetorch.schedule.actions import Action, Kind
from pipetorch.schedule.simulator import DeadlockError, ScheduleError, check
from pipetorch.schedule.device_plans import (check_devices, merge, owners_of, project,
                                        simulate_devices, stages_of)
from helpers.grid import render
from pipetorch.schedule.plans import fill_drain, one_f_one_b, plan

KINDS = [("1f1b", True), ("zero_bubble", True), ("fill_drain", True), ("fill_drain", False), ("sharded", True),
         ("sharded", False)]
# ipus 0,1,0 (AutoIncrement's interleaving), 6 blocks on 2 ipus, 0,1,0,1, all on one device
LAYOUTS = [(0, 1, 0), (0, 0, 0, 1, 1, 1), (0, 1, 0, 1), (0, 0, 0), (0, 1, 1, 0)]


def short(device_plan):
    return [" ".join(f"{a.stage}:{a}" for a in actions) for actions in device_plan]


def test_owners_number_the_distinct_ipus_in_order():
    assert owners_of([0, 1, 0]) == (0, 1, 0)
    assert owners_of([2, 2, 5, 3]) == (0, 0, 2, 1)
    assert stages_of((0, 1, 0, 1), 1) == (1, 3)


def test_ipus_0_1_0_interleave_stages_0_and_2_on_device_0():
    # Inference, fill-drain: stage 2 runs on device 0 as soon as stage 1 hands it a micro-batch.
    assert short(merge(fill_drain(3, 3, training=False), (0, 1, 0))) == [
        "0:F0 0:S>F0 0:F1 2:R<F0 0:S>F1 2:F0 2:R<F1 0:F2 0:S>F2 2:F1 2:R<F2 2:F2",
        "1:R<F0 1:F0 1:S>F0 1:R<F1 1:F1 1:S>F1 1:R<F2 1:F2 1:S>F2",
    ]


def test_consecutive_stages_on_one_device_hand_over_in_memory():
    # Both stages on device 0: each send is followed at once by its receive, in one list.
    assert short(merge(one_f_one_b(2, 2), (0, 0))) == [
        "0:F0 0:S>F0 1:R<F0 1:F0 0:F1 1:B0 1:S<B0 0:R>B0 0:S>F1 1:R<F1 1:F1 0:B0 1:B1 "
        "1:S<B1 0:R>B1 0:B1 0:STEP"]


def test_the_grid_in_the_module_docstring_is_what_render_draws():
    owners = (0, 1, 0)
    grid = render(simulate_devices(merge(one_f_one_b(3, 3), owners), owners), unit="device")
    assert all(f"    {line}\n" in device_plans.__doc__ for line in grid.splitlines())
    assert grid.splitlines()[0] == ("device 0 | 0:F0 0:F1 2:F0 0:F2 2:B0 2:F1 2:B1 0:B0 2:F2 "
                                    "2:B2 0:B1 0:B2")


@pytest.mark.parametrize("stages", [1, 2, 5])
@pytest.mark.parametrize("kind,training", KINDS)
def test_one_stage_a_device_is_the_per_stage_plan_that_merging_gives_back(kind, training, stages):
    # device_plan no longer merges one stage a device: 32 stages' merge took seconds of a search
    owners, G = tuple(range(stages)), 2 * stages + 1
    assert device_plans.device_plan(kind, stages, G, owners, training=training) == merge(
        plan(kind, stages, G, training=training), owners)


@pytest.mark.parametrize("owners", LAYOUTS)
@pytest.mark.parametrize("kind,training", KINDS)
def test_every_merged_plan_is_deadlock_free_and_keeps_each_stages_order(kind, training, owners):
    stages = len(owners)
    per_stage = plan(kind, stages, 2 * stages - 1, training=training)
    device_plan = merge(per_stage, owners)
    report = check_devices(device_plan, owners)
    assert report.timeline.stages == max(owners) + 1  # one row per device
    # each stage runs its actions in the per-stage plan's order, one STEP per device
    assert project(device_plan, owners) == per_stage
    for d, actions in enumerate(device_plan):
        assert {a.stage for a in actions} == set(stages_of(owners, d))
        assert [a.kind for a in actions].count(Kind.STEP) == int(training)


@pytest.mark.parametrize("owners", LAYOUTS)
def test_zero_bubble_merged_onto_devices_is_no_longer_than_one_f_one_b(owners):
    stages = len(owners)
    zb = check_devices(merge(plan("zero_bubble", stages, 2 * stages, training=True), owners),
                       owners)
    f1b = check_devices(merge(one_f_one_b(stages, 2 * stages), owners, backward=2), owners,
                        backward=2)
    assert zb.makespan <= f1b.makespan
    if len(set(owners)) == stages:  # a device per stage: strictly shorter
        assert zb.makespan < f1b.makespan


def test_choose_takes_zero_bubble_where_the_simulator_finds_it_shorter():
    # a device per stage: splitting the backward shortens the drain
    assert device_plans.choose(2, 6, (0, 1))[0] == "zero_bubble"
    assert device_plans.choose(4, 8, (0, 1, 2, 3), forward=2, backward=3, weight=1)[0] == "zero_bubble"
    # one device runs every stage back to back: no bubble to fill, so 1F1B (fewer graphs held)
    assert device_plans.choose(3, 6, (0, 0, 0))[0] == "pipelined"
    assert device_plans.choose(1, 4, (0,))[0] == "pipelined"
    # splitting costs extra work (B + W = 10 ticks against 8): worth it only for a big bubble
    costs = dict(forward=5, backward=5, weight=5, whole=8)
    assert device_plans.choose(2, 10, (0, 1), **costs)[0] == "pipelined"   # 143 against 160 ticks
    assert device_plans.choose(4, 4, (0, 1, 2, 3), **costs)[0] == "zero_bubble"  # 90 against 91


def test_a_device_holding_two_stages_is_never_idle_with_ipus_0_1_0():
    G = 8
    report = check_devices(merge(one_f_one_b(3, G), (0, 1, 0)), (0, 1, 0))
    assert report.makespan == report.timeline.busy(0) == 2 * G * 2  # F and B of two stages


def test_six_blocks_on_two_devices_pipeline_like_two_stages_three_times_as_long():
    G = 11
    report = check_devices(merge(one_f_one_b(6, G), (0, 0, 0, 1, 1, 1)), (0, 0, 0, 1, 1, 1))
    two_stages = check(one_f_one_b(2, G), forward=3, backward=3).makespan  # 72 ticks
    assert report.timeline.busy(0) == report.timeline.busy(1) == 3 * G * 2
    assert report.makespan <= two_stages * 1.05, (report.makespan, two_stages)


def test_devices_posting_their_transfers_in_opposite_orders_deadlock():
    device_plan = merge(fill_drain(3, 2, training=False), (0, 1, 0))
    sends = [a for a in device_plan[1] if a.kind is Kind.SEND_ACT]
    swapped = [sends[1] if a == sends[0] else sends[0] if a == sends[1] else a
               for a in device_plan[1]]
    with pytest.raises(DeadlockError, match="device 0 waits .* device 1 waits"):
        check_devices([device_plan[0], swapped], (0, 1, 0))


def test_a_hand_over_received_before_it_is_sent_deadlocks():
    device_plan = merge(fill_drain(2, 1, training=False), (0, 0))
    assert short(device_plan) == ["0:F0 0:S>F0 1:R<F0 1:F0"]
    send, receive = device_plan[0][1], device_plan[0][2]
    with pytest.raises(DeadlockError, match="device 0 waits at action 1"):
        simulate_devices([[device_plan[0][0], receive, send, device_plan[0][3]]], (0, 0))


def test_check_devices_refuses_misplaced_missing_and_early_steps():
    owners = (0, 1, 0)
    good = merge(one_f_one_b(3, 5), owners)
    with pytest.raises(ScheduleError, match=r"Device 1 holds stages \[1\] but its list has F0 "
                                            "of stage 2"):
        check_devices([good[0], [Action(Kind.FORWARD, 2, 0), *good[1]]], owners)
    with pytest.raises(ScheduleError, match="Stage 2 .* lacks \\['B4'\\]"):
        check_devices([[a for a in good[0] if a != Action(Kind.BACKWARD, 2, 4)], good[1]],
                      owners)
    with pytest.raises(ScheduleError, match="Device 0 must run one STEP, last"):
        check_devices([[good[0][-1], *good[0][:-1]], good[1]], owners)
    with pytest.raises(ScheduleError, match="named for its first, 0, not 2"):
        check_devices([[*good[0][:-1], Action(Kind.STEP, 2)], good[1]], owners)


def test_owners_must_cover_the_stages_and_number_devices_from_zero():
    with pytest.raises(ScheduleError, match="for each of the plan's 3 stages, got \\[0, 1\\]"):
        merge(one_f_one_b(3, 5), (0, 1))
    with pytest.raises(ScheduleError, match=r"Devices \[1\] hold no stage"):
        merge(one_f_one_b(2, 3), (0, 2))
