"""What the wrapper asks of an engine: LocalEngine (every stage in this process) and
ProcessEngine (a worker process per device and replica) both do it."""
from __future__ import annotations

from typing import Protocol, Sequence

import torch
import torch.nn as nn

from pipetorch.schedule.plans import Batching
from pipetorch.parallel.host.outputs import Collector
from pipetorch.parallel.comm.payloads import Trace
from pipetorch.partition.strategies import StageSpec

__all__: list[str] = []

MicroBatches = list[tuple[tuple, dict]]


class Engine(Protocol):
    """Runs host calls on the device copy of a model and keeps its host copy in step."""

    model: nn.Module                           # the host copy (workers) or the device copy
    optimizer: torch.optim.Optimizer | None    # likewise
    batching: Batching
    input_device: torch.device                 # where a call's inputs go first
    last_trace: list[Trace]                    # the last call's spans (none in process)
    in_process: bool                           # the device copy runs in this process

    @property
    def schedule(self) -> str: ...

    def train(self, micro_batches: MicroBatches, collector: Collector) -> None: ...

    def infer(self, micro_batches: MicroBatches, collector: Collector) -> None: ...

    def pull(self, *, optimizer_state: bool = False) -> None: ...

    def push(self, *, optimizer_state: bool = False) -> None: ...

    def pull_gradients(self) -> None: ...

    def set_hyperparameters(self) -> None: ...

    def rng_state(self, states: list[list[torch.Tensor]] | None = None
                  ) -> list[list[torch.Tensor]]: ...

    def use(self, key: int) -> None: ...

    def generate(self, model: nn.Module, stages: Sequence[StageSpec], *, lanes: int,
                 args: tuple, kwargs: dict) -> object:
        """HuggingFace's `model.generate(*args, **kwargs)`, every forward on the device."""
        ...

    def release(self) -> None: ...

    def acquire(self) -> None: ...

    def close(self) -> None: ...
