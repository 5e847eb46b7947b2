"""What forward reveals before splitting: its blocks, its loss, the buffers it changes.

`probe` runs forward once eagerly (a model that stays on one device); `probe_by_export`
reads the same from the one torch.export capture a split model needs anyway, so a split
model's first call runs forward once before its first step.
"""
from __future__ import annotations

import contextlib
import dataclasses
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, TypeVar

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from pipetorch import extensions, ops
from pipetorch.errors import CompileError
from pipetorch.losses import final_loss_index
from pipetorch.partition import blocks, export, op_log
from pipetorch.partition.blocks import BlockInfo, BlockRecorder
from pipetorch.partition.casting import Casting, within
from pipetorch.partition.export import Tree
from pipetorch.partition.inplace import written_attributes
from pipetorch.partition.trace import Traced

__all__: list[str] = []

T = TypeVar("T")


@dataclass(frozen=True)
class Capture:
    """What one forward pass of the model revealed."""

    blocks: list[BlockInfo]
    ops_before_blocks: bool
    uses_recomputation: bool
    mutated_buffers: list[str]
    output: Tree
    loss_index: int | None = None  # training: the final loss's position among output's tensors
    ops: tuple[tuple[str, str | None], ...] = ()  # (name, block) of each op, at DEBUG (op_log)


class _BlockGuard(TorchFunctionMode):
    """Fails an op that runs outside every block once blocks are in use (PopTorch's rule)."""

    def __init__(self, recorder: BlockRecorder, ops: op_log.OpRecorder | None = None) -> None:
        super().__init__()
        self.recorder = recorder
        self.ops = ops

    def __torch_function__(self, func: Callable[..., object], types: tuple[type, ...],
                           args: tuple = (), kwargs: dict[str, object] | None = None) -> object:
        out = func(*args, **(kwargs or {}))
        rec = self.recorder
        name = getattr(func, "__name__", repr(func))
        if not isinstance(out, torch.Tensor) or name == "__get__":  # .data, .grad: not ops
            return out
        if self.ops is not None:
            self.ops.record(name, rec.current())
        if not rec.used:
            rec.ops_before_blocks = True
        elif rec.current() is None:
            raise CompileError(
                f"No active Block: '{name}' runs after block {rec.last_ended!r} ended, outside "
                "any block. Once a model uses blocks every op after the first block must be in "
                "one: move it inside a `with poptorch.Block(...)`, or start a block with "
                "poptorch.Block.start(...) / BeginBlock"
            )
        return out


@contextmanager
def modes_kept(model: nn.Module) -> Iterator[None]:
    """Leave the train/eval mode of each of the model's modules as it was."""
    modes = {m: m.training for m in model.modules()}
    try:
        yield
    finally:
        for module, mode in modes.items():
            module.training = mode


@contextmanager
def preserved(model: nn.Module) -> Iterator[list[str]]:
    """Leave the model's buffers and the RNG as they were; yields the names of the buffers the
    block changed (filled in on exit)."""
    buffers = dict(model.named_buffers())
    saved = {n: b.detach().clone() for n, b in buffers.items()}
    versions = {n: b._version for n, b in buffers.items()}
    rng = torch.random.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    mutated: list[str] = []
    changed: tuple[list[str], list[str]] = ([], [])
    try:
        yield mutated
        changed = _replaced_buffers(model, buffers)
    finally:
        # Kernels such as batch_norm update running statistics without bumping the version
        # counter, so values are compared too.
        mutated += [n for n, b in buffers.items()
                    if b._version != versions[n] or not torch.equal(b, saved[n])]
        with torch.no_grad():
            for n in mutated:
                buffers[n].copy_(saved[n])
        torch.random.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
    _refuse_replaced_buffers(*changed)


def _refuse_replaced_buffers(removed: list[str], reassigned: list[str]) -> None:
    """PopTorch's errors for a buffer forward removed or reassigned."""
    if removed:
        raise CompileError(
            f"Buffer {removed[0]} is removed from the model when calling the forward method. "
            "The device keeps the buffers the model has when it is wrapped: leave them in "
            "place (the model's buffers were restored)")
    if reassigned:
        name = reassigned[0]
        raise CompileError(
            f"Buffer {name} is reassigned within the model when calling the forward method. "
            f"This is not supported. Consider using self.{name}.copy_(src) to copy data from "
            "a source tensor, where src is the name of the source tensor.")


def _replaced_buffers(model: nn.Module, before: dict[str, torch.Tensor]
                      ) -> tuple[list[str], list[str]]:
    """(removed, reassigned) buffer names after forward ran, each put back as it was before
    (PopTorch refuses both: the device holds the buffers the model was compiled with)."""
    now = dict(model.named_buffers())
    removed = [name for name in before if name not in now]
    reassigned = [name for name in before if name in now and now[name] is not before[name]]
    for name in removed + reassigned:
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._buffers[leaf] = before[name]
    return removed, reassigned


def probe(model: nn.Module, args: tuple, kwargs: dict, *, training: bool,
          casting: Casting | None = None) -> Capture:
    """Run forward once without gradients (under `casting`, see partition.casting), leaving the
    model's buffers and the RNG untouched."""
    model.train(training)
    # On copies of the inputs: forward may change its inputs in place (PopTorch hands such
    # changes back to the caller), and the real call must be the only one that does.
    args, kwargs = pytree.tree_map_only(torch.Tensor, torch.clone, (args, kwargs))
    named = op_log.OpRecorder(model) if op_log.wanted() else None
    with preserved(model) as mutated:
        with torch.no_grad(), blocks.recording() as rec, ops.record_calls() as calls, \
                _op_scopes(named), _BlockGuard(rec, named), ops.running_on_device(), \
                within(casting):
            output = model(*args, **kwargs)
    extensions.register_dict_outputs(output)
    found = _findings(rec, calls, output, mutated, training=training)
    return dataclasses.replace(found, ops=tuple(named.ops)) if named else found


def _op_scopes(named: op_log.OpRecorder | None) -> contextlib.AbstractContextManager:
    return named.scopes() if named is not None else contextlib.nullcontext()


def _findings(recorder: BlockRecorder, calls: ops.CallCounts, output: Tree,
              mutated: list[str], *, training: bool) -> Capture:
    """What one run of forward showed: `recorder` its blocks, `calls` its loss and checkpoint
    operations (ops.record_calls), `mutated` the buffers it changed."""
    return Capture(recorder.ordered(), recorder.ops_before_blocks,
                   calls["recomputationCheckpoint"] > 0, mutated, output,
                   final_loss_index(output, calls.losses) if training else None)


def probe_by_export(model: nn.Module, args: tuple, kwargs: dict, *, training: bool,
                    casting: Casting | None = None) -> tuple[Capture, Traced]:
    """`probe`'s findings and the graph to split from one torch.export capture (forward runs
    once, on fake tensors): the output as meta tensors, the changed buffers from the graph."""
    model.train(training)
    seen: dict[str, Any] = {}
    named = op_log.OpRecorder(model) if op_log.wanted() else None

    def watch(run: Callable[[], Tree]) -> Tree:
        recorder = blocks.active_recorder()
        assert recorder is not None  # export_blocks records the blocks
        with ops.record_calls() as calls, _op_scopes(named), _BlockGuard(recorder, named):
            output = run()
        extensions.register_dict_outputs(output)  # before torch.export flattens it
        seen.update(recorder=recorder, calls=calls, output=output)
        return output

    before = dict(model.named_buffers())
    with ops.running_on_device(), ops.quiet():
        traced = export.export_blocks(model, args, kwargs, casting=casting, watch=watch)
    _refuse_replaced_buffers(*_replaced_buffers(model, before))
    written = written_attributes(traced.module.graph)
    changed = [name for name, _ in model.named_buffers() if name in written]
    found = _findings(seen["recorder"], seen["calls"], seen["output"], changed,
                      training=training)
    return dataclasses.replace(found, output=on_meta(found.output),
                               ops=tuple(named.ops) if named else ()), traced


def on_meta(structure: T) -> T:
    """`structure` with each tensor replaced by an empty one of its shape and dtype."""
    return pytree.tree_map_only(torch.Tensor, lambda t: torch.empty(
        t.shape, dtype=t.dtype, device="meta"), structure)
