"""Interleaved 1F1B: device plans for stages round-robin over the devices, no processes."""
import pytest

from pipetorch.schedule import device_plans, interleaved
from pipetorch.schedule.actions import Kind
from pipetorch.schedule.simulator import check
from pipetorch.schedule.device_plans import check_devices, merge, simulate_devices
from helpers.grid import render
from pipetorch.schedule.plans import one_f_one_b, plan


def round_robin(devices: int, per_device: int) -> tuple[int, ...]:
    return tuple(s % devices for s in range(devices * per_device))


SHAPES = [(n, v, g) for n in (2, 3, 4) for v in (2, 3) for g in range(1, 17)
          if interleaved.round_size(g, n)]


@pytest.mark.parametrize("split", [False, True], ids=["1f1b", "zero_bubble"])
@pytest.mark.parametrize("n, v, g", SHAPES)
def test_every_shape_is_deadlock_free_and_does_each_stages_work_once(n, v, g, split):
    owners = round_robin(n, v)
    device_plan = device_plans.interleaved_plan(n * v, g, owners, split=split)
    # rendezvous transfers (the strictest), and per stage in dependency order
    report = check_devices(device_plan, owners, backward=2)
    assert report.micro_batches == g
    for d, actions in enumerate(device_plan):
        assert {a.stage for a in actions} == set(device_plans.stages_of(owners, d))
        assert actions[-1].kind is Kind.STEP
        assert (Kind.BACKWARD_WEIGHT in {a.kind for a in actions}) == split


@pytest.mark.parametrize("n, v, g", [(2, 2, 8), (2, 3, 8), (3, 2, 6), (4, 2, 8), (2, 2, 10)])
def test_the_bubble_shrinks_by_the_stages_per_device(n, v, g):
    # forward 1 tick, backward 2, buffered transfers as the workers' links are
    owners = round_robin(n, v)
    timeline = simulate_devices(device_plans.interleaved_plan(n * v, g, owners), owners, backward=2,
                                buffered=True)
    work = 3 * v * g  # each device: v stages' forward and backward of every micro-batch
    assert timeline.makespan == work + 3 * (n - 1)  # the ramp: one stage's F + B per device
    # the same blocks as one stage per device (v times the work each) under 1F1B
    one_stage_each = check(one_f_one_b(n, g), forward=v, backward=2 * v)
    assert one_stage_each.makespan == work + 3 * v * (n - 1)
    assert timeline.bubble_fraction < one_stage_each.bubble_fraction


def test_the_grid_in_the_module_docstring_is_what_render_draws():
    owners = (0, 1, 0, 1)
    drawn = render(simulate_devices(device_plans.interleaved_plan(4, 4, owners), owners, backward=2,
                                    buffered=True), unit="device")
    shown = [line.strip().removesuffix(" ...") for line in interleaved.__doc__.splitlines()
             if " | " in line]
    assert len(shown) == 2
    for line, start in zip(drawn.splitlines(), shown):
        assert line.startswith(start)
    merged = simulate_devices(merge(one_f_one_b(4, 4), owners), owners, backward=2,
                              buffered=True)
    assert (len(drawn.splitlines()[0].split()) - 3, merged.makespan) == (27, 28)


def test_the_zero_bubble_variant_is_shorter_still():
    owners = round_robin(2, 2)
    costs = dict(forward=1, backward=1, weight=1, buffered=True)
    split = simulate_devices(device_plans.interleaved_plan(4, 8, owners, split=True), owners, **costs)
    whole = simulate_devices(device_plans.interleaved_plan(4, 8, owners), owners, **{**costs, "backward": 2})
    assert split.makespan < whole.makespan


def test_other_placements_and_ragged_rounds_fall_back_to_one_f_one_b():
    assert interleaved.fits((0, 1, 0, 1), 8) and interleaved.fits((0, 1, 2, 0, 1, 2), 9)
    for owners in [(0, 1), (0, 0, 1, 1), (0, 1, 0), (0, 1, 1, 0), (0, 0, 0, 0)]:
        assert not interleaved.fits(owners, 8)
        assert device_plans.runs("interleaved", owners, 8) == "pipelined"
        assert device_plans.device_plan("interleaved", len(owners), 8, owners, training=True) == \
            merge(plan("1f1b", len(owners), 8, training=True), owners)
    # 5 micro-batches over 2 devices: no even rounds (a ragged one deadlocks)
    assert device_plans.runs("interleaved_zero_bubble", (0, 1, 0, 1), 5) == "zero_bubble"
    with pytest.raises(ValueError, match=r"round-robin on 2\+ devices"):
        device_plans.interleaved_plan(4, 5, (0, 1, 0, 1))
    # inference is fill-drain whatever the training schedule
    assert device_plans.device_plan("interleaved", 4, 8, (0, 1, 0, 1), training=False) == \
        merge(plan("fill_drain", 4, 8, training=False), (0, 1, 0, 1))


def test_choose_takes_interleaving_where_it_is_shorter():
    costs = dict(forward=5, backward=5, weight=5, whole=8)
    assert device_plans.choose(4, 8, (0, 1, 0, 1), **costs)[0] == "interleaved"
    assert device_plans.choose(4, 8, (0, 1, 0, 1))[0] == "interleaved_zero_bubble"
    kind, bubble = device_plans.choose(6, 9, (0, 1, 2, 0, 1, 2), **costs)
    assert kind == "interleaved" and 0 < bubble < 0.2
    assert device_plans.choose(4, 8, (0, 0, 1, 1), **costs)[0] in ("pipelined", "zero_bubble")
