"""Pipeline schedules as pure functions: each stage's ordered list of actions for one step.

A plan covers one optimiser step of G micro-batches (training, ending in STEP on every stage)
or the D micro-batches of one inference call. The runtime repeats a training plan once per
device iteration. Micro-batches are numbered from 0.

1F1B for S=3 stages, G=6 micro-batches, forward and backward one tick each (from the
tests' `render(one_f_one_b(3, 6))`, tests/helpers/grid.py): stage i runs S-1-i warm-up forwards, then alternates one
forward and one backward, then drains the remaining backwards. At most S-i micro-batches'
activations wait for their backward on stage i, against G for fill-drain, in the same time.

    stage 0 | F0 F1 F2  .  . B0 F3 B1 F4 B2 F5 B3  . B4  . B5
    stage 1 |  . F0 F1  . B0 F2 B1 F3 B2 F4 B3 F5 B4  . B5  .
    stage 2 |  .  . F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5  .  .

With f ticks per forward and b per backward, 1F1B and fill-drain both take (G+S-1)(f+b) ticks:
stage 0 computes for G(f+b) and waits (S-1)(f+b) in all, the time a micro-batch's forward and
backward take on the other S-1 stages, so the idle share (the bubble) is (S-1)/(G+S-1)
whatever b/f is.

Sends and receives assume the strictest transport, a rendezvous: a send finishes only when the
peer posts the matching receive. Each pair of neighbouring stages must therefore post their
transfers in the same order. In the steady state stage i receives the gradient of its next
backward *before* sending the activations of the forward it just ran, because stage i+1 sends
that gradient before it asks for those activations; the other order deadlocks. Delaying the
send costs nothing: stage i+1 is busy with that backward until the gradient goes out.
"""
from __future__ import annotations

from dataclasses import dataclass

from pipetorch.enums import ReductionType
from pipetorch.schedule.actions import Action, Kind, Plan

__all__: list[str] = []

KINDS = ("pipelined", "1f1b", "zero_bubble", "fill_drain", "sharded")
# and, with a device plan (`devices.device_plan`): "interleaved", "interleaved_zero_bubble"


@dataclass(frozen=True)
class Batching:
    """D, G and R of a host call, and how gradients are reduced over G and R."""

    device_iterations: int
    gradient_accumulation: int
    replication_factor: int
    reduction: ReductionType = ReductionType.Mean

    @property
    def micro_batches(self) -> int:
        return self.device_iterations * self.gradient_accumulation * self.replication_factor

    @property
    def steps(self) -> int:
        """Micro-batches per replica: D*G."""
        return self.device_iterations * self.gradient_accumulation


def one_f_one_b(stages: int, micro_batches: int) -> Plan:
    """Training with one-forward-one-backward: at most `stages - i` stashed on stage i."""
    _check_sizes(stages, micro_batches)
    plan = []
    for s in range(stages):
        warmup = min(stages - 1 - s, micro_batches)
        actions = []
        for m in range(warmup):
            actions += _forward(s, m, stages)
        for b, f in enumerate(range(warmup, micro_batches)):
            actions += (_recv_act(s, f) + [Action(Kind.FORWARD, s, f)]
                        + _recv_grad(s, b, stages) + _send_act(s, f, stages)
                        + [Action(Kind.BACKWARD, s, b)] + _send_grad(s, b))
        for b in range(micro_batches - warmup, micro_batches):
            actions += _backward(s, b, stages)
        plan.append(actions + [Action(Kind.STEP, s)])
    return plan


def zero_bubble(stages: int, micro_batches: int) -> Plan:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2023): 1F1B with each backward
    split in two. B computes only the gradient of the stage's input and sends it upstream at
    once; W, the weights' gradient, waits until stage i has i newer Bs done, and the rest run
    before STEP. The Ws move into what was the drain's bubble, so with forward, input and
    weight gradients one tick each (1F1B's backward being two) S=3, G=6 takes 22 ticks
    against 1F1B's 24: the bubble shrinks from (S-1)(f+b) to (S-1)(f+b-w). A stage holds at
    most S micro-batches' graphs (until their W), as many as 1F1B's stage 0.

    stage 0 | F0 F1 F2  .  . B0 W0 F3 B1 W1 F4 B2 W2 F5 B3 W3  . B4 W4  . B5 W5
    stage 1 |  . F0 F1  . B0 F2 B1 W0 F3 B2 W1 F4 B3 W2 F5 B4 W3  . B5 W4 W5  .
    stage 2 |  .  . F0 B0 F1 B1 F2 B2 W0 F3 B3 W1 F4 B4 W2 F5 B5 W3 W4 W5  .  .

    The transfers are 1F1B's, in 1F1B's order: a W has no peer, so deadlock-freedom carries
    over. A W runs right after its stage's B, before B's send: under a rendezvous that send
    waits for the previous stage to finish its forward, time the W fills.
    """
    plan = []
    for s, actions in enumerate(one_f_one_b(stages, micro_batches)):
        split: list[Action] = []
        pending: list[int | None] = []  # micro-batches whose B ran and W has not
        for action in actions:
            if action.kind is Kind.STEP:
                split += [Action(Kind.BACKWARD_WEIGHT, s, m) for m in pending]
            split.append(action)
            if action.kind is Kind.BACKWARD:
                pending.append(action.micro_batch)
                while len(pending) > s:
                    split.append(Action(Kind.BACKWARD_WEIGHT, s, pending.pop(0)))
        plan.append(split)
    return plan


def fill_drain(stages: int, micro_batches: int, *, training: bool) -> Plan:
    """GPipe: every forward, then (training) every backward; all G activations stashed."""
    _check_sizes(stages, micro_batches)
    plan = []
    for s in range(stages):
        actions = [a for m in range(micro_batches) for a in _forward(s, m, stages)]
        if training:
            actions += [a for m in range(micro_batches) for a in _backward(s, m, stages)]
            actions.append(Action(Kind.STEP, s))
        plan.append(actions)
    return plan


def sharded(stages: int, micro_batches: int, *, training: bool) -> Plan:
    """One micro-batch at a time: through every stage (and back) before the next one starts.

    In training the gradients coming back hold stage 0 until a micro-batch is done. Inference
    has no backward, so the last stage sends a done signal (no data) to stage 0 instead.
    """
    _check_sizes(stages, micro_batches)
    last = stages - 1
    plan = []
    for s in range(stages):
        actions = []
        for m in range(micro_batches):
            actions += _forward(s, m, stages)
            if training:
                actions += _backward(s, m, stages)
            elif last > 0 and m < micro_batches - 1 and s in (0, last):
                kind, peer = (Kind.RECV_DONE, last) if s == 0 else (Kind.SEND_DONE, 0)
                actions.append(Action(kind, s, m, peer))
        if training:
            actions.append(Action(Kind.STEP, s))
        plan.append(actions)
    return plan


def plan(kind: str, stages: int, micro_batches: int, *, training: bool) -> Plan:
    """The plan of `kind`; "pipelined" is 1F1B for training and fill-drain for inference,
    "zero_bubble" ZB-H1 for training and fill-drain for inference."""
    if kind == "pipelined":
        kind = "1f1b" if training else "fill_drain"
    if kind == "1f1b":
        if not training:
            raise ValueError(
                "The 1f1b schedule interleaves forwards and backwards, so it needs "
                "training=True; use 'fill_drain' or 'pipelined' for inference")
        return one_f_one_b(stages, micro_batches)
    if kind == "zero_bubble":
        return zero_bubble(stages, micro_batches) if training else fill_drain(
            stages, micro_batches, training=False)
    if kind == "fill_drain":
        return fill_drain(stages, micro_batches, training=training)
    if kind == "sharded":
        return sharded(stages, micro_batches, training=training)
    raise ValueError(f"Unknown schedule kind {kind!r}; use one of {', '.join(KINDS)}")


def _check_sizes(stages: int, micro_batches: int) -> None:
    for name, value in (("stages", stages), ("micro_batches", micro_batches)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


def _forward(s: int, m: int, stages: int) -> list[Action]:
    return _recv_act(s, m) + [Action(Kind.FORWARD, s, m)] + _send_act(s, m, stages)


def _backward(s: int, m: int, stages: int) -> list[Action]:
    return _recv_grad(s, m, stages) + [Action(Kind.BACKWARD, s, m)] + _send_grad(s, m)


# The first stage gets its inputs and the last its labels from the host, not from a peer.
def _recv_act(s: int, m: int) -> list[Action]:
    return [Action(Kind.RECV_ACT, s, m, s - 1)] if s > 0 else []


def _send_act(s: int, m: int, stages: int) -> list[Action]:
    return [Action(Kind.SEND_ACT, s, m, s + 1)] if s < stages - 1 else []


def _recv_grad(s: int, m: int, stages: int) -> list[Action]:
    return [Action(Kind.RECV_GRAD, s, m, s + 1)] if s < stages - 1 else []


def _send_grad(s: int, m: int) -> list[Action]:
    return [Action(Kind.SEND_GRAD, s, m, s - 1)] if s > 0 else []
