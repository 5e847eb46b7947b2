"""The messages between the user's process and a worker: one frozen class per kind.

The host sends one message and waits for its reply; the worker dispatches by the message's
class (worker.HANDLERS) and answers Done(value) or, if it raised, a wire.Failure. Tensors in
any message travel storage by storage (parallel.comm.stream). docs/architecture.md has the table.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar, Union

import torch

from pipetorch.parallel.comm import arena
from pipetorch.parallel.layout import placement as places
from pipetorch.parallel.comm.rendezvous import Rendezvous
from pipetorch.parallel.layout.routes import Constant, TensorSpec
from pipetorch.parallel.comm.payloads import Call, DeviceStage, Skeleton, Step, Trace
from pipetorch.parallel.layout.ties import Tie
from pipetorch.partition.split import Source
from pipetorch.weights.snapshot import StageState

__all__: list[str] = []

Specs = dict[Source, Union[TensorSpec, Constant]]
HyperValue = Union[float, int, bool, str, tuple, None]
Written = Union[tuple[float, int], None]  # a snapshot's (seconds, bytes); None: none written
R = TypeVar("R")


@dataclass(frozen=True)
class Setup:
    """Everything a worker needs, sent once in its first message."""

    stages: tuple[DeviceStage, ...]             # the device's stages, in pipeline order
    optimizer: torch.optim.Optimizer | None     # over all of their parameters
    specs: Specs
    schedule: str              # plans.KINDS or devices.INTERLEAVED
    owners: tuple[int, ...]    # every stage's device (its worker within the replica)
    devices: tuple[str, ...]   # the physical device of every worker of this host process
    ties: tuple[Tie, ...] = ()  # every weight tied across devices (the same on every worker)
    # replicated tensor sharding: (minimum elements of a sliced weight, replicas sharing out
    # the state: this host process's); None: off
    sharding: tuple[int, int] | None = None

    @property
    def device(self) -> int:
        """This worker's device number within its replica."""
        return self.owners[self.stages[0].route.index]


@dataclass(frozen=True)
class Launch:
    """The small arguments a worker is started with."""

    placement: places.Placement
    rendezvous: Rendezvous
    replica: int               # global replica: process_id x replicationFactor + local replica
    timeout: float
    host_pid: int
    snapshots: str | None      # folder for the state after calls (None: keep none)
    seed: int                  # random numbers: seed + rank, so runs repeat exactly
    start_snapshot: bool = False  # write the state at start-up (call 0): weights shared with
    # the host can be torn by a call cut short, and need a restore point from the start
    one_machine: bool = False  # every worker of the launch runs on this machine (several
    # processes of one machine): shared memory reaches them all


@dataclass(frozen=True)
class Start:
    """The first message: join the others and build the stages. Reply: the worker's pid."""

    launch: Launch
    setup: Setup


@dataclass(frozen=True)
class Run:
    """A host call (its inputs in the host's arena for this worker). Reply: RunReply."""

    call: Call                 # without inputs: they lie in the arena `packed` describes
    training: bool
    commit: int | None         # write the state after it as call `commit` (None: do not)
    packed: arena.Packed


@dataclass(frozen=True)
class RunReply:
    """A call's outputs (stage -> micro-batch -> values, tensors as places in `packed`) and
    the device's trace spans."""

    outputs: arena.StageOutputs
    traces: list[Trace]
    packed: arena.Packed


@dataclass(frozen=True)
class Pull:
    """Copy the weights (and the optimiser state, which moves) to the host. Reply: the number
    of snapshot.Items that follow the reply."""

    optimizer_state: bool


@dataclass(frozen=True)
class GiveState:
    """The optimiser state a Pull moved to the host, back (no weights). Reply: None."""

    states: dict[int, StageState]


@dataclass(frozen=True)
class Grads:
    """The last step's gradients, stage -> name -> tensor on the CPU. Reply: that dict."""


@dataclass(frozen=True)
class Push:
    """The host copy's weights (and optimiser state) for every stage; the state after it is
    call `commit`. Reply: Written."""

    states: dict[int, StageState]
    commit: int


@dataclass(frozen=True)
class Rng:
    """Set the random generators' state when given. Reply: their state."""

    states: list[torch.Tensor] | None


@dataclass(frozen=True)
class Hyper:
    """The optimiser's hyper-parameters, group by group (after setOptimizer). Reply: None."""

    groups: list[dict[str, HyperValue]]


@dataclass(frozen=True)
class Schedule:
    """Run schedule `name` from the next call on (pipelineSchedule "auto"). Reply: None."""

    name: str


@dataclass(frozen=True)
class AddSignature:
    """Another input signature's stages, without weights (parallel.host.signatures). Reply: None."""

    key: int
    stages: tuple[DeviceStage, ...]
    specs: Specs


@dataclass(frozen=True)
class Use:
    """Run input signature `key`'s stages from the next call on. Reply: None."""

    key: int


@dataclass(frozen=True)
class Generator:
    """The model's code without weights, for generate() (parallel.generation.lanes). Reply: None."""

    skeleton: Skeleton


@dataclass(frozen=True)
class Decode:
    """One generation step. Reply: payloads.StepResult."""

    step: Step


@dataclass(frozen=True)
class Decoded:
    """generate() returned: drop the key/value caches. Reply: None."""


@dataclass(frozen=True)
class Stop:
    """End the worker (the only message a failed worker still answers). Reply: None."""


@dataclass(frozen=True)
class Done(Generic[R]):
    """A worker's reply to a message it handled."""

    value: R


Message = Union[Start, Run, Pull, GiveState, Grads, Push, Rng, Hyper, Schedule, AddSignature,
                Use, Generator, Decode, Decoded, Stop]
