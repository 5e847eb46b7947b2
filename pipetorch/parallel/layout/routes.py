"""Where each stage's values come from and go to: host inputs, neighbour bundles, host outputs.

Stages only talk to their neighbours. A value computed on stage j and read on stage k > j+1
(a skip connection over a stage) is relayed: it rides in the bundle from j to j+1, then from
j+1 to j+2, ... In backward its gradient travels the same way back, each relaying stage adding
its own contribution when it reads the value too:

    stage 0 --[a, skip]--> stage 1 --[b, skip]--> stage 2      (activations)
    stage 0 <-[ga, gskip]-- stage 1 <-[gb, gskip]-- stage 2      (gradients)

Host inputs reach every stage that reads them straight from the host, and each stage ships
the forward outputs it computes straight to the host.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from pipetorch.partition.split import Source, StagedModel, map_leaves

if TYPE_CHECKING:
    from torch._subclasses.fake_tensor import FakeTensorMode

__all__: list[str] = []

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of a value crossing devices, and whether gradients flow back through it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class Constant:
    """A non-tensor value crossing stages (a size, a flag): fixed for the traced input shapes,
    so it is not sent; the producing stage checks that it keeps this value."""

    value: Any


@dataclass(frozen=True)
class Route:
    """Stage `index`'s traffic, every list in a fixed order both ends agree on."""

    index: int
    stages: int
    host_inputs: tuple[int, ...]      # forward's tensor arguments this stage reads
    receive: tuple[Source, ...]       # bundle from stage index-1
    send: tuple[Source, ...]          # bundle to stage index+1
    host_outputs: tuple[Source, ...]  # outputs of this stage that forward returns
    loss: Source | None               # the loss, when this stage computes it

    @property
    def is_last(self) -> bool:
        return self.index == self.stages - 1


def routes_of(staged: StagedModel, *, loss_index: int | None = None) -> list[Route]:
    """One Route per stage of `staged`; in training `loss_index` is the loss's position among
    forward's tensor outputs (`losses.final_loss_index`), None in inference."""
    count = len(staged.modules)
    leaves: list[Source] = []
    map_leaves(staged.output, Source, leaves.append)
    loss = leaves[loss_index] if loss_index is not None else None
    produced = [(j, k) for j, io in enumerate(staged.io) for k in range(len(io.outputs))]
    routes = []
    for s in range(count):
        def crossing(boundary: int) -> tuple[Source, ...]:
            # values made before `boundary` and read at or after it
            return tuple(Source.stage(j, k) for j, k in produced
                         if j < boundary and any(r >= boundary for r in staged.readers(j, k)))

        routes.append(Route(
            index=s, stages=count,
            host_inputs=tuple(sorted({src[1] for src in staged.io[s].inputs if src.kind == "input"})),
            receive=crossing(s) if s > 0 else (),
            send=crossing(s + 1) if s < count - 1 else (),
            host_outputs=tuple(dict.fromkeys(x for x in leaves if x.kind == "stage" and x[1] == s)),
            loss=loss if loss is not None and loss.kind == "stage" and loss[1] == s else None))
    return routes


def value_specs(staged: StagedModel, args: tuple, kwargs: dict, *,
                training: bool) -> dict[Source, "TensorSpec | Constant"]:
    """Every stage output's spec, found by running the captured stages on fake tensors.

    Fake tensors (torch's FakeTensorMode) carry shapes, dtypes and autograd's requires_grad
    through each op without computing anything or changing a weight, a buffer or the RNG:
    forward does not run. Gradients are enabled in training so `requires_grad` tells which
    values carry a gradient back. A graph fake tensors cannot run (an op without a fake
    kernel) is run once on the real micro-batch instead; the caller restores buffers and the
    RNG (see `probe.preserved`).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode  # imports sympy: only when splitting

    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            return _specs(staged, args, kwargs, training=training, mode=mode)
    except Exception as error:  # noqa: BLE001 - any failure: the real run gives the same specs
        logger.info("Value specs: fake tensors could not run the stages (%s: %s); running "
                    "them once on the first micro-batch", type(error).__name__, error)
        return _specs(staged, args, kwargs, training=training, mode=None)


def _specs(staged: StagedModel, args: tuple, kwargs: dict, *, training: bool,
           mode: FakeTensorMode | None) -> dict[Source, "TensorSpec | Constant"]:
    def fake(tensor: torch.Tensor) -> torch.Tensor:
        return tensor if mode is None else mode.from_tensor(tensor)

    inputs = [fake(t) for t in staged.flatten_inputs(*args, **kwargs)]
    produced: dict[Source, torch.Tensor] = {}

    def fetch(source: Source) -> Any:
        return inputs[source[1]] if source.kind == "input" else produced[source]

    specs: dict[Source, TensorSpec | Constant] = {}
    with torch.set_grad_enabled(training):
        for j, (module, io) in enumerate(zip(staged.modules, staged.io, strict=True)):
            state = {name: fake(t) for name, t in [*module.named_parameters(),
                                                   *module.named_buffers()]}
            outputs = torch.func.functional_call(module, state, tuple(fetch(s) for s in io.inputs))
            for k, value in enumerate(outputs):
                source = Source.stage(j, k)
                produced[source] = value
                specs[source] = (TensorSpec(tuple(value.shape), value.dtype,
                                            bool(value.requires_grad))
                                 if isinstance(value, torch.Tensor) else Constant(value))
    return specs
