"""HuggingFace key/value caches split by stage: each worker's cache holds its own layers' keys
and values, and mirrors (meta tensors, no memory) of the lengths the other stages' layers have.

A model's forward reads the cache before its layers run: `get_seq_length()` gives the
positions of the new tokens, `get_mask_sizes()` the attention mask's width, both read from the
first layer. In a worker whose stage starts at layer 2, layers 0 and 1 never run, so their
entries would say "empty" and the positions and masks computed in the forward would be wrong
for the layers the worker does run. After every step each worker reports the shapes of the
layers it holds (`held_shapes`); before the next, every other worker mirrors them (`mirror`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch.utils import _pytree as pytree

from pipetorch.parallel.comm.payloads import LaneCall, Shapes
from pipetorch.partition.export import is_cache

if TYPE_CHECKING:  # the library never imports transformers: a model brings it
    from transformers.cache_utils import Cache

__all__: list[str] = []

T = TypeVar("T")


# the sub-caches of an encoder-decoder cache (transformers' EncoderDecoderCache)
_PARTS = ("self_attention_cache", "cross_attention_cache")


@dataclass(frozen=True)
class CacheSlot:
    """Where a key/value cache was in a call's arguments: each worker puts its own there."""


def is_cache_or_slot(value: object) -> bool:
    """A cache or its CacheSlot: a leaf that pytree must not open."""
    return isinstance(value, CacheSlot) or is_cache(value)


def strip(tree: T) -> T:
    """`tree` with every cache replaced by a CacheSlot (caches never cross processes)."""
    return pytree.tree_map(lambda v: CacheSlot() if is_cache(v) else v, tree, is_leaf=is_cache)


def fill(tree: T, cache: Cache | None) -> T:
    """`tree` with every CacheSlot replaced by `cache`."""
    return pytree.tree_map(lambda v: cache if isinstance(v, CacheSlot) else v, tree,
                           is_leaf=lambda v: isinstance(v, CacheSlot))


def has_slot(calls: list[LaneCall]) -> bool:
    """Whether lanes' calls have a CacheSlot."""
    return any(isinstance(v, CacheSlot) for v in pytree.tree_leaves(
        calls, is_leaf=lambda v: isinstance(v, CacheSlot)))


def find(call: LaneCall) -> Cache | None:
    """The first cache in a call's arguments, or None."""
    return next((v for v in pytree.tree_leaves(call, is_leaf=is_cache) if is_cache(v)), None)


def _layers(cache: Cache, prefix: str = "") -> dict[str, Any]:
    """The cache's layers by key ("3", "self_attention_cache.3")."""
    found: dict[str, Any] = {}
    layers = getattr(cache, "layers", None)
    if isinstance(layers, list):
        found.update((f"{prefix}{i}", layer) for i, layer in enumerate(layers))
    for part in _PARTS:
        sub = getattr(cache, part, None)
        if sub is not None:
            found.update(_layers(sub, f"{prefix}{part}."))
    return found


def _held(layer: object) -> bool:
    keys = getattr(layer, "keys", None)
    return (bool(getattr(layer, "is_initialized", False)) and isinstance(keys, torch.Tensor)
            and keys.device.type != "meta" and keys.numel() > 0)


def held_shapes(cache: Cache, rows: int | None = None) -> Shapes:
    """The shapes of the layers this worker computed (not its mirrors), as if `rows` long
    (a lane's, when the cache holds a batch of lanes)."""
    return {key: ((layer.keys.shape[0] if rows is None else rows, *layer.keys.shape[1:]),
                  layer.keys.dtype) for key, layer in _layers(cache).items() if _held(layer)}


def mirror(cache: Cache, shapes: Shapes) -> None:
    """Make the layers of `shapes` that this worker does not hold report those lengths."""
    for key, layer in _layers(cache).items():
        if key not in shapes or _held(layer):
            continue
        if type(layer).__name__ != "DynamicLayer":
            raise NotImplementedError(
                f"generate() through the stages keeps each stage's key/value cache in a "
                f"DynamicCache; this model's cache has {type(layer).__name__} layers "
                "(cache_implementation other than 'dynamic', or sliding-window attention). "
                "Generate with the default cache, or on one device")
        shape, dtype = shapes[key]
        layer.keys = torch.empty(shape, dtype=dtype, device="meta")
        layer.values = torch.empty(shape, dtype=dtype, device="meta")
        layer.dtype, layer.device, layer.is_initialized = dtype, torch.device("meta"), True


def joinable(caches: list[Cache]) -> bool:
    """Whether lanes' caches can run as one batch (DynamicCaches of DynamicLayers)."""
    return all(type(c).__name__ == "DynamicCache" and all(
        type(layer).__name__ == "DynamicLayer" for layer in _layers(c).values()) for c in caches)


def gather(caches: list[Cache]) -> Cache:
    """The first cache, holding every cache's rows in order; `scatter` gives each its rows
    back."""
    if len(caches) > 1:
        lanes = [_layers(cache) for cache in caches]
        for key, layer in lanes[0].items():
            if getattr(layer, "is_initialized", False):
                layer.keys = torch.cat([found[key].keys for found in lanes])
                layer.values = torch.cat([found[key].values for found in lanes])
    return caches[0]


def scatter(caches: list[Cache], rows: list[int]) -> None:
    """Give each cache its rows of the first (which `gather` joined them into)."""
    if len(caches) > 1:
        lanes = [_layers(cache) for cache in caches]
        for key, layer in lanes[0].items():
            if getattr(layer, "is_initialized", False):
                parts = zip(layer.keys.split(rows), layer.values.split(rows), strict=True)
                for found, (keys, values) in zip(lanes, parts, strict=True):
                    target = found[key]
                    target.keys, target.values = keys, values
                    target.dtype, target.device, target.is_initialized = (
                        layer.dtype, layer.device, True)
