"""Interleaved 1F1B over virtual stages: N devices each holding stages d, d+N, d+2N, ...

Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters" (2021), as
torch's ScheduleInterleaved1F1B. With S = V x N stages placed round-robin (ipus 0,1,0,1), a
device runs its forwards in rounds of R micro-batches (N, or G split evenly into G // N
rounds) through each of its V stages in turn (stage d for micro-batches 0..R-1, then stage
d+N for them, ...), backwards the same way from its last stage down, and, after
(V-1)R + 2(N-1-d) warm-up forwards, one forward then one backward. Each of a device's stages costs 1/V of its work, so the (N-1)-stage ramp that is
1F1B's bubble shrinks V times: (N-1)/(VG+N-1) of a step against (N-1)/(G+N-1).

4 stages on 2 devices (V=2), G=4, forward one tick and backward two, from
`grid.render(devices.simulate_devices(plan(4, 4, (0, 1, 0, 1)), (0, 1, 0, 1), backward=2,
buffered=True), unit="device")`, a cell naming stage:micro-batch. It takes 27 ticks: the
same blocks as two stages under 1F1B take 30, the four merged onto the devices (`merge`) 28.

    device 0 | 0:F0 0:F1 2:F0 2:F1 0:F2    . 2:B0 2:B0 0:F3 2:B1 2:B1 2:F2 0:B0 0:B0 2:F3 ...
    device 1 |    . 1:F0 1:F1 3:F0 3:B0 3:B0 3:F1 3:B1 3:B1 1:F2 1:B0 1:B0 1:F3 1:B1 1:B1 ...

A device's list gets its transfers by a dry run with buffered sends: each transfer is
stamped with the time its data is ready and placed there in both devices' lists, ordered by
(time, sender, ...) everywhere. All lists then follow one global order, so a rendezvous
transport cannot deadlock: the earliest unfinished action is always at the head of its
list(s).

Memory: the warm-up holds more in flight. Ipus 0,1,0,1 and G=8: stages 0..3 stash at most
4, 3, 2, 1 micro-batches (`check_devices(...).peak_stash`), so device 0 holds 6 half-sized
stashes where 1F1B over the same blocks as two stages holds 2 whole ones (4 halves).
"""
from __future__ import annotations

from collections.abc import Sequence

from pipetorch.schedule.actions import Action, Kind
from pipetorch.schedule.checks import DeadlockError

__all__: list[str] = []

_SENDS = {Kind.SEND_ACT: 0, Kind.SEND_GRAD: 1}  # ties at one instant: activations first


def fits(owners: Sequence[int], micro_batches: int) -> bool:
    """True if the stages sit round-robin on 2+ devices, several per device (ipus 0,1,0,1),
    and the micro-batches split into rounds (`round_size`)."""
    devices = max(owners) + 1
    return (devices >= 2 and len(owners) > devices and len(owners) % devices == 0
            and all(d == s % devices for s, d in enumerate(owners))
            and round_size(micro_batches, devices) is not None)


def round_size(micro_batches: int, devices: int) -> int | None:
    """Micro-batches per round: G split into G // N equal rounds (N or more each, as torch's
    flexible rounds), or G if G < N; None if they do not divide G (a ragged round deadlocks)."""
    rounds = max(1, micro_batches // devices)
    return micro_batches // rounds if micro_batches % rounds == 0 else None


def compute_order(stages: int, micro_batches: int, devices: int, device: int,
                  *, split: bool = False) -> list[Action]:
    """Device `device`'s forwards and backwards in interleaved-1F1B order; with `split`, each
    backward's weight part (W) follows `device` newer backwards, as ZB-H1 on stage d."""
    chunks = stages // devices
    size = round_size(micro_batches, devices)
    assert size, f"{micro_batches} micro-batches do not split into rounds over {devices} devices"
    rounds = [range(a, a + size) for a in range(0, micro_batches, size)]
    forwards = [Action(Kind.FORWARD, c * devices + device, m)
                for r in rounds for c in range(chunks) for m in r]
    backwards = [Action(Kind.BACKWARD, c * devices + device, m)
                 for r in rounds for c in reversed(range(chunks)) for m in r]
    warmup = min((chunks - 1) * size + 2 * (devices - 1 - device), len(forwards))
    order = forwards[:warmup]
    for f, b in zip(forwards[warmup:], backwards):
        order += [f, b]
    order += backwards[len(forwards) - warmup:]
    return _defer_weights(order, device) if split else order


def _defer_weights(order: list[Action], lag: int) -> list[Action]:
    out: list[Action] = []
    pending: list[Action] = []
    for action in order:
        out.append(action)
        if action.kind is Kind.BACKWARD:
            pending.append(Action(Kind.BACKWARD_WEIGHT, action.stage, action.micro_batch))
            while len(pending) > lag:
                out.append(pending.pop(0))
    return out + pending


def plan(stages: int, micro_batches: int, owners: Sequence[int], *,
         split: bool = False) -> list[list[Action]]:
    """The device plan (one action list per device, ending in STEP) of interleaved 1F1B;
    `split` defers each backward's weight part (interleaved zero-bubble)."""
    if len(owners) != stages or not fits(owners, micro_batches):
        raise ValueError(
            f"Interleaved stages need the {stages} stages round-robin on 2+ devices, several "
            f"each (ipus 0,1,0,1), and G ({micro_batches}) a multiple of G // devices; got "
            f"devices {list(owners)}")
    devices = max(owners) + 1
    orders = [compute_order(stages, micro_batches, devices, d, split=split)
              for d in range(devices)]
    return serialize(orders, owners, forward=1, backward=2 if not split else 1, weight=1)


def serialize(orders: list[list[Action]], owners: Sequence[int], *, forward: int = 1,
              backward: int = 1, weight: int = 1) -> list[list[Action]]:
    """Device plans from each device's compute order: transfers placed where a dry run with
    buffered sends has their data ready, in one global order (see the module docstring)."""
    stages = len(owners)
    costs = {Kind.FORWARD: forward, Kind.BACKWARD: backward, Kind.BACKWARD_WEIGHT: weight}
    ends: dict[Action, int] = {}
    keyed: list[list[tuple[tuple[int, ...], Action]]] = [[] for _ in orders]
    pos, clock = [0] * len(orders), [0] * len(orders)
    progress = True
    while progress:
        progress = False
        for d, order in enumerate(orders):
            while pos[d] < len(order):
                action = order[pos[d]]
                needs = _needs(action, stages)
                if any(n not in ends for n in needs):
                    break
                start = max([clock[d], *(ends[n] for n in needs)])
                clock[d] = ends[action] = start + costs[action.kind]
                keyed[d].append(((start, 1), action))
                for send, recv in _transfers(action, stages):
                    key = (clock[d], 0, send.stage, _SENDS[send.kind], send.micro_batch)
                    keyed[owners[send.stage]].append((key + (0,), send))  # a hand-over's
                    keyed[owners[recv.stage]].append((key + (1,), recv))  # send first
                pos[d] += 1
                progress = True
    if any(p < len(o) for p, o in zip(pos, orders)):
        raise DeadlockError("The devices' compute orders wait on each other: "
                            + "; ".join(f"device {d} at {o[p]}" for d, (p, o)
                                        in enumerate(zip(pos, orders)) if p < len(o)))
    first = [min(s for s, o in enumerate(owners) if o == d) for d in range(len(orders))]
    return [[a for _, a in sorted(row, key=lambda item: item[0])] + [Action(Kind.STEP, first[d])]
            for d, row in enumerate(keyed)]


def _needs(action: Action, stages: int) -> list[Action]:
    """The computes `action` waits for on other stages (its own stage's come earlier)."""
    s, m = action.stage, action.micro_batch
    if action.kind is Kind.FORWARD and s > 0:
        return [Action(Kind.FORWARD, s - 1, m)]
    if action.kind is Kind.BACKWARD:
        return [Action(Kind.BACKWARD, s + 1, m) if s < stages - 1 else Action(Kind.FORWARD, s, m)]
    return []


def _transfers(action: Action, stages: int) -> list[tuple[Action, Action]]:
    """The (send, receive) pairs carrying `action`'s result to its neighbour stage."""
    s, m = action.stage, action.micro_batch
    if action.kind is Kind.FORWARD and s < stages - 1:
        return [(Action(Kind.SEND_ACT, s, m, s + 1), Action(Kind.RECV_ACT, s + 1, m, s))]
    if action.kind is Kind.BACKWARD and s > 0:
        return [(Action(Kind.SEND_GRAD, s, m, s - 1), Action(Kind.RECV_GRAD, s - 1, m, s))]
    return []
