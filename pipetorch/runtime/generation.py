"""`generate()` on an inferenceModel of a HuggingFace model split over worker processes:
HuggingFace's generation loop (sampling, stopping, padding) runs in the user's process, and
each forward it calls runs in the stages, where every worker keeps the key/value cache of its
own layers (parallel.generation).

Each forward's batch is cut into lanes (deviceIterations x replicationFactor of them, at most
one per sequence): lane i runs on replica i % replicationFactor, and a replica's stages run
its lanes one after another, so its devices work on different lanes at once.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from pipetorch.parallel import kv_cache
from pipetorch.parallel.engine import ProcessEngine
from pipetorch.parallel.generation import Step, skeleton
from pipetorch.partition.strategies import StageSpec

__all__: list[str] = []

_sessions = itertools.count(1)  # one per generate() call: the workers' caches belong to it

# generate() arguments asking for what only the whole model sees at once
_WHOLE_MODEL = ("output_attentions", "output_hidden_states")


def generate(model: nn.Module, engine: ProcessEngine, stages: list[StageSpec], *,
             lanes: int, args: tuple, kwargs: dict) -> Any:
    """`model.generate(*args, **kwargs)` with every forward it calls run in `engine`'s stages."""
    for name in _WHOLE_MODEL:
        if kwargs.get(name) or getattr(getattr(model, "generation_config", None), name, False):
            raise ValueError(
                f"generate({name}=True) is not supported through the stages: each stage sees "
                "only its own layers. Generate without it, or on one device")
    stage_of_block = {block: spec.index for spec in stages for block in spec.block_ids}
    engine.start_generation(skeleton(model, stage_of_block))
    steps = _Steps(engine, next(_sessions), lanes=lanes)
    try:
        with _routed(model, steps):
            return model.generate(*args, **kwargs)
    finally:
        engine.end_generation()


class _Steps:
    """Runs one forward call of the generation loop in the stages, lane by lane."""

    def __init__(self, engine: ProcessEngine, session: int, *, lanes: int) -> None:
        self.engine, self.session, self.lanes = engine, session, lanes
        self.shapes: dict[int, kv_cache.Shapes] = {}  # lane -> its cache's layers, all workers

    def __call__(self, path: str, args: tuple, kwargs: dict) -> Any:
        host_cache = kv_cache.find((args, kwargs))
        call = kv_cache.strip((args, kwargs))
        batch = _batch_size(call)
        rows = torch.arange(batch).tensor_split(min(batch, self.lanes))
        replicas = self.engine.replicas
        per_replica: list[dict[int, tuple[tuple, dict]]] = [{} for _ in range(replicas)]
        for lane, part in enumerate(rows):
            per_replica[lane % replicas][lane] = _rows(call, batch, int(part[0]), len(part))
        steps = [Step(self.session, path, mine, {i: self.shapes.get(i, {}) for i in mine},
                      template=host_cache) for mine in per_replica]
        outputs: dict[int, Any] = {}
        for result in self.engine.decode(steps):
            outputs.update(result.outputs)
            for lane, shapes in result.shapes.items():
                self.shapes.setdefault(lane, {}).update(shapes)
        return kv_cache.fill(_joined([outputs[lane] for lane in range(len(rows))]), host_cache)


def _batch_size(call: Any) -> int:
    """The rows of the call: the first dimension of its first tensor of two or more."""
    return next((leaf.shape[0] for leaf in _leaves(call)
                 if isinstance(leaf, torch.Tensor) and leaf.dim() >= 2), 1)


def _leaves(tree: Any) -> list[Any]:
    return pytree.tree_leaves(tree, is_leaf=lambda v: isinstance(v, kv_cache.CacheSlot))


def _rows(call: Any, batch: int, start: int, count: int) -> Any:
    """The call's arguments for rows start..start+count: every tensor of the batch cut there
    (a 1-d tensor, such as cache_position, is the same for every row)."""
    def cut(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 2 and leaf.shape[0] == batch:
            return leaf[start:start + count]
        return leaf

    return pytree.tree_map(cut, call, is_leaf=lambda v: isinstance(v, kv_cache.CacheSlot))


def _joined(outputs: list[Any]) -> Any:
    """The lanes' results as one: tensors concatenated along the batch."""
    flat = [pytree.tree_flatten(o, is_leaf=lambda v: isinstance(v, kv_cache.CacheSlot))
            for o in outputs]
    leaves, spec = flat[0]
    joined = [torch.cat([f[0][i] for f in flat]) if isinstance(leaf, torch.Tensor)
              and leaf.dim() >= 1 else leaf for i, leaf in enumerate(leaves)]
    return pytree.tree_unflatten(joined, spec)


@contextlib.contextmanager
def _routed(model: nn.Module, steps: _Steps) -> Iterator[None]:
    """While generate() runs: the model's forward, and its encoder's for an encoder-decoder
    model (HuggingFace calls the encoder once, itself), go to the stages."""
    targets = {"": model}
    encoder = model.get_encoder() if getattr(model.config, "is_encoder_decoder", False) else None
    if encoder is not None:
        targets.update((name, m) for name, m in model.named_modules() if m is encoder)
    own = {path: module.__dict__.get("forward") for path, module in targets.items()}
    for path, module in targets.items():
        module.forward = _forward(module.forward, path, steps)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for path, module in targets.items():
            if own[path] is None:
                del module.forward
            else:
                module.forward = own[path]  # type: ignore[method-assign]


def _forward(original: Callable[..., Any], path: str, steps: _Steps) -> Callable[..., Any]:
    # generate() reads forward's signature to decide what it passes (position_ids): keep it
    @functools.wraps(original)
    def in_stages(*args: Any, **kwargs: Any) -> Any:
        return steps(path, args, kwargs)

    return in_stages
