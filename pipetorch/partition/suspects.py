"""Mistakes in a call's inputs that only real kernels notice, read from a capture made on fake
tensors: an integer tensor multiplied with float weights, a class label or an embedding index
out of range. Compiling then runs forward on the first micro-batch eagerly, so that torch's
own error, retold by runtime.checks, comes before any worker starts."""
from __future__ import annotations

import torch
import torch.fx as fx

from pipetorch.partition.inplace import arguments

__all__: list[str] = []

_A = torch.ops.aten
_ONE_DTYPE = {_A.linear.default, _A.mm.default, _A.addmm.default, _A.bmm.default,
              _A.matmul.default, _A.conv1d.default, _A.conv2d.default, _A.conv3d.default,
              _A.convolution.default}
_CLASS_LOSSES = {_A.cross_entropy_loss.default, _A.nll_loss.default, _A.nll_loss_nd.default,
                 _A.nll_loss2d.default}


def suspect(graph: fx.Graph, inputs: list[torch.Tensor]) -> bool:
    """Whether the captured `graph`, called with `inputs` (its placeholders' values), would
    fail in a real kernel on one of the mistakes above."""
    given = dict(zip(graph.find_nodes(op="placeholder"), inputs, strict=True))
    for node in graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if node.target in _ONE_DTYPE:
            if len({v.dtype for v in map(_value, node.args) if v is not None}) > 1:
                return True
            continue
        args = arguments(node)
        if node.target in _CLASS_LOSSES:
            scores = _value(args["self"])
            classes = scores.shape[1 if scores.dim() > 1 else 0] if scores is not None else 0
            if _outside(given.get(args["target"]), classes, args.get("ignore_index", -100)):
                return True
        elif node.target is _A.embedding.default:
            table = _value(args["weight"])
            if table is not None and _outside(given.get(args["indices"]), table.shape[0]):
                return True
    return False


def _value(arg: fx.node.Argument) -> torch.Tensor | None:
    value = arg.meta.get("val") if isinstance(arg, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _outside(values: torch.Tensor | None, size: int, ignored: fx.node.Argument = None) -> bool:
    """Whether integer `values` (a call's input) hold an index outside [0, size)."""
    if values is None or values.is_floating_point() or values.is_complex():
        return False
    if ignored is not None:
        values = values[values != ignored]
    return values.numel() > 0 and bool((values.min() < 0) | (values.max() >= size))
