"""Cost table for balancing: each candidate segment's measured forward+backward time,
activations kept per micro-batch, parameter + optimiser bytes and boundary transfer time."""
from __future__ import annotations

import time
from typing import Sequence

import torch
from torch import nn

from pipetorch.losses import tensor_leaves
from pipetorch.partition.balance import Segment
from pipetorch.planning.memory import bytes_of
from pipetorch.planning.probes import BlockProbe, ModuleProbe, Probe
from pipetorch.planning.timed_here import copy_rate

__all__: list[str] = []

def _loss_of(output: object) -> torch.Tensor:
    tensors = [t for t in tensor_leaves(output) if t.requires_grad]
    if not tensors:
        raise ValueError("The model's output has no tensor that requires grad, so its backward "
                         "cannot be profiled; balance a model in training mode with parameters")
    scalars = [t for t in tensors if t.dim() == 0]
    return scalars[-1] if scalars else tensors[0].float().sum()


def _one_step(model: nn.Module, probe: Probe, args: tuple,
              kwargs: dict[str, object]) -> tuple[list[float], list[float]]:
    """Forward and backward seconds per candidate segment for one micro-batch."""
    probe.reset()
    with torch.autograd.graph.saved_tensors_hooks(probe.pack, lambda t: t), probe.watching():
        start = time.perf_counter()
        loss = _loss_of(model(*args, **kwargs))
        fwd_end = time.perf_counter()
    bwd_start = time.perf_counter()
    loss.backward()
    bwd_end = time.perf_counter()
    n = len(probe.names)
    starts = [probe.fwd_start.get(k) for k in range(n)]
    starts[0] = start
    fwd = [_span(starts, k, fwd_end) for k in range(n)]
    # Backward of segment k runs from the gradient reaching k's output to it reaching k-1's.
    grad = [probe.grad_at.get(k, bwd_start) for k in range(n)]
    grad[n - 1] = bwd_start
    bwd = [max((grad[k - 1] if k > 0 else bwd_end) - grad[k], 0.0) for k in range(n)]
    return fwd, bwd


def _span(starts: list[float | None], k: int, end: float) -> float:
    start = starts[k]
    if start is None:
        return 0.0
    later = [s for s in starts[k + 1:] if s is not None]
    return max((later[0] if later else end) - start, 0.0)


def cost_table(model: nn.Module, names: Sequence[str], args: tuple,
               kwargs: dict[str, object] | None = None, *, repeats: int = 5,
               optimizer_slots: int = 2, link_bytes_per_s: float | None = None,
               scopes: bool = False) -> list[Segment]:
    """Profile `model` on the micro-batch `args` in this process: one Segment per candidate.

    `names` are submodules, or with `scopes` the user_ids of the Block scopes forward opens.
    Times are the least-disturbed (minimum) forward and backward over `repeats` steps after
    one warm-up, since a busy host only ever adds time; parameter bytes count weights,
    gradients and `optimizer_slots` optimiser states (2 for Adam/LAMB, 1 for SGD momentum).
    """
    if repeats < 1:
        raise ValueError(f"repeats ({repeats}) must be >= 1")
    link = link_bytes_per_s or copy_rate()
    probe = BlockProbe(names) if scopes else ModuleProbe(model, names)
    try:
        runs = []
        for _ in range(repeats + 1):
            runs.append(_one_step(model, probe, args, kwargs or {}))
            model.zero_grad(set_to_none=True)
    finally:
        probe.close()
    runs = runs[1:]
    return [Segment(
        name=name,
        seconds=min(f[k] for f, _ in runs) + min(b[k] for _, b in runs),
        activation_bytes=probe.saved[k],
        param_bytes=(2 + optimizer_slots) * bytes_of(probe.parameters(k)),
        transfer_seconds=2 * probe.out_bytes[k] / link,  # the output, and its gradient back
    ) for k, name in enumerate(names)]
