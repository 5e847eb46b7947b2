"""Which device each stage of a planned pipeline sits on, by schedule, and why a schedule
cannot train a layout.

1F1B and zero-bubble put one stage on each of a pipeline's P devices. Interleaved 1F1B
(`schedule/interleaved.py`) puts two on each, round-robin: stage s of 2P on device s % P, as
BeginBlock with ipu_id=s % P places them (ipus 0,1,0,1 for P = 2). Each device then runs its
stages' micro-batches in rounds, which halves the ramp that is 1F1B's bubble, and holds two
stages' weights and stashes.
"""
from __future__ import annotations

import itertools

from pipetorch.partition import balance
from pipetorch.partition.stage_rules import min_gradient_accumulation
from pipetorch.schedule import interleaved

__all__: list[str] = []

SCHEDULES = {"1f1b": "pipelined", "zero_bubble": "zero_bubble", "interleaved": "interleaved"}
_PER_DEVICE = {"interleaved": 2}  # stages on each device, by plan kind (one otherwise)


def kind_of(schedule: str) -> str:
    """The plan kind of a layout's schedule ("none", one stage: "sharded")."""
    return SCHEDULES.get(schedule, "sharded")


def per_device(kind: str) -> int:
    """Stages on each device under plan kind `kind`."""
    return _PER_DEVICE.get(kind, 1)


def owners(kind: str, devices: int) -> tuple[int, ...]:
    """Each stage's device under plan kind `kind` on a pipeline of `devices` devices."""
    return tuple(s % devices for s in range(per_device(kind) * devices))


def refusal(kind: str, devices: int, segments: int, accumulation: int) -> str:
    """Why plan kind `kind` cannot train a model of `segments` segments on a pipeline of
    `devices` devices with `accumulation` micro-batches per step, and the fix ("" where it
    can)."""
    stages = len(owners(kind, devices))
    if kind == "interleaved" and devices < 2:
        return ("interleaved places 2 stages on each device of a pipeline, round-robin over "
                f"2 or more devices, but devices / replicas is {devices}: give more devices "
                "or fewer replicas")
    if stages > segments:
        return (f"{stages} stages{_where(kind, devices)}, but the model has {segments} "
                "segments a stage may hold: give fewer devices / replicas"
                + (" or another schedule" if stages > devices else ""))
    return _accumulation_refusal(kind, devices, accumulation)


def _accumulation_refusal(kind: str, devices: int, accumulation: int) -> str:
    """Why `accumulation` micro-batches per step cannot train plan kind `kind` on a pipeline
    of `devices` devices, and the G that would ("" where they can)."""
    if _trains(kind, devices, accumulation):
        return ""
    stages, least = len(owners(kind, devices)), _least(kind, devices)
    above = _workable(kind, devices, accumulation)
    if accumulation < least:
        return (f"G {accumulation} is below {least}, the fewest micro-batches a pipeline of "
                f"{stages} stages{_where(kind, devices)} trains (2 x stages - 1): give G "
                f"{above} or more")
    below = [g for g in range(least, accumulation) if _trains(kind, devices, g)]
    return (f"G {accumulation} does not split into {accumulation // devices} equal rounds "
            f"over the {devices} devices (interleaved runs a device's stages round by round): "
            "give G " + (f"{below[-1]} or " if below else "") + str(above))


def default_accumulation(kind: str, devices: int) -> int:
    """G when none is given: the fewest that keep 1F1B's bubble under 10%
    (`balance.propose_gradient_accumulation`), raised until plan kind `kind` trains with it
    (interleaved: rounds that split it evenly)."""
    return _workable(kind, devices, balance.propose_gradient_accumulation(devices))


def _trains(kind: str, devices: int, accumulation: int) -> bool:
    """The runtime's 2 x stages - 1 (`min_gradient_accumulation`) and, interleaved, rounds
    that split G evenly (`interleaved.round_size`)."""
    return accumulation >= _least(kind, devices) and (
        kind != "interleaved" or interleaved.round_size(accumulation, devices) is not None)


def _least(kind: str, devices: int) -> int:
    stages = len(owners(kind, devices))
    return min_gradient_accumulation(stages) if stages > 1 else 1


def _workable(kind: str, devices: int, least: int) -> int:
    """The smallest G of `least` or more that plan kind `kind` trains with on `devices`."""
    return next(g for g in itertools.count(max(least, 1)) if _trains(kind, devices, g))


def _where(kind: str, devices: int) -> str:
    per = per_device(kind)
    return "" if per == 1 else f" ({per} on each of {devices} devices: {kind})"
