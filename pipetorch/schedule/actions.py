"""One step of a stage's schedule: a forward, a backward, a transfer or the optimiser step."""
from __future__ import annotations

import enum
from dataclasses import dataclass

__all__: list[str] = []


class Kind(enum.Enum):
    """What an action does; sends and receives name the tensor that crosses stages."""

    FORWARD = "F"
    BACKWARD = "B"
    BACKWARD_WEIGHT = "W"  # the weight gradients of a micro-batch whose B sent only its input's
    SEND_ACT = "S>F"   # activations of a micro-batch, towards the next stage
    RECV_ACT = "R<F"   # activations from the previous stage
    SEND_GRAD = "S<B"  # gradients of a micro-batch, towards the previous stage
    RECV_GRAD = "R>B"  # gradients from the next stage
    SEND_DONE = "S<D"  # no data: the micro-batch has left the last stage (sharded inference)
    RECV_DONE = "R>D"  # wait until a later stage says the micro-batch is done
    STEP = "STEP"      # one optimiser step after all the micro-batches' backwards
    ALL_REDUCE = "AR"  # gradients summed over the replicas of the stage, before STEP
    TIED_REDUCE = "TR"  # a weight tied across devices: its copies' gradients summed, before AR

    @property
    def is_whole_step(self) -> bool:
        """Kinds that cover every micro-batch of the step and have no peer."""
        return self in (Kind.STEP, Kind.ALL_REDUCE, Kind.TIED_REDUCE)

    @property
    def is_compute(self) -> bool:
        return self in (Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_WEIGHT)

    @property
    def is_transfer(self) -> bool:
        """Sends and receives, which wait for the peer's matching half."""
        return self in _COUNTERPART

    @property
    def counterpart(self) -> Kind:
        """The kind the peer must run for this transfer to happen (send <-> recv)."""
        return _COUNTERPART[self]


_COUNTERPART = {
    Kind.SEND_ACT: Kind.RECV_ACT, Kind.RECV_ACT: Kind.SEND_ACT,
    Kind.SEND_GRAD: Kind.RECV_GRAD, Kind.RECV_GRAD: Kind.SEND_GRAD,
    Kind.SEND_DONE: Kind.RECV_DONE, Kind.RECV_DONE: Kind.SEND_DONE,
}


@dataclass(frozen=True)
class Action:
    """`kind` on `stage` for `micro_batch` (None for STEP); transfers name their `peer` stage.

    `str()` is the short form used in tests and grids: "F3", "B3", "W3" (the weight gradients
    of micro-batch 3, in a plan whose B3 computes only the input's), "S>F3" (send micro-batch 3's
    activations to the next stage), "R<F3" (receive them from the previous stage), "S<B3" and
    "R>B3" for gradients, "S<D3"/"R>D3" for the done signal, "STEP". The arrow shows the side
    the peer is on, not its index.
    """

    kind: Kind
    stage: int
    micro_batch: int | None = None
    peer: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, Kind):
            raise TypeError(f"Action kind must be a Kind, got {self.kind!r}")
        if self.stage < 0:
            raise ValueError(f"Action stage must be >= 0, got {self.stage}")
        if self.kind.is_whole_step:
            if self.micro_batch is not None or self.peer is not None:
                raise ValueError(
                    f"{self.kind.value} covers every micro-batch and has no peer, got micro_batch="
                    f"{self.micro_batch}, peer={self.peer}; pass only the stage")
            return
        if self.micro_batch is None or self.micro_batch < 0:
            raise ValueError(f"{self.kind.name} needs a micro_batch >= 0, got {self.micro_batch}")
        if self.kind.is_compute and self.peer is not None:
            raise ValueError(f"{self.kind.name} runs on its own stage, got peer={self.peer}")
        if not self.kind.is_compute:
            self._check_peer()

    def _check_peer(self) -> None:
        if self.peer is None or self.peer == self.stage:
            raise ValueError(
                f"{self.kind.name} on stage {self.stage} needs a peer stage other than itself, "
                f"got peer={self.peer}")
        # Activations only ever flow to later stages, gradients and done signals to earlier ones.
        downstream = self.kind in (Kind.SEND_ACT, Kind.RECV_GRAD, Kind.RECV_DONE)
        if downstream != (self.peer > self.stage):
            side = "later" if downstream else "earlier"
            raise ValueError(
                f"{self.kind.name} on stage {self.stage} must have a {side} peer stage, "
                f"got peer={self.peer}")

    def matches(self, other: Action) -> bool:
        """True if `other` is the peer's half of the same transfer."""
        return (self.kind.is_transfer and other.kind is self.kind.counterpart
                and other.micro_batch == self.micro_batch
                and other.stage == self.peer and other.peer == self.stage)

    def __str__(self) -> str:
        if self.kind.is_whole_step:
            return self.kind.value
        return f"{self.kind.value}{self.micro_batch}"


Plan = list[list[Action]]
"""A schedule: `plan[i]` is the ordered action list of stage i."""
