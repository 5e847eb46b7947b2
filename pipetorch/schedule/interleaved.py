"""Interleaved 1F1B over virtual stages: N devices each holding stages d, d+N, d+2N, ...

Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters" (2021), as
torch's ScheduleInterleaved1F1B. With S = V x N stages placed round-robin (ipus 0,1,0,1), a
device runs its forwards in rounds of R micro-batches (N, or G split evenly into G // N
rounds) through each of its V stages in turn (stage d for micro-batches 0..R-1, then stage
d+N for them, ...), backwards the same way from its last stage down, and, after
(V-1)R + 2(N-1-d) warm-up forwards, one forward then one backward. Each of a device's stages costs 1/V of its work, so the (N-1)-stage ramp that is
1F1B's bubble shrinks V times: (N-1)/(VG+N-1) of a step against (N-1)/(G+N-1).

4 stages on 2 devices (V=2), G=4, forward one tick and backward two, from the tests'
`render(devices.simulate_devices(devices.interleaved_plan(4, 4, (0, 1, 0, 1)),
(0, 1, 0, 1), backward=2, buffered=True), unit="device")`, a cell naming stage:micro-batch. It takes 27 ticks: the
same blocks as two stages under 1F1B take 30, the four merged onto the devices (`merge`) 28.

    device 0 | 0:F0 0:F1 2:F0 2:F1 0:F2    . 2:B0 2:B0 0:F3 2:B1 2:B1 2:F2 0:B0 0:B0 2:F3 ...
    device 1 |    . 1:F0 1:F1 3:F0 3:B0 3:B0 3:F1 3:B1 3:B1 1:F2 1:B0 1:B0 1:F3 1:B1 1:B1 ...

A device's list gets its transfers (`devices.serialize`) by a dry run with buffered sends: each transfer is
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

__all__: list[str] = []


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
    for f, b in zip(forwards[warmup:], backwards, strict=False):
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


def orders(stages: int, micro_batches: int, owners: Sequence[int], *,
           split: bool = False) -> list[list[Action]]:
    """Every device's compute order (`devices.interleaved_plan` adds the transfers)."""
    if len(owners) != stages or not fits(owners, micro_batches):
        raise ValueError(
            f"Interleaved stages need the {stages} stages round-robin on 2+ devices, several "
            f"each (ipus 0,1,0,1), and G ({micro_batches}) a multiple of G // devices; got "
            f"devices {list(owners)}")
    return [compute_order(stages, micro_batches, max(owners) + 1, d, split=split)
            for d in range(max(owners) + 1)]
