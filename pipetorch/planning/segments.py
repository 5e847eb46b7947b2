"""A model's candidate segments measured on fake tensors (the planner's cost table); each
segment is timed for real on this CPU by `timed_here.measure_here`.

The segments are what runs before the model's layer list (its largest ModuleList), each layer,
and what runs after it; code between two layers counts with the one before. One forward on
fake tensors under saved-tensor hooks (as `memory.measure_forward` sizes a stage) gives each
segment's Footprint, and a FlopCounterMode its forward FLOPs. Identical layers (same class and
parameter shapes) are measured once: for that forward the others stand aside, giving back the
first one's output, so forward may walk the list any way it likes.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, TypedDict

import torch
import torch.nn as nn

from pipetorch.losses import tensor_leaves
from pipetorch.partition.probe import modes_kept
from pipetorch.planning.memory import (
    ZERO, Footprint, Size, fake_tensors, faked, largest, module_tensors, sized, storage_key,
)

__all__: list[str] = []

@dataclass(eq=False)
class Piece:
    """A candidate segment: what one forward leaves on it, its forward FLOPs, its tensors."""

    name: str
    params: list[nn.Parameter] = field(default_factory=list)
    buffers: list[torch.Tensor] = field(default_factory=list)
    received: dict[int, Size] = field(default_factory=dict)
    saved: dict[int, Size] = field(default_factory=dict)
    outputs: dict[int, Size] = field(default_factory=dict)
    flops: int = 0

    def footprint(self) -> Footprint:
        kept = self._kept()

        def total(sizes: dict[int, Size]) -> Size:
            return sum(sizes.values(), ZERO)

        return Footprint(total(self.received), total(kept), total(self.outputs),
                         largest([*kept.values(), *self.outputs.values()]))

    def small(self, threshold: int) -> int:
        """Bytes of what one forward leaves on it (kept for backward or produced) in tensors
        of fewer than `threshold` bytes each."""
        return sum(s.bytes for s in (*self._kept().values(), *self.outputs.values())
                   if s.bytes < threshold)

    def _kept(self) -> dict[int, Size]:
        return {k: v for k, v in self.saved.items()
                if k not in self.received and k not in self.outputs}


def layer_list(model: nn.Module) -> tuple[str, nn.ModuleList | None]:
    """The ModuleList holding the most parameters (the layers), with its path."""
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        return "", None
    return max(lists, key=lambda nm: sum(p.numel() for p in nm[1].parameters()))


def _signature(module: nn.Module) -> tuple:
    return (type(module).__name__,
            tuple((n, tuple(t.shape), t.dtype) for n, t in module.state_dict().items()))


class _FlashAttention(torch.autograd.Function):
    """What flash attention keeps for backward: q, k, v, the output and one float32 log-sum-exp
    per query and head, never the scores."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> torch.Tensor:
        out = q.new_empty((*q.shape[:-1], v.shape[-1]))
        ctx.save_for_backward(q, k, v, out, q.new_empty(q.shape[:-1], dtype=torch.float32))
        return out


class _State(TypedDict, total=False):
    """What `measure`'s hooks share: the piece running, the FLOPs counted when it began, the
    identical layers stood in for so far, and the output of the last layer run (`again`)."""

    at: int
    flops: int
    stood: int
    again: object


def measure(model: nn.Module, inputs: tuple[tuple, dict], *, flash: bool = False) -> list[Piece]:
    """The candidate segments of `model` run on one micro-batch `inputs` (args, kwargs).
    With `flash`, scaled_dot_product_attention keeps what flash attention keeps (a GPU's
    kernel; on the meta device it would run the math one, which keeps the scores)."""
    from torch.utils.flop_counter import FlopCounterMode

    from pipetorch import ops

    _, layers = layer_list(model)
    units = layer_units(model) or list(model.named_children())
    same = layers is not None and len(units) > 1 and len({_signature(u) for _, u in units}) == 1
    run = [u for _, u in units[:1]] if same else [u for _, u in units]
    pieces = [Piece(""), *(Piece(n) for n, _ in units[:len(run)]), Piece(""), Piece("")]
    after = len(pieces) - 2  # the last: what runs between identical layers standing aside
    counter = FlopCounterMode(display=False)
    state: _State = {"at": 0, "flops": 0, "stood": 0}
    seen: set[int] = set()
    names = {id(m): n for n, m in model.named_modules()}

    def flush(to: int) -> None:
        total = counter.get_total_flops()
        pieces[state["at"]].flops += total - state["flops"]
        state["flops"], state["at"] = total, to

    def enter(k: int) -> Callable[[nn.Module, tuple, dict], None]:
        def hook(_: nn.Module, args: tuple, kwargs: dict) -> None:
            flush(k)
            pieces[k].received.update(_sizes((args, kwargs), weights))
        return hook

    def leave(k: int) -> Callable[[nn.Module, tuple, object], None]:
        def hook(_: nn.Module, __: tuple, output: object) -> None:
            pieces[k].outputs.update(_sizes(output, weights))
            state["again"] = output
            flush(k if k < len(units) else after)  # code between layers: the one before
        return hook

    def stood_in() -> None:  # an identical layer's turn: what runs until the next is not priced
        state["stood"] += 1
        flush(after if state["stood"] == len(units) - 1 else after + 1)

    def touched(module: nn.Module, *_: tuple) -> None:
        at = pieces[state["at"]]
        if state["at"] in (0, after) and id(module) not in seen | inside:
            seen.add(id(module))
            at.name = at.name or names[id(module)]
            at.params += list(module.parameters(recurse=False))
            at.buffers += list(module.buffers(recurse=False))

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = storage_key(tensor)
        if key not in weights:
            nbytes = tensor.untyped_storage().nbytes()
            pieces[state["at"]].saved.setdefault(key, sized(tensor, nbytes))
        return tensor

    # scaled_dot_product_attention's other arguments (attn_mask, dropout_p, is_causal, scale,
    # enable_gqa) go unread
    def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  *_: torch.Tensor | float | None,
                  **__: torch.Tensor | float | None) -> torch.Tensor:
        # QK^T and PV, as counted
        pieces[state["at"]].flops += 4 * query.numel() * key.shape[-2]
        return _FlashAttention.apply(query, key, value)

    sdpa = nn.functional.scaled_dot_product_attention
    inside = {id(m) for unit in run for m in unit.modules()}
    handles = [h for k, unit in enumerate(run, 1)
               for h in (unit.register_forward_pre_hook(enter(k), with_kwargs=True),
                         unit.register_forward_hook(leave(k)))]
    handles += [m.register_forward_pre_hook(touched) for m in model.modules()
                if m._parameters or m._buffers]
    again = _Again(state, stood_in)
    slots = layers._modules if layers is not None and same else {}
    try:
        for key in list(slots)[1:]:
            slots[key] = again  # the model's own indexing and slicing still work
        if flash:
            nn.functional.scaled_dot_product_attention = attention
        with modes_kept(model), fake_tensors() as mode, ops.running_on_device():
            model.train(True)
            fake = faked(mode)
            # the fake weights are held (a freed storage's key is reused), and their real
            # (meta) tensors' keys kept too: a meta weight may reach an op as it is
            held = [(w, fake(w)) for w in module_tensors(model)]
            weights = {storage_key(t) for pair in held for t in pair}
            args, kwargs = torch.utils._pytree.tree_map(
                lambda t: fake(t) if isinstance(t, torch.Tensor) else t, inputs)
            pieces[0].received.update(_sizes((args, kwargs), weights))
            with torch.enable_grad(), counter, \
                    torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                output = model(*args, **kwargs)
            flush(after)
            pieces[after].outputs.update(_sizes(output, weights))
    finally:
        nn.functional.scaled_dot_product_attention = sdpa
        for key, (_, unit) in zip(list(slots)[1:], units[1:], strict=False):
            slots[key] = unit
        for h in handles:
            h.remove()
    pieces.pop()  # between identical layers standing aside
    middle = pieces[1:-1]
    if same:  # the other identical layers: the first one's sizes, their own tensors
        middle = [replace(middle[0], name=n) for n, _ in units]
    for piece, (_, unit) in zip(middle, units, strict=True):
        piece.params, piece.buffers = list(unit.parameters()), list(unit.buffers())
    pieces = [pieces[0], *middle, pieces[-1]]
    if middle:
        pieces[0].outputs = dict(middle[0].received)
        pieces[-1].received = dict(middle[-1].outputs)
    owned = {id(p) for piece in pieces for p in piece.params}
    pieces[0].params += [p for p in model.parameters() if id(p) not in owned]  # never run
    for piece, default in ((pieces[0], "(before the layers)"), (pieces[-1], "(after them)")):
        piece.name = piece.name or default
    mids = {id(m) for m in middle}
    kept = [p for p in pieces if p.params or p.saved or p.flops or id(p) in mids]
    return kept


class _Again(nn.Module):
    """Stands in for an identical layer while measuring: gives back the first layer's output
    (the same shapes), so the layer list is run once whatever way forward walks it."""

    def __init__(self, state: _State, turn: Callable[[], None]) -> None:
        super().__init__()
        self.state, self.turn = state, turn

    def forward(self, *_: object, **__: object) -> object:
        self.turn()
        return self.state["again"]


def _sizes(value: object, weights: set[int]) -> dict[int, Size]:
    return {storage_key(t): sized(t, t.untyped_storage().nbytes())
            for t in tensor_leaves(value) if storage_key(t) not in weights}


def layer_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    path, layers = layer_list(model)
    return [(f"{path}.{i}", u) for i, u in enumerate(layers)] if layers is not None else []
