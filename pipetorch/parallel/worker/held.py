"""A stage a device's worker holds: its bundles (what it receives and sends) and what a call
leaves waiting in it for a backward or a send (parallel.worker.stage runs it)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pipetorch.parallel.comm.payloads import DeviceStage, Trace
from pipetorch.parallel.comm.transport import BundleLayout
from pipetorch.parallel.layout.routes import Constant, TensorSpec
from pipetorch.parallel.worker.recompute import original_module
from pipetorch.parallel.worker.split_backward import Deferred
from pipetorch.partition.inplace import inplace_inputs
from pipetorch.partition.split import Source

__all__: list[str] = []

Spec = TensorSpec | Constant


@dataclass
class Forward:
    """What a forward leaves for its backward and for the sends after it."""

    values: dict[Source, Any]          # this stage's outputs and the values it received
    received: dict[Source, torch.Tensor]
    loss: torch.Tensor | None = None
    rewritten: set[Source] = field(default_factory=set)  # received values changed in place


def _bundle(sources: tuple[Source, ...], specs: dict[Source, Spec], *,
            grads: bool = False) -> tuple[tuple[Source, ...], BundleLayout]:
    """The tensor entries of a bundle (only those carrying a gradient when `grads`)."""
    chosen = [(s, spec) for s in sources if isinstance(spec := specs[s], TensorSpec)
              and (not grads or spec.requires_grad)]
    return tuple(s for s, _ in chosen), BundleLayout(tuple(spec for _, spec in chosen))


class HeldStage:
    """One held stage's bundles and its per-call state (what waits for a backward or a send)."""

    def __init__(self, stage: DeviceStage, specs: dict[Source, Spec], replica: int) -> None:
        self.module, self.route, self.inputs = stage.module, stage.route, stage.inputs
        self.clone_inputs = inplace_inputs(original_module(stage.module))
        # A recomputed (checkpointed) or compiled stage runs its whole backward in B: a
        # checkpoint would rerun the forward for W too, a compiled backward is one node.
        self.splits = original_module(stage.module) is stage.module
        self.act_in = _bundle(stage.route.receive, specs)
        self.act_out = _bundle(stage.route.send, specs)
        self.grad_in = _bundle(stage.route.send, specs, grads=True)
        self.grad_out = _bundle(stage.route.receive, specs, grads=True)
        self.replica = replica
        self.reset()

    def reset(self) -> None:
        self.received: dict[int, dict[Source, torch.Tensor]] = {}
        self.forwards: dict[int, Forward] = {}
        self.grads: dict[int, list[torch.Tensor]] = {}
        self.grads_out: dict[int, list[torch.Tensor]] = {}
        self.deferred: dict[int, Deferred | None] = {}  # micro-batch -> what its W computes
        self.outputs: dict[int, list[Any]] = {}
        self.trace = Trace(self.route.index, replica=self.replica)
