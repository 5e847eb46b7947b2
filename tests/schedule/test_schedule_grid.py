"""ASCII grids of schedules, as drawn in docs and reports."""
import pipetorch.schedule.plans as plans
from pipetorch.schedule.simulator import simulate
from helpers.grid import render


def test_one_f_one_b_grid():
    assert render(plans.one_f_one_b(2, 3)) == (
        "stage 0 | F0 F1  . B0 F2 B1  . B2\n"
        "stage 1 |  . F0 B0 F1 B1 F2 B2  .")


def test_grid_of_a_timeline_and_backwards_twice_as_long():
    timeline = simulate(plans.fill_drain(2, 2, training=True), backward=2)
    assert render(timeline) == render(plans.fill_drain(2, 2, training=True), backward=2) == (
        "stage 0 | F0 F1  .  .  . B0 B0 B1 B1\n"
        "stage 1 |  . F0 F1 B0 B0 B1 B1  .  .")


def test_cells_keep_columns_aligned_past_ten_micro_batches():
    rows = render(plans.fill_drain(11, 11, training=False)).splitlines()
    assert rows[0].startswith("stage 0  |  F0  F1  F2")
    assert rows[10].endswith("  F9 F10")
    assert rows[10].startswith("stage 10 |   .   .")
    assert len({len(r) for r in rows}) == 1


def test_the_timeline_in_the_plans_docstring_is_what_render_draws():
    for line in render(plans.one_f_one_b(3, 6)).splitlines():
        assert "    " + line + "\n" in plans.__doc__
