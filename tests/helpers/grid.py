"""Draws a schedule as an ASCII grid: one row per stage, one column per tick."""
from __future__ import annotations

from pipetorch.schedule.actions import Plan
from pipetorch.schedule.simulator import Timeline, simulate

__all__: list[str] = []

IDLE = "."


def render(schedule: Plan | Timeline, *, forward: int = 1, backward: int = 1,
           unit: str = "stage") -> str:
    """The grid of `schedule` ("F3" forward, "B3" backward, "." idle), simulating a plan first.

    A backward costing 2 ticks fills two cells. Transfers take no time and are not drawn.
    With `unit="device"` (a timeline of `devices.simulate_devices`) each row is a device and
    a cell names the stage too: "2:F3" is stage 2's forward of micro-batch 3.
    """
    timeline = schedule if isinstance(schedule, Timeline) else simulate(
        schedule, forward=forward, backward=backward)
    cells = [[IDLE] * timeline.makespan for _ in range(timeline.stages)]
    for s, row in enumerate(timeline.events):
        for event in row:
            if event.action.kind.is_compute:
                for tick in range(event.start, event.end):
                    cells[s][tick] = (str(event.action) if unit == "stage"
                                      else f"{event.action.stage}:{event.action}")
    width = max((len(c) for row in cells for c in row), default=1)
    label = len(f"{unit} {timeline.stages - 1}")
    return "\n".join(
        f"{f'{unit} {s}':<{label}} | " + " ".join(c.rjust(width) for c in row)
        for s, row in enumerate(cells))
