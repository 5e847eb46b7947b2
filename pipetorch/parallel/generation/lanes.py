"""Generation in the stage workers: each worker runs its stages of a model's forward eagerly
(parallel.generation.eager_stage) for every sequence lane of a step, keeping each lane's key/value cache
of its own layers between steps (parallel.generation.kv_cache), and hands the next stage its inputs
through its link (parallel.comm.hops).

One host step (one forward of HuggingFace's generate loop) is split into lanes, groups of
sequences; a worker runs lane after lane, so while stage 1 runs lane 0, stage 0 runs lane 1:

    stage 0:  L0  L1  L2  L3
    stage 1:      L0  L1  L2  L3     -> logits of each lane to the host

A batched step runs its lanes as one batch (their rows and their caches joined, each stage's
weights read once for all of them), then hands each lane its rows back.
"""
from __future__ import annotations

import copy
from typing import Any, TypeVar

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from pipetorch.parallel.generation import kv_cache

from pipetorch.parallel.worker import skeletons
from pipetorch.parallel.generation.eager_stage import Boundary, EagerStage
from pipetorch.parallel.comm.hops import Hops
from pipetorch.parallel.comm.payloads import LaneCall, Skeleton, Step, StepResult
from pipetorch.parallel.comm.transport import PeerLink

__all__: list[str] = []

T = TypeVar("T")


def skeleton(model: nn.Module, stage_of_block: dict[str, int]) -> Skeleton:
    """`model`'s structure and code for the workers: no parameter's bytes are copied."""
    first: dict[int, str] = {}
    names = {name: first.setdefault(id(tensor), name)
             for name, tensor in [*model.named_parameters(remove_duplicate=False),
                                  *model.named_buffers(remove_duplicate=False)]}
    return Skeleton(skeletons.skeleton(model, buffers=False), names, dict(stage_of_block))


def bind(found: Skeleton, held: dict[str, torch.Tensor], device: torch.device) -> nn.Module:
    """The skeleton's model with the tensors a worker holds (by any of their names) in place
    of their meta copies, and its other buffers on `device`."""
    mine = {found.first_names.get(name, name): tensor for name, tensor in held.items()}
    return skeletons.bind(found.model, mine, first=found.first_names, device=device).eval()


class _Skip:
    """Sent to the next stage for a lane an earlier stage finished (an encoder's call)."""


class Generation:
    """A worker's stages, run eagerly for generation; `devices[s]` is stage s's device (this
    worker's: `mine`), and `link` reaches the others."""

    def __init__(self, found: Skeleton, stages: dict[int, dict[str, torch.Tensor]], *,
                 devices: tuple[int, ...], mine: int, device: torch.device,
                 link: PeerLink) -> None:
        self.stages = {s: EagerStage(bind(copy.deepcopy(found), held, device), s,
                                     found.stage_of_block, device)
                       for s, held in sorted(stages.items())}
        self.devices, self.mine, self.device = devices, mine, device
        self.hops = Hops(link)
        self.session = -1
        self.caches: dict[tuple[int, int], Any] = {}  # (stage, lane) -> its cache
        # (stage, first lane) -> the lanes (and their rows) whose caches the first lane's cache
        # holds, joined while the same lanes run as one batch, given back when they do not
        self.joined: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
        self._local: list[Any] = []  # values for this worker's own next stage

    def step(self, step: Step) -> StepResult:
        if step.session != self.session:
            self.caches.clear()
            self.joined.clear()
            self.session = step.session
        result = StepResult()
        groups = [sorted(step.lanes)] if step.batched else [[lane] for lane in sorted(step.lanes)]
        for s, stage in self.stages.items():
            for lanes in groups:
                self._run(s, stage, lanes, step, result)
        self.hops.settle()  # before the reply: this worker then waits on the host's pipe
        return result

    def end(self) -> None:
        """Drop every lane's cache (the host's generate() returned)."""
        self.hops.wait()
        self.caches.clear()
        self.joined.clear()
        self.session = -1

    def _run(self, s: int, stage: EagerStage, lanes: list[int], step: Step,
             result: StepResult) -> None:
        last = s == len(self.devices) - 1
        entry = self._receive(s - 1) if s > 0 else None
        if isinstance(entry, _Skip):
            if not last:
                self._send(_Skip(), s + 1)
            return
        calls = [step.lanes[lane] for lane in lanes]
        counts = [rows(c) for c in calls]
        cache = self._joined(s, lanes, counts, step) if kv_cache.has_slot(calls) else None
        args, kwargs = kv_cache.fill(self._crossed(join(calls), self.device), cache)
        if entry is not None:
            entry = Boundary(*kv_cache.fill((entry.args, entry.kwargs, entry.records), cache))
        out = stage.run(step.path, args, kwargs, entry)
        if isinstance(out, Boundary):
            self._send(Boundary(*kv_cache.strip((out.args, out.kwargs, out.records))), s + 1)
        else:
            parts = split(self._crossed(kv_cache.strip(out), torch.device("cpu")), counts)
            result.outputs.update(zip(lanes, parts, strict=True))
            if not last:
                self._send(_Skip(), s + 1)
        if cache is not None:
            for lane, count in zip(lanes, counts, strict=True):
                result.shapes.setdefault(lane, {}).update(kv_cache.held_shapes(cache, count))

    def _joined(self, s: int, lanes: list[int], counts: list[int], step: Step) -> Any:
        """Stage `s`'s cache for `lanes` run as one batch: the first lane's, holding all
        their rows (a batch joined before that shares a lane gives its lanes theirs back)."""
        for key, (held, parts) in list(self.joined.items()):
            if key[0] == s and held != lanes and set(held) & set(lanes):
                kv_cache.scatter([self.caches[s, lane] for lane in held], parts)
                del self.joined[key]
        caches = [self._cache(s, lane, step) for lane in lanes]
        if (s, lanes[0]) not in self.joined:
            for lane, cache in zip(lanes, caches, strict=True):
                kv_cache.mirror(cache, step.shapes.get(lane, {}))
            kv_cache.gather(caches)
            if len(lanes) > 1:
                self.joined[s, lanes[0]] = (lanes, counts)
        else:  # the other stages' layers, as long as all the lanes' together
            kv_cache.mirror(caches[0], {key: ((sum(counts), *shape[1:]), dtype) for key, (
                shape, dtype) in step.shapes.get(lanes[0], {}).items()})
        return caches[0]

    def _cache(self, s: int, lane: int, step: Step) -> Any:
        key = (s, lane)
        if key not in self.caches:
            if step.template is None:
                raise RuntimeError(f"Lane {lane} of stage {s} has no key/value cache yet and "
                                   "the step brought no empty one to copy")
            self.caches[key] = copy.deepcopy(step.template)
        return self.caches[key]

    def _crossed(self, tree: T, device: torch.device) -> T:
        """`tree` (from the host, or back to it) with its tensors on `device`; a CPU worker's
        are there already (a traversal less on each side of every step)."""
        return tree if self.device.type == "cpu" else _to(tree, device)

    def _send(self, value: Boundary | _Skip, stage: int) -> None:
        if self.devices[stage] == self.mine:
            self._local.append(value)
        else:
            self.hops.send(value, self.devices[stage])

    def _receive(self, stage: int) -> Any:
        if self.devices[stage] == self.mine:
            return self._local.pop(0)
        return self.hops.receive(self.devices[stage], self.device)


def rows(call: LaneCall) -> int:
    """The rows of a call: the first dimension of its first tensor of two or more (a 1-d
    tensor, such as cache_position, is the same for every row)."""
    leaves = pytree.tree_leaves(call, is_leaf=kv_cache.is_cache_or_slot)
    return next((v.shape[0] for v in leaves if isinstance(v, torch.Tensor) and v.dim() >= 2), 1)


def join(calls: list[T], *, least_dim: int = 2) -> T:
    """The calls (alike but for their rows) as one: their row tensors (those of `least_dim`
    dimensions or more; 1 for results, where a 1-d tensor has a value per row) concatenated."""
    if len(calls) == 1:
        return calls[0]
    flat = [pytree.tree_flatten(call, is_leaf=kv_cache.is_cache_or_slot) for call in calls]
    leaves, spec = flat[0]
    return pytree.tree_unflatten(
        [torch.cat([f[0][i] for f in flat]) if isinstance(leaf, torch.Tensor)
         and leaf.dim() >= least_dim else leaf for i, leaf in enumerate(leaves)], spec)


def split(tree: T, counts: list[int]) -> list[T]:
    """`tree` cut into parts of `counts` rows (the inverse of `join`)."""
    if len(counts) == 1:
        return [tree]
    leaves, spec = pytree.tree_flatten(tree, is_leaf=kv_cache.is_cache_or_slot)
    cut = [leaf.split(counts) if isinstance(leaf, torch.Tensor) and leaf.dim() >= 2
           and leaf.shape[0] == sum(counts) else [leaf] * len(counts) for leaf in leaves]
    return [pytree.tree_unflatten([c[i] for c in cut], spec) for i in range(len(counts))]


def _to(tree: T, device: torch.device) -> T:
    """`tree` with its tensors on `device` (the host's inputs in, results back to the host)."""
    return pytree.tree_map(lambda v: v.to(device) if isinstance(v, torch.Tensor) else v, tree,
                           is_leaf=kv_cache.is_cache_or_slot)
