"""Which returned value is the loss: PopTorch's final loss, found by the operation that made it.

PopTorch does not look at where forward puts its loss; it looks for loss operations (a torch
loss function or `poptorch.identity_loss`) and trains on the *final* one: the loss on which no
later loss operation depends. Partial losses feeding a final `identity_loss` are fine:

    a = F.cross_entropy(x, y)              # partial: the next loss reads it
    b = F.mse_loss(z, t)                   # partial
    loss = poptorch.identity_loss(a + b, reduction="none")   # final
    return out, loss     # or (loss, out), {"loss": loss}, a ModelOutput...

A forward pass run under `LossGraph` records every loss operation and, by following which
tensors each op reads and writes, which earlier losses each one depends on.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
import torch
from torch.utils import _pytree as pytree
from torch.utils.weak import WeakIdKeyDictionary

from pipetorch.errors import CompileError

__all__: list[str] = []

IDENTITY_LOSS = "identity_loss"
_NONE: frozenset[int] = frozenset()


@dataclass
class LossGraph:
    """The loss operations of one forward, in order, and the losses each tensor depends on."""

    tensors: list[torch.Tensor] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)  # "identity_loss" or the torch function
    consumed: set[int] = field(default_factory=set)  # losses a later loss depends on
    _depends: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)

    def add(self, loss: torch.Tensor, kind: str) -> None:
        """Record the result of a loss operation; the losses it read are no longer final."""
        before = self.depends_on(loss)
        self.consumed |= before
        self.tensors.append(loss)
        self.kinds.append(kind)
        self._depends[loss] = before | {len(self.tensors) - 1}

    def propagate(self, args: tuple[object, ...], kwargs: dict[str, object] | None,
                  output: object) -> None:
        """An op read `args` and `kwargs` and returned `output`: the output depends on their
        losses."""
        if not self.tensors:  # nothing to follow before the first loss
            return
        found = _NONE.union(*(self.depends_on(t) for t in tensor_leaves((args, kwargs))))
        if found:
            for tensor in tensor_leaves(output):
                self._depends[tensor] = self.depends_on(tensor) | found

    def depends_on(self, tensor: torch.Tensor) -> frozenset[int]:
        """Indices of the recorded losses `tensor` was computed from (itself included)."""
        return self._depends.get(tensor, _NONE)

    def finals(self) -> list[int]:
        """The losses no later loss operation depends on."""
        return [i for i in range(len(self.tensors)) if i not in self.consumed]


# Forward's output, and a torch op's inputs and output, may be any value (a tensor, nested
# containers of tensors and other values, a ModelOutput...): pytree finds the tensors in it.
def tensor_leaves(output: object) -> list[torch.Tensor]:
    """Forward's returned tensors in pytree order (the order a captured graph returns them)."""
    return [x for x in pytree.tree_leaves(output) if isinstance(x, torch.Tensor)]


def find_loss(output: object, index: int) -> torch.Tensor:
    """The loss of one micro-batch's output: its tensor leaf `index` (see `final_loss_index`)."""
    return tensor_leaves(output)[index]


def for_backward(loss: torch.Tensor, scale: float) -> torch.Tensor:
    """What backward starts from: the loss times `scale` (reduction and loss scaling); a
    non-scalar loss (`identity_loss(x, "none")`) back-propagates its sum, as PopTorch does."""
    return (loss.sum() if loss.dim() else loss) * scale


def final_loss_index(output: object, graph: LossGraph) -> int:
    """Position among `output`'s tensor leaves of PopTorch's final loss.

    One final loss: the returned tensor that is it or, failing that, the one returned tensor
    computed from it. Several independent final losses are PopTorch's error, except where one
    returned tensor combines them all (HuggingFace's QA loss is `(start + end) / 2`): that
    tensor is the loss, a pipetorch extension. No loss operation at all: a lone tensor output
    or a "loss" entry, a floating-point scalar, is the loss; else CompileError.
    """
    opaque = opaque_dataclass(output)
    if opaque is not None:
        raise CompileError(f"Couldn't find a loss in graph! {opaque}")
    leaves = tensor_leaves(output)
    finals = graph.finals()
    if not finals:
        return _unmarked_loss(output, leaves)
    if len(finals) == 1:
        made = graph.tensors[finals[0]]
        exact = [i for i, leaf in enumerate(leaves) if leaf is made]
        if exact:
            return _checked(exact[0], output, graph, finals[0])
    covering = [i for i, leaf in enumerate(leaves) if leaf.is_floating_point()
                and set(finals) <= graph.depends_on(leaf)]
    if len(covering) == 1:
        return _checked(covering[0], output, graph, finals[0] if len(finals) == 1 else None)
    names = ", ".join(_describe(graph, i, output) for i in finals)
    if len(finals) > 1:
        raise CompileError(
            "Multiple independent losses found in graph. Graph must have one final loss. Wrap "
            f"final graph loss in poptorch.identity_loss. forward computed {len(finals)} losses "
            f"that no later loss uses: {names}; combine them into one and return it, e.g. "
            "poptorch.identity_loss(loss_a + loss_b, reduction='none')")
    where = (f"returned tensors {', '.join(_path(output, i) for i in covering)} are each "
             "computed from it" if covering else "forward does not return it")
    raise CompileError(
        f"Couldn't find a loss in graph! forward computes the loss {names} but {where}; return "
        "the loss itself (alone, in a tuple, or as the 'loss' entry of a dict)")


def opaque_dataclass(output: object) -> str | None:
    """What to do when forward returns a dataclass torch's pytree cannot open (one of the
    user's own, never registered: its tensors are invisible), else None."""
    if not dataclasses.is_dataclass(output) or isinstance(output, type):
        return None
    leaves = pytree.tree_leaves(output)
    if len(leaves) != 1 or leaves[0] is not output:  # (never ==: its fields may be tensors)
        return None
    return unregistered(type(output).__name__)


def unregistered(name: str) -> str:
    """The fix for a class forward returns that torch's pytree cannot open."""
    return (f"forward returns a {name}, which torch's pytree cannot open to find its tensors. "
            f"A dataclass of your own: register it once, after defining it, with "
            f"torch.export.register_dataclass({name}) (HuggingFace's ModelOutput classes are "
            "registered already); else return a tensor, or a tuple, list or dict of them")


def _checked(index: int, output: object, graph: LossGraph, final: int | None) -> int:
    """`index`, once the loss it names is a loss backward can start from."""
    loss = tensor_leaves(output)[index]
    if final is not None and graph.kinds[final] != IDENTITY_LOSS and loss.dim() > 0 \
            and graph.tensors[final] is loss:
        raise CompileError(
            f"The loss {_describe(graph, final, output)} has shape {list(loss.shape)}: a torch "
            "loss with reduction='none' gives one value per sample, from which PyTorch's "
            "backward() cannot start. Use reduction='mean' or 'sum', or mark it with "
            "poptorch.identity_loss(loss, reduction='none') to train on its sum")
    return index


def _unmarked_loss(output: object, leaves: list[torch.Tensor]) -> int:
    """No loss operation ran: a scalar output itself or a scalar "loss" entry; else an error."""
    if _scalar(output):
        return 0
    if isinstance(output, Mapping) and _scalar(output.get("loss")):
        return next(i for i, leaf in enumerate(leaves) if leaf is output["loss"])
    raise CompileError(
        f"Couldn't find a loss in graph! forward returned {_summary(output)} and ran no loss "
        "operation. Compute the loss with a torch loss function or mark it with "
        "poptorch.identity_loss(x, reduction='sum'|'mean'|'none'), and return it")


def _scalar(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() == 0


def _describe(graph: LossGraph, index: int, output: object) -> str:
    made = graph.tensors[index]
    kind = graph.kinds[index]
    name = f"poptorch.{kind}" if kind == IDENTITY_LOSS else f"F.{kind}"
    at = [_path(output, i) for i, leaf in enumerate(tensor_leaves(output)) if leaf is made]
    return f"{name} #{index + 1} ({f'returned as {at[0]}' if at else 'not returned'})"


def _path(output: object, index: int) -> str:
    """`output[1]`, `output['loss']`, `output.loss`: where tensor leaf `index` sits."""
    try:
        flat, _ = pytree.tree_flatten_with_path(output)
    except Exception:  # a container registered without key paths
        return f"tensor output #{index}"
    paths = [path for path, leaf in flat if isinstance(leaf, torch.Tensor)]
    return "output" + pytree.keystr(paths[index])


def _summary(output: object) -> str:
    if isinstance(output, torch.Tensor):
        return f"a {output.dtype} tensor"
    leaves = tensor_leaves(output)
    return f"{type(output).__name__} with {len(leaves)} tensor(s)"
