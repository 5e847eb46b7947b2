"""Runs a plan on a simulated clock with rendezvous transfers and checks it is a valid schedule."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from pipetorch.errors import Error
from pipetorch.schedule.actions import Action, Kind, Plan

__all__: list[str] = []


class ScheduleError(Error, ValueError):
    """A plan that cannot run or computes the wrong thing (missing, repeated or misordered work)."""


class DeadlockError(ScheduleError):
    """Every unfinished stage waits on a transfer its peer never posts."""


@dataclass(frozen=True)
class Event:
    """An action with the ticks it ran in; transfers take no time, `start == end`."""

    action: Action
    start: int
    end: int


@dataclass(frozen=True)
class Timeline:
    """What each stage ran when: `events[i]` follows stage i's action list."""

    events: tuple[tuple[Event, ...], ...]

    @property
    def stages(self) -> int:
        return len(self.events)

    @property
    def makespan(self) -> int:
        return max((e.end for row in self.events for e in row), default=0)

    def busy(self, stage: int) -> int:
        """Ticks stage `stage` spends computing forwards and backwards."""
        return sum(e.end - e.start for e in self.events[stage] if e.action.kind.is_compute)

    @property
    def bubble_fraction(self) -> float:
        """Share of stage-ticks spent idle: 1 - busy / (stages x makespan)."""
        total = self.stages * self.makespan
        return 1 - sum(self.busy(s) for s in range(self.stages)) / total if total else 0.0


@dataclass(frozen=True)
class Report:
    """What `check` measured on a correct plan."""

    timeline: Timeline
    training: bool
    micro_batches: int
    peak_stash: tuple[int, ...]  # most micro-batches awaiting their backward, per stage

    @property
    def makespan(self) -> int:
        return self.timeline.makespan

    @property
    def bubble_fraction(self) -> float:
        return self.timeline.bubble_fraction


def simulate(plan: Plan, *, forward: int = 1, backward: int = 1, weight: int = 1,
             step: int = 0, transfer: int = 0) -> Timeline:
    """Run every stage's list in order; a send and its receive happen together (rendezvous).

    Forwards, backwards, weight-gradient parts (W, split off a backward), steps and transfers
    take the given number of ticks. Raises DeadlockError naming the stuck stages and the
    action each waits on.
    """
    costs = {Kind.FORWARD: forward, Kind.BACKWARD: backward, Kind.BACKWARD_WEIGHT: weight,
             Kind.STEP: step}
    for name, value in (("forward", forward), ("backward", backward), ("weight", weight),
                        ("step", step), ("transfer", transfer)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} cost must be an int >= 0 ticks, got {value!r}")
    _check_shape(plan)
    pos, clock = [0] * len(plan), [0] * len(plan)
    events: list[list[Event]] = [[] for _ in plan]
    progress = True
    while progress:
        progress = False
        for s, actions in enumerate(plan):
            while pos[s] < len(actions) and actions[pos[s]].kind in costs:
                action = actions[pos[s]]
                events[s].append(Event(action, clock[s], clock[s] + costs[action.kind]))
                clock[s] += costs[action.kind]
                pos[s] += 1
                progress = True
            if pos[s] == len(actions):
                continue
            action, p = actions[pos[s]], actions[pos[s]].peer
            assert p is not None
            if pos[p] < len(plan[p]) and action.matches(plan[p][pos[p]]):
                start = max(clock[s], clock[p])
                for t in (s, p):
                    events[t].append(Event(plan[t][pos[t]], start, start + transfer))
                    clock[t], pos[t] = start + transfer, pos[t] + 1
                progress = True
    if any(pos[s] < len(plan[s]) for s in range(len(plan))):
        raise DeadlockError(_deadlock_message(plan, pos))
    return Timeline(tuple(tuple(row) for row in events))


def check(plan: Plan, *, forward: int = 1, backward: int = 1, weight: int = 1) -> Report:
    """Simulate `plan` and verify it does each micro-batch's work once, in dependency order.

    Checks: every stage runs one forward per micro-batch 0..G-1 and, when training (the plan
    has backwards or STEPs), one backward after it and a final STEP; each forward receives
    its input from the previous stage first and sends its output on afterwards (backwards the
    other way round); the simulated timeline respects those dependencies; no deadlock. A
    plan with any W (split backward) needs one W per micro-batch on every stage, after its B.
    """
    timeline = simulate(plan, forward=forward, backward=backward, weight=weight)
    training = any(a.kind in (Kind.BACKWARD, Kind.STEP) for actions in plan for a in actions)
    split = any(a.kind is Kind.BACKWARD_WEIGHT for actions in plan for a in actions)
    micro_batches = len({a.micro_batch for a in plan[0] if a.kind is Kind.FORWARD})
    for s, actions in enumerate(plan):
        _check_stage(s, actions, len(plan), micro_batches, training, split)
    _check_timeline(timeline, training)
    stash = tuple(_peak_stash(actions) if training else 0 for actions in plan)
    return Report(timeline, training, micro_batches, stash)


def _check_shape(plan: Plan) -> None:
    if not isinstance(plan, list) or not plan:
        raise ScheduleError(f"A plan is a non-empty list of per-stage action lists, got {plan!r}")
    for s, actions in enumerate(plan):
        for a in actions:
            if not isinstance(a, Action) or a.stage != s:
                raise ScheduleError(f"plan[{s}] holds {a!r}, which is not an Action of stage {s}")
            if a.peer is not None and a.peer >= len(plan):
                raise ScheduleError(
                    f"{a!r} on stage {s} names peer stage {a.peer} but the plan has "
                    f"{len(plan)} stages")


def _deadlock_message(plan: Plan, pos: list[int]) -> str:
    lines = []
    for s, actions in enumerate(plan):
        if pos[s] == len(actions):
            continue
        action = actions[pos[s]]
        p = action.peer
        assert p is not None
        peer_at = (f"is at {plan[p][pos[p]]} (action {pos[p]})" if pos[p] < len(plan[p])
                   else "has finished")
        lines.append(f"stage {s} waits at action {pos[s]} {action} for stage {p}, which "
                     f"{peer_at}; pending on stage {s}: "
                     + " ".join(str(a) for a in actions[pos[s]:pos[s] + 6]))
    return ("The schedule deadlocks: " + "; ".join(lines) + ". Each pair of neighbouring "
            "stages must post their sends and receives in the same order.")


def _expected(s: int, stages: int, micro_batches: int, training: bool,
              split: bool = False) -> list[Action]:
    """Stage s's work in dependency order per micro-batch (not the plan's interleaving).

    Written apart from plans.py on purpose: a checker sharing the planner's helpers would
    share its mistakes.
    """
    expected = []
    for m in range(micro_batches):
        if s > 0:
            expected.append(Action(Kind.RECV_ACT, s, m, s - 1))
        expected.append(Action(Kind.FORWARD, s, m))
        if s < stages - 1:
            expected.append(Action(Kind.SEND_ACT, s, m, s + 1))
        if training and s < stages - 1:
            expected.append(Action(Kind.RECV_GRAD, s, m, s + 1))
        if training:
            expected.append(Action(Kind.BACKWARD, s, m))
        if training and s > 0:
            expected.append(Action(Kind.SEND_GRAD, s, m, s - 1))
        if training and split:
            expected.append(Action(Kind.BACKWARD_WEIGHT, s, m))
    return expected + ([Action(Kind.STEP, s)] if training else [])


def _check_stage(s: int, actions: list[Action], stages: int, micro_batches: int,
                 training: bool, split: bool = False) -> None:
    expected = _expected(s, stages, micro_batches, training, split)
    # Done signals carry no data: they only hold a stage back, and the simulation matched them.
    actions = [a for a in actions if a.kind not in (Kind.SEND_DONE, Kind.RECV_DONE)]
    if Counter(actions) != Counter(expected):
        extra = list((Counter(actions) - Counter(expected)).elements())
        missing = list((Counter(expected) - Counter(actions)).elements())
        raise ScheduleError(
            f"Stage {s} of a {'training' if training else 'inference'} plan with "
            f"{micro_batches} micro-batches has unexpected actions "
            f"{[str(a) for a in extra]} and lacks {[str(a) for a in missing]}")
    index = {a: i for i, a in enumerate(actions)}
    # Within one micro-batch, `expected` lists the stage's work in the order it depends.
    for m in range(micro_batches):
        chain = [a for a in expected if a.micro_batch == m]
        for before, after in zip(chain, chain[1:], strict=False):
            if after.kind is Kind.BACKWARD_WEIGHT:
                before = Action(Kind.BACKWARD, s, m)  # W needs its B, not B's send
            if index[before] > index[after]:
                raise ScheduleError(
                    f"Stage {s} runs {after} (action {index[after]}) before {before} "
                    f"(action {index[before]}), which it depends on")
    if training and actions[-1].kind is not Kind.STEP:
        raise ScheduleError(f"Stage {s} must end with STEP after its backwards, "
                            f"got {actions[-1]} last")


def _check_timeline(timeline: Timeline, training: bool) -> None:
    ends = {e.action: e for row in timeline.events for e in row if e.action.kind.is_compute}
    for e in ends.values():
        a = e.action
        before = None
        if a.kind is Kind.FORWARD and a.stage > 0:
            before = Action(Kind.FORWARD, a.stage - 1, a.micro_batch)
        if a.kind is Kind.BACKWARD and a.stage < timeline.stages - 1:
            before = Action(Kind.BACKWARD, a.stage + 1, a.micro_batch)
        assert before is None or ends[before].end <= e.start, (before, a, ends[before], e)
        if training and a.kind is Kind.BACKWARD:
            own_forward = ends[Action(Kind.FORWARD, a.stage, a.micro_batch)]
            assert own_forward.end <= e.start, (own_forward, e)
        if a.kind is Kind.BACKWARD_WEIGHT:
            own_input = ends[Action(Kind.BACKWARD, a.stage, a.micro_batch)]
            assert own_input.end <= e.start, (own_input, e)


def _peak_stash(actions: list[Action]) -> int:
    """Micro-batches forwarded on this stage whose backward (its W, when split) has not run
    yet, at most: their graphs are still held."""
    split = any(a.kind is Kind.BACKWARD_WEIGHT for a in actions)
    done = Kind.BACKWARD_WEIGHT if split else Kind.BACKWARD
    stashed = peak = 0
    for a in actions:
        stashed += {Kind.FORWARD: 1, done: -1}.get(a.kind, 0)
        peak = max(peak, stashed)
    return peak
