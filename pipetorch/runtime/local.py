"""The reference engine: every stage and replica of a host call run in this process, in turn."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from pipetorch import ops
from pipetorch.runtime import devices
from pipetorch.enums import ReductionType
from pipetorch.losses import find_loss, for_backward
from pipetorch.optim.scaling import loss_scale
from pipetorch.runtime.casting import Casting, within
from pipetorch.runtime.outputs import OutputCollector

__all__: list[str] = []


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


def reduction_multiplier(batching: Batching) -> float:
    """The reduction part of the loss multiplier: 1/(G*R) when gradients are averaged over
    the G x R micro-batches of a step (Mean), 1 when they are summed."""
    if batching.reduction == ReductionType.Mean:
        return 1.0 / (batching.gradient_accumulation * batching.replication_factor)
    return 1.0


def _detach(output: Any) -> Any:
    return pytree.tree_map(
        lambda x: x.detach().to("cpu") if isinstance(x, torch.Tensor) else x, output)


class ReplicaBuffers:
    """Each replica's own copy of the buffers forward changes (broadcastBuffers(False))."""

    def __init__(self, model: nn.Module, names: list[str], replicas: int) -> None:
        self._slots: list[tuple[dict[str, torch.Tensor], str, list[torch.Tensor]]] = []
        for name in names:
            owner_name, _, attr = name.rpartition(".")
            owner = model.get_submodule(owner_name)
            first = owner._buffers[attr]
            assert first is not None
            copies = [first] + [first.detach().clone() for _ in range(replicas - 1)]
            self._slots.append((owner._buffers, attr, copies))

    @contextmanager
    def of(self, replica: int) -> Iterator[None]:
        """Swap replica `replica`'s buffers in for the duration of its micro-batch."""
        for table, attr, copies in self._slots:
            table[attr] = copies[replica]
        try:
            yield
        finally:
            for table, attr, copies in self._slots:
                table[attr] = copies[0]


class LocalEngine:
    """Runs host calls on one torch device: D optimiser steps of G x R micro-batches each."""

    def __init__(self, model: nn.Module, forward: Callable[..., Any], *,
                 optimizer: torch.optim.Optimizer | None, batching: Batching,
                 replica_buffers: ReplicaBuffers | None = None,
                 loss_index: int | None = None, casting: Casting | None = None) -> None:
        self.model, self.forward, self.optimizer = model, forward, optimizer
        # Around backward too: a recomputed forward must cast as the first one did.
        self.casting = casting
        self.loss_index = loss_index
        self.batching = batching
        self._replica_buffers = replica_buffers
        self.schedule = "local"  # every stage in this process, one after another
        self.last_trace: list = []  # no per-action spans in this engine
        self.input_device = next((t.device for t in [*model.parameters(), *model.buffers()]),
                                 torch.device("cpu"))

    # The device copy lives in this process: there is nothing to fetch, send or stop.
    def pull(self) -> None:
        """Device weights are `self.model` already."""

    def push(self, *, optimizer_state: bool = False) -> None:
        """Host edits copied into `self.model` (and `self.optimizer`) are on the device already."""

    def pull_gradients(self) -> None:
        """The last step's gradients are on `self.model` already."""

    def set_hyperparameters(self) -> None:
        """`self.optimizer` is the device's optimiser already."""

    def rng_state(self, states: list[list[torch.Tensor]] | None = None) -> list[list[torch.Tensor]]:
        """The device's random generators (this process's), set first when `states` is given."""
        if states is not None:
            if len(states) != 1:
                raise ValueError(f"This model runs on 1 device; rng_state got {len(states)} states")
            devices.set_rng_state(states[0], self.input_device)
        return [devices.rng_state(self.input_device)]

    def close(self) -> None:
        """Nothing runs outside this process."""

    def release(self) -> None:
        """The device copy stays in this process while detached."""

    def acquire(self) -> None:
        """Nothing to restart."""

    @contextmanager
    def _replica(self, replica: int) -> Iterator[None]:
        if self._replica_buffers is None:
            yield
        else:
            with self._replica_buffers.of(replica):
                yield

    def _walk(self, micro_batches: list[tuple[tuple, dict]], steps: range
              ) -> Iterator[tuple[int, int, tuple, dict]]:
        """(step, replica, args, kwargs) of the given steps, in [step][replica] order."""
        replicas = self.batching.replication_factor
        for step in steps:
            for r in range(replicas):
                args, kwargs = micro_batches[step * replicas + r]
                yield step, r, args, kwargs

    def train(self, micro_batches: list[tuple[tuple, dict]], collector: OutputCollector) -> None:
        """D optimiser steps, each over G x R micro-batches laid out [D][G][R]."""
        b = self.batching
        assert self.optimizer is not None and len(micro_batches) == b.micro_batches
        self.model.train()
        with ops.running_on_device(), within(self.casting):
            for d in range(b.device_iterations):
                # Read at every step: automatic loss scaling changes the scale between steps.
                scale = reduction_multiplier(b) * loss_scale(self.optimizer)
                self.optimizer.zero_grad(set_to_none=True)
                first = d * b.gradient_accumulation
                for step, r, args, kwargs in self._walk(
                        micro_batches, range(first, first + b.gradient_accumulation)):
                    with self._replica(r):
                        output = self.forward(*args, **kwargs)
                        assert self.loss_index is not None  # found by the probe
                        for_backward(find_loss(output, self.loss_index), scale).backward()
                    collector.add(step, r, _detach(output))
                self.optimizer.step()

    @torch.no_grad()
    def infer(self, micro_batches: list[tuple[tuple, dict]], collector: OutputCollector) -> None:
        """Forward of every micro-batch, in [D][R] order (G is 1 for inference)."""
        self.model.eval()
        with ops.running_on_device(), within(self.casting):
            for step, r, args, kwargs in self._walk(micro_batches, range(self.batching.steps)):
                with self._replica(r):
                    collector.add(step, r, _detach(self.forward(*args, **kwargs)))
