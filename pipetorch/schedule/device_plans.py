"""Stages sharing a device: one action list per device, merged from the per-stage plan.

Each logical device (an `ipu_id`) has one worker that runs every stage placed on it, one
action at a time. `merge` turns a plan (one list per stage) into a device plan (one list per
device): it runs the devices on a simulated clock and, whenever a device is free, gives it
the next action of whichever of its stages the per-stage plan meant to run first. A transfer
between two stages of one device is a hand-over in memory (its send comes first, its receive
right after); a transfer between devices is posted in the same order on both sides.

AutoIncrement with blocks on ipus 0, 1, 0 (stage 2 back on device 0), 1F1B, G=3 to fit the
page (training asks for G >= 5), from the tests' `render(simulate_devices(merge(one_f_one_b(3, 3),
(0, 1, 0)), (0, 1, 0)), unit="device")`; a cell names stage:micro-batch. Device 0 does twice
device 1's work and is never idle:

    device 0 | 0:F0 0:F1 2:F0 0:F2 2:B0 2:F1 2:B1 0:B0 2:F2 2:B2 0:B1 0:B2
    device 1 |    . 1:F0 1:F1    .    . 1:B0 1:F2 1:B1    .    . 1:B2    .

Interleaved schedules are not merged but built per device: `interleaved.py` gives each
device's compute order and `serialize` adds the transfers (`interleaved_plan`); `device_plan`
gives any kind's device plan, and `choose` the kind the simulator finishes first.

Whole-step actions (STEP, and the ALL_REDUCE / TIED_REDUCE the worker adds with replicas / with
a weight tied across devices) cover every stage of the device: a device plan has one of each,
named for the device's first stage.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence

from pipetorch.schedule import interleaved, plans
from pipetorch.schedule.actions import Action, Kind, Plan
from pipetorch.schedule.simulator import (DeadlockError, Event, Report, ScheduleError, Timeline,
                                       check, simulate)

__all__: list[str] = []

DevicePlan = list[list[Action]]
"""`device_plan[d]` is the ordered action list of device d, over every stage it holds."""

INTERLEAVED = ("interleaved", "interleaved_zero_bubble")
_TIES = {Kind.SEND_ACT: 0, Kind.SEND_GRAD: 1}  # sends at one instant: activations first
_SENDS = (Kind.SEND_ACT, Kind.SEND_GRAD, Kind.SEND_DONE)


def owners_of(ipus: Sequence[int]) -> tuple[int, ...]:
    """Each stage's device: its ipu's place among the distinct ipus (ipus 0,1,0 -> 0,1,0;
    ipus 2,2,5 -> 0,0,1)."""
    order = sorted(set(ipus))
    return tuple(order.index(i) for i in ipus)


def stages_of(owners: Sequence[int], device: int) -> tuple[int, ...]:
    """The stages device `device` holds, in pipeline order."""
    return tuple(s for s, d in enumerate(owners) if d == device)


def merge(plan: Plan, owners: Sequence[int], *, backward: int = 1) -> DevicePlan:
    """The device plan running `plan` with stage s on device `owners[s]`.

    A free device runs the action of its stages that the per-stage timeline (`simulate`)
    starts earliest, the later stage first on a tie (so a micro-batch goes on through the
    device's consecutive stages). A send fires when its device reaches it and its peer's
    receive is next; the receiving device waits for it only if it has nothing else to do.
    """
    _check_owners(plan, owners)
    started = {e.action: e.start for row in simulate(plan, backward=backward).events for e in row}
    costs = {Kind.FORWARD: 1, Kind.BACKWARD: backward, Kind.BACKWARD_WEIGHT: 1}
    lists = [[a for a in actions if not a.kind.is_whole_step] for actions in plan]
    devices = max(owners) + 1
    merged: DevicePlan = [[] for _ in range(devices)]
    pos, clock = [0] * len(plan), [0] * devices
    while True:
        best: tuple[tuple[int, int, int, int], int] | None = None
        for s, actions in enumerate(lists):
            if pos[s] == len(actions):
                continue
            action = actions[pos[s]]
            if action.kind in _SENDS:
                p = action.peer
                assert p is not None
                if pos[p] == len(lists[p]) or not action.matches(lists[p][pos[p]]):
                    continue
                key = (clock[owners[s]], 0, 0, 0)  # transfers first: they free other work
            elif action.kind.is_compute:
                key = (clock[owners[s]], 1, started[action], -s)
            else:
                continue  # a receive fires with its send
            if best is None or key < best[0]:
                best = (key, s)
        if best is None:
            break
        s = best[1]
        action, d = lists[s][pos[s]], owners[s]
        merged[d].append(action)
        pos[s] += 1
        if action.kind.is_compute:
            clock[d] += costs[action.kind]
        else:
            p = action.peer
            assert p is not None
            merged[owners[p]].append(lists[p][pos[p]])
            pos[p] += 1
            clock[owners[p]] = max(clock[owners[p]], clock[d])
    stuck = [s for s in range(len(plan)) if pos[s] < len(lists[s])]
    if stuck:
        raise DeadlockError(f"Stages {stuck} cannot finish: the per-stage plan deadlocks "
                            f"(check(plan) names the waits)")
    for d, actions in enumerate(merged):
        first = stages_of(owners, d)[0]
        actions += [Action(kind, first) for kind in _whole_steps(plan[first])]
    return merged


def device_plan(kind: str, stages: int, micro_batches: int, owners: Sequence[int], *,
                training: bool) -> DevicePlan:
    """Every device's list for plan kind `kind` (plans.KINDS): "interleaved" and
    "interleaved_zero_bubble" run interleaved 1F1B (`interleaved_plan`) where the placement
    and G allow it (`runs`), 1F1B / ZB-H1 merged otherwise; the rest are merged."""
    if kind in INTERLEAVED:
        if training and interleaved.fits(owners, micro_batches):
            return interleaved_plan(stages, micro_batches, owners,
                                    split=kind == "interleaved_zero_bubble")
        kind = "zero_bubble" if kind == "interleaved_zero_bubble" else "pipelined"
    plan = plans.plan(kind, stages, micro_batches, training=training)
    if tuple(owners) == tuple(range(stages)):  # one stage a device: merging gives it back
        return plan
    return merge(plan, owners)


def interleaved_plan(stages: int, micro_batches: int, owners: Sequence[int], *,
                     split: bool = False) -> DevicePlan:
    """Interleaved 1F1B (`interleaved.py`) on stages round-robin over the devices; `split`
    defers each backward's weight part (interleaved zero-bubble)."""
    return serialize(interleaved.orders(stages, micro_batches, owners, split=split), owners,
                     backward=1 if split else 2)


def serialize(orders: list[list[Action]], owners: Sequence[int], *,
              backward: int = 1) -> list[list[Action]]:
    """Device plans from each device's compute order: transfers placed where a dry run with
    buffered sends has their data ready, in one global order (see interleaved.py)."""
    stages = len(owners)
    steps = {Kind.FORWARD: plans._forward, Kind.BACKWARD: plans._backward}
    dry = [[t for a in order for t in (steps[a.kind](a.stage, a.micro_batch, stages)
                                       if a.kind in steps and a.micro_batch is not None
                                       else [a])] for order in orders]
    timeline = simulate_devices(dry, owners, backward=backward,
                                buffered=True)  # raises DeadlockError if the orders wait in a ring
    sent = {e.action: (e.start, 0, e.action.stage, _TIES[e.action.kind], e.action.micro_batch)
            for row in timeline.events for e in row if e.action.kind in _TIES}
    plan = []
    for d, row in enumerate(timeline.events):
        def key(e: Event) -> tuple[int | None, ...]:
            a = e.action
            if a.kind.is_compute:
                return (e.start, 1)
            if a.kind in _TIES:
                return sent[a] + (0,)  # a hand-over's send before its receive
            assert a.peer is not None
            return sent[Action(a.kind.counterpart, a.peer, a.micro_batch, a.stage)] + (1,)
        first = min(s for s, o in enumerate(owners) if o == d)
        plan.append([e.action for e in sorted(row, key=key)] + [Action(Kind.STEP, first)])
    return plan


def runs(kind: str, owners: Sequence[int], micro_batches: int) -> str:
    """The training schedule `device_plan` runs for `kind`: an interleaved one falls back to
    "zero_bubble" / "pipelined" (1F1B) where the stages are not round-robin over the devices
    or G does not split into rounds (`interleaved.fits`)."""
    if kind in INTERLEAVED and not interleaved.fits(owners, micro_batches):
        return "zero_bubble" if kind == "interleaved_zero_bubble" else "pipelined"
    return kind


def engine_kind(pipelined: bool, pipeline_schedule: str) -> str:
    """The plan kind the stage workers run: "sharded", or the pipelined one
    (Training.pipelineSchedule; its "1f1b" is "pipelined")."""
    if not pipelined:
        return "sharded"
    return "pipelined" if pipeline_schedule == "1f1b" else pipeline_schedule


def peak_stash(kind: str, stages: int, micro_batches: int,
               owners: Sequence[int] | None = None, *, training: bool = True
               ) -> tuple[int, ...]:
    """Micro-batches each stage holds for backward when its device holds the most: the peak
    stash of the device plan the workers run for plan kind `kind` (`engine_kind`; "auto": the
    most of any schedule it may pick) with stage s on device `owners[s]` (one each by
    default); 0 in inference. A stage alone on its device: its own most. Stages sharing a
    device do not peak together (interleaved 1F1B's first-round stage fills while its
    second-round one drains: 4 stages on ipus 0,1,0,1 over 8 micro-batches hold 3 + 2 on
    device 0 at its peak, not 4 + 2), so what a device holds is priced at its own peak. The one
    count of micro-batches in flight: the memory estimate, the memory report and the balancer
    all price activations with it."""
    return _peak_stash(kind, stages, micro_batches,
                       tuple(range(stages)) if owners is None else tuple(owners), training)


@functools.lru_cache(maxsize=32)
def read_only_plan(kind: str, stages: int, micro_batches: int, owners: tuple[int, ...],
                   training: bool) -> DevicePlan:
    """`device_plan`, kept for the next caller who asks the same (the simulator and the
    checks only read it; a caller who changes it takes a copy): merging 32 stages' plans of
    288 micro-batches takes a second, and a search over layouts asks for each several times."""
    return device_plan(kind, stages, micro_batches, owners, training=training)


@functools.lru_cache(maxsize=32)
def _peak_stash(kind: str, stages: int, micro_batches: int, owners: tuple[int, ...],
                training: bool) -> tuple[int, ...]:
    # cached: building many stages' plans over many micro-batches takes seconds (the planner
    # and its remedies ask the same question several times); counted along each device's
    # actions as it runs them, the plans being `check_devices`' tested ones
    if not training:
        return (0,) * stages
    kinds = ["pipelined", "zero_bubble", *INTERLEAVED] if kind == "auto" else [kind]
    peaks = [_held_at_device_peaks(read_only_plan(k, stages, micro_batches, owners, True),
                                   stages) for k in kinds]
    return tuple(max(column) for column in zip(*peaks, strict=True))


def _held_at_device_peaks(plan: DevicePlan, stages: int) -> tuple[int, ...]:
    """Each stage's micro-batches forwarded and not yet through backward (its W, when split)
    at the first moment its device holds the most of them, over all its stages."""
    held = [0] * stages
    for actions in plan:
        done = (Kind.BACKWARD_WEIGHT if any(a.kind is Kind.BACKWARD_WEIGHT for a in actions)
                else Kind.BACKWARD)
        now: dict[int, int] = {}
        most = 0
        for a in actions:
            if a.kind is Kind.FORWARD or a.kind is done:
                now[a.stage] = now.get(a.stage, 0) + (1 if a.kind is Kind.FORWARD else -1)
                if sum(now.values()) > most:
                    most = sum(now.values())
                    held = [now.get(s, c) for s, c in enumerate(held)]
    return tuple(held)


Ticks = int | Sequence[int]
"""A cost in ticks: the same for every stage, or one per stage."""


def choose(stages: int, micro_batches: int, owners: Sequence[int], *, forward: Ticks = 1,
           backward: Ticks = 1, weight: Ticks = 1,
           whole: Ticks | None = None) -> tuple[str, float]:
    """The training schedule whose device plan the simulator finishes first with these tick
    costs, and its bubble share: "pipelined" (1F1B), "zero_bubble", and, with stages
    round-robin over the devices, "interleaved" and "interleaved_zero_bubble". A split
    backward costs `backward` for the input's part and `weight` for the weights', a whole one
    `whole` (default their sum; less where splitting costs extra work); each cost one for
    all stages or one per stage. Transfers are buffered, as the workers' links are. On a tie
    the one earlier in that list, which holds fewer activations."""
    if whole is None:
        whole = tuple(b + w for b, w in zip(_per_stage(backward, stages),
                                            _per_stage(weight, stages), strict=True))
    kinds = ["pipelined", "zero_bubble"] + (
        list(INTERLEAVED) if interleaved.fits(owners, micro_batches) else [])
    timelines = []
    for kind in kinds:
        split = "zero_bubble" in kind
        timelines.append(simulate_devices(
            device_plan(kind, stages, micro_batches, owners, training=True), owners,
            forward=forward, backward=backward if split else whole, weight=weight, buffered=True))
    best = min(range(len(kinds)), key=lambda k: (timelines[k].makespan, k))
    return kinds[best], timelines[best].bubble_fraction


def _whole_steps(actions: list[Action]) -> list[Kind]:
    return [a.kind for a in actions if a.kind.is_whole_step]


def project(device_plan: DevicePlan, owners: Sequence[int]) -> Plan:
    """Each stage's actions in the order its device runs them (whole-step ones on every
    stage of the device): the per-stage plan `check` verifies."""
    plan: Plan = [[] for _ in owners]
    for d, actions in enumerate(device_plan):
        for action in actions:
            if action.kind.is_whole_step:
                for stage in stages_of(owners, d):
                    plan[stage].append(Action(action.kind, stage))
            else:
                plan[action.stage].append(action)
    return plan


def simulate_devices(device_plan: DevicePlan, owners: Sequence[int], *, forward: Ticks = 1,
                     backward: Ticks = 1, weight: Ticks = 1, step: Ticks = 0,
                     buffered: bool = False) -> Timeline:
    """Run every device's list in order on a simulated clock (rows of the Timeline are
    devices). A transfer between devices is a rendezvous, as in `simulate`, or with
    `buffered` a send that returns at once and a receive that waits for it (the workers'
    links: shared-memory rings and gloo's isend); one within a device needs its send earlier
    in the list than its receive. Compute costs are one for all stages or one per stage.
    Raises DeadlockError."""
    _check_device_plan(device_plan, owners)
    costs = {kind: _per_stage(cost, len(owners)) for kind, cost in (
        (Kind.FORWARD, forward), (Kind.BACKWARD, backward), (Kind.BACKWARD_WEIGHT, weight),
        (Kind.STEP, step), (Kind.ALL_REDUCE, step), (Kind.TIED_REDUCE, step))}
    pos, clock = [0] * len(device_plan), [0] * len(device_plan)
    handed: dict[Action, int] = {}  # sends (local, or any when buffered) not received yet
    events: list[list[Event]] = [[] for _ in device_plan]

    def run(d: int, action: Action, start: int, cost: int) -> None:
        events[d].append(Event(action, start, start + cost))
        clock[d], pos[d] = start + cost, pos[d] + 1

    progress = True
    while progress:
        progress = False
        for d, actions in enumerate(device_plan):
            while pos[d] < len(actions):
                action = actions[pos[d]]
                local = action.peer is not None and (buffered or owners[action.peer] == d)
                if action.kind in costs:
                    run(d, action, clock[d], costs[action.kind][action.stage])
                elif local and action.kind in _SENDS:
                    handed[action] = clock[d]
                    run(d, action, clock[d], 0)
                elif local:
                    assert action.peer is not None
                    sent = Action(action.kind.counterpart, action.peer, action.micro_batch,
                                  action.stage)
                    if sent not in handed:
                        break
                    run(d, action, max(clock[d], handed.pop(sent)), 0)
                else:
                    assert action.peer is not None
                    e = owners[action.peer]
                    if pos[e] == len(device_plan[e]) or not action.matches(
                            device_plan[e][pos[e]]):
                        break
                    start = max(clock[d], clock[e])
                    run(e, device_plan[e][pos[e]], start, 0)
                    run(d, action, start, 0)
                progress = True
    if any(pos[d] < len(actions) for d, actions in enumerate(device_plan)):
        raise DeadlockError(_deadlock_message(device_plan, pos))
    return Timeline(tuple(tuple(row) for row in events))


def check_devices(device_plan: DevicePlan, owners: Sequence[int], *, backward: int = 1) -> Report:
    """Verify a device plan: no deadlock between devices, each stage's work done once in
    dependency order (`check` on the projection), at most one STEP per device and last.
    The Report's timeline has one row per device."""
    timeline = simulate_devices(device_plan, owners, backward=backward)
    for d, actions in enumerate(device_plan):
        steps = [n for n, a in enumerate(actions) if a.kind is Kind.STEP]
        if steps and steps != [len(actions) - 1]:
            raise ScheduleError(f"Device {d} must run one STEP, last; it runs STEP at "
                                f"actions {steps} of {len(actions)}")
    report = check(project(device_plan, owners), backward=backward)
    return Report(timeline, report.training, report.micro_batches, report.peak_stash)


def _per_stage(cost: Ticks, stages: int) -> tuple[int, ...]:
    if isinstance(cost, int):
        return (cost,) * stages
    if len(cost) != stages:
        raise ValueError(f"A cost per stage needs {stages} values, got {list(cost)}")
    return tuple(cost)


def _check_owners(plan: Plan, owners: Sequence[int]) -> None:
    if len(owners) != len(plan) or any(o < 0 for o in owners):
        raise ScheduleError(f"owners must give a device >= 0 for each of the plan's "
                            f"{len(plan)} stages, got {list(owners)}")
    missing = sorted(set(range(max(owners) + 1)) - set(owners))
    if missing:
        raise ScheduleError(f"Devices {missing} hold no stage (owners {list(owners)}): number "
                            "the devices 0..N-1 (see owners_of)")


def _check_device_plan(device_plan: DevicePlan, owners: Sequence[int]) -> None:
    for d, actions in enumerate(device_plan):
        own = stages_of(owners, d)
        for action in actions:
            if action.stage not in own:
                raise ScheduleError(f"Device {d} holds stages {list(own)} but its list has "
                                    f"{action} of stage {action.stage}")
            if action.kind.is_whole_step and action.stage != own[0]:
                raise ScheduleError(f"Device {d}'s {action} covers all of its stages and is "
                                    f"named for its first, {own[0]}, not {action.stage}")


def _deadlock_message(device_plan: DevicePlan, pos: list[int]) -> str:
    waits = [f"device {d} waits at action {pos[d]} ({actions[pos[d]]!r})"
             for d, actions in enumerate(device_plan) if pos[d] < len(actions)]
    return ("The device plan deadlocks: " + "; ".join(waits) + ". Two devices must post "
            "the transfers between them in the same order, and a hand-over within a device "
            "must send before it receives.")
