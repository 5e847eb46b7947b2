"""One stage of a model's forward run eagerly in its worker, as Python code (generation):
the whole forward runs, the modules of earlier stages are skipped, and the stage is entered
and left at its BeginBlock modules.

    stage 0's worker:  embed  h0  h1 | h2 -> leaves: h2's inputs go to stage 1
    stage 1's worker:  (skip) --  -- | h2 <- enters with those inputs,  h3  ln_f  lm_head

Entering replaces the first module's inputs with the ones the previous stage computed; the
code around the layers (masks, positions, rotary tables) runs in every worker, on the values
each worker's key/value cache reports (see kv_cache). A module of an earlier stage gives, in
place of its result, zeros shaped as the earlier stage's result was (each hop brings those
shapes, in the order the modules ran): a T5 block's tuple, a layer's hidden states. This is how
HuggingFace's `generate()` runs in the stages with each worker keeping the cache of its own
layers.

A model with a stage begun inside forward (a `with Block(...)` scope, `Block.start`), which
has no module to enter at, or at a module that is not an item of a stack of layers (a layer's
attention or MLP, whose residual was computed before it; a head, whose input is read from the
body's output object), runs by replay instead: a stage leaves when a later stage's block
begins, handing on the results of the outermost modules it and the stages before it ran, in
order; a later stage runs forward from the start, each of those calls giving its recorded
result, until its own block begins.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ParamSpec, TypeVar

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree
from torch.utils.hooks import RemovableHandle

from pipetorch.errors import CompileError
from pipetorch.partition import blocks
from pipetorch.partition.export import Tree

__all__: list[str] = []

P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True)
class Like:
    """A tensor in a module's result that the next stage replaces with zeros: its shape and
    dtype, not its values."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class Boundary:
    """The inputs of the next stage's first module, as this stage computed them, and the
    results of the outermost modules run so far, in order (module name, result): the results
    themselves for replay, else their tensors as Like."""

    args: tuple
    kwargs: dict
    records: tuple[tuple[str, Any], ...] = ()


class _Leave(BaseException):
    """Raised at the next stage's first module (BaseException: no `except Exception` in a
    model's forward catches it)."""

    def __init__(self, boundary: Boundary) -> None:
        super().__init__()
        self.boundary = boundary


class EagerStage:
    """Stage `index` of `model` (a copy whose other stages' parameters are on the meta device)."""

    def __init__(self, model: nn.Module, index: int, stage_of_block: dict[str, int],
                 device: torch.device) -> None:
        self.model, self.index, self.stage_of_block = model, index, stage_of_block
        self.device = device
        self._entry: Boundary | None = None
        self._inside = False
        self._records: list[tuple[str, Any]] = []  # what this call hands on
        self._replayed = 0  # the entry's records given so far
        starts = blocks.begin_blocks(model)
        begun = {stage_of_block.get(uid) for uid, _ in starts.values()}
        # a stage begun inside forward, or at a module that is not an item of a stack of layers:
        # every stage hands on its modules' results (replay)
        self.replay = any(s not in begun for s in set(stage_of_block.values()) - {0}) or any(
            not _in_a_stack(model, name) for name, (uid, _) in starts.items()
            if stage_of_block.get(uid, 0) > 0)
        mine = [name for name, (uid, _) in starts.items() if stage_of_block.get(uid) == index]
        # modules holding the stage's first module run in every stage: their code leads to it
        leading = {".".join(name.split(".")[:i]) for name in ([] if self.replay else mine)
                   for i in range(len(name.split(".")) + 1)} | {""}
        _after_unpickled_hooks(model)
        for name, module in model.named_modules():
            if name in starts and not self.replay:
                module.register_forward_pre_hook(self._crossing, with_kwargs=True)
            if any(True for _ in module.parameters()):
                wrap = self._recorded if name in leading else self._skippable
                module.forward = wrap(name, module, module.forward)

    def run(self, path: str, args: tuple, kwargs: dict, entry: Boundary | None) -> Any:
        """Call the module at `path` (the model: "") with `args`; the stage's result, or the
        Boundary where the next stage begins. `entry`: the previous stage's Boundary (None for
        stage 0, which starts at the beginning)."""
        self._entry, self._inside = entry, entry is None
        self._records, self._replayed = [], 0
        try:
            with blocks.recording() as recorder, torch.no_grad():
                if self.replay:
                    recorder.on_change = lambda: self._changed(recorder)
                result = self.model.get_submodule(path)(*args, **kwargs)
        except _Leave as leave:
            return leave.boundary
        finally:
            self._entry = None
        if not self._inside:
            raise CompileError(
                f"Stage {self.index}'s first module never ran during this call of "
                f"{path or type(self.model).__name__}: the stages' order in forward differs "
                "from their order in the split")
        return result

    def _crossing(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        """After BeginBlock's own hook: leave for a later stage, or enter this one."""
        recorder = blocks.active_recorder()
        current = recorder.current() if recorder is not None else None
        stage = self.stage_of_block.get(current, 0) if current is not None else 0
        if stage > self.index and not self._inside:  # this call passes this stage by
            assert self._entry is not None
            raise _Leave(self._entry)
        if stage > self.index:
            raise _Leave(Boundary(args, kwargs, tuple(self._records)))
        if stage == self.index and not self._inside:
            assert self._entry is not None
            self._inside = True
            return self._entry.args, self._entry.kwargs
        return None

    def _changed(self, recorder: blocks.BlockRecorder) -> None:
        """Replay: a block began or ended; leave for a later stage (this call may pass this
        stage by), or enter this one."""
        current = recorder.current()
        stage = self.stage_of_block.get(current, 0) if current is not None else None
        if stage is not None and stage > self.index:
            raise _Leave(Boundary((), {}, tuple(self._records)))
        if stage == self.index:
            self._inside = True

    def _zeroed(self, result: Tree) -> Tree:
        """An earlier stage's module result as zeros: its values are never used (the next
        stage's inputs come from the previous stage), so each is one zero seen in its shape,
        which costs no memory (a prompt's worth of hidden states each, otherwise) and which
        the model's code cannot write into unnoticed."""
        return pytree.tree_map_only(Like, lambda like: torch.zeros(
            (), dtype=like.dtype, device=self.device).expand(like.shape), result)

    def _recorded(self, name: str, module: nn.Module, forward: Callable[P, R]) -> Callable[P, R]:
        """A module whose code runs in this stage whatever (it holds the stage's first
        module): its result is handed on in place of its inner modules' results."""
        def run(*args: P.args, **kwargs: P.kwargs) -> R:
            done = len(self._records)
            result = forward(*args, **kwargs)
            self._record(done, name, result)
            return result

        return run

    def _record(self, done: int, name: str, result: Tree) -> None:
        """`name`'s result in place of its inner modules' (recorded since `done`): itself for
        replay, else its tensors' shapes (a layer's output is not kept alive for a hop that
        sends only its shape)."""
        if not self.replay:
            result = pytree.tree_map_only(torch.Tensor, _like, result)
        self._records[done:] = [(name, result)]

    def _skippable(self, name: str, module: nn.Module,
                   forward: Callable[P, object]) -> Callable[P, object]:
        own = list(module.parameters(recurse=False))
        foreign = bool(own) and all(p.is_meta for p in own)  # another stage's weights

        def run_or_skip(*args: P.args, **kwargs: P.kwargs) -> object:
            incoming = self._entry.records if self._entry is not None else ()
            at, done = self._replayed, len(self._records)
            if not self._inside and at < len(incoming) and incoming[at][0] == name:
                self._replayed += 1  # an earlier stage ran it: its result, or zeros like it
                self._records.append(incoming[at])
                return incoming[at][1] if self.replay else self._zeroed(incoming[at][1])
            if not self._inside and not self.replay:
                raise CompileError(
                    f"Stage {self.index} reached {name} ({type(module).__name__}) before its "
                    "first module, and no earlier stage ran it: forward took another path in "
                    "this stage than in the earlier ones. Begin the stage at a layer of the "
                    "model's layer list, or split with Block scopes")
            if foreign:
                raise CompileError(
                    f"Stage {self.index} reached {name} ({type(module).__name__}), whose "
                    "weights another stage holds, without passing that stage's first module "
                    "in this call: a call that leaves out the module where a stage begins "
                    "(generate() runs the encoder once, then only the decoder) never changes "
                    "stage. Begin that stage where every call passes too: a BeginBlock on the "
                    "decoder, or on its first layer")
            result = forward(*args, **kwargs)
            self._record(done, name, result)
            return result

        return run_or_skip


def _in_a_stack(model: nn.Module, name: str) -> bool:
    """Whether the module `name` is an item of a stack: a ModuleList or ModuleDict of modules
    of one class (a decoder's layers, a T5 stack's blocks), whose code passes each item all it
    takes from the items before it. Elsewhere, the code around the module may keep earlier
    modules' results (a residual around a layer's attention, the position bias a T5 block's
    self-attention hands its cross-attention, a head reading the body's output object), which
    a stage entered there would lack."""
    parent, _, _ = name.rpartition(".")
    holder = model.get_submodule(parent) if name else None
    return isinstance(holder, (nn.ModuleList, nn.ModuleDict)) and len(holder) > 1 and len(
        {type(item) for item in holder.children()}) == 1


def _after_unpickled_hooks(model: nn.Module) -> None:
    """Number new hooks after the model's own: hooks are kept by number, the numbers restart
    in each process, and a model unpickled here (a worker) brings its hooks' numbers along,
    so the next hook registered could replace BeginBlock's."""
    used = [key for module in model.modules()
            for hooks in (module._forward_pre_hooks, module._forward_hooks) for key in hooks]
    RemovableHandle.next_id = max([RemovableHandle.next_id, *(k + 1 for k in used)])


def _like(tensor: torch.Tensor) -> Like:
    return Like(tuple(tensor.shape), tensor.dtype)
