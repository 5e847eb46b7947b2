"""Nested batches (tensors in dicts, tuples, lists) as a flat list of tensors plus a tree."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypeGuard

import torch

from pipetorch import extensions

__all__: list[str] = []


@dataclass(frozen=True)
class BatchTree:
    """The shape of a nested batch: kind is 'leaf', 'dict', 'list', 'tuple', 'namedtuple' or
    'custom' (an ICustomArgParser type; keys holds the first object, the structure to rebuild)."""

    kind: str
    children: tuple[BatchTree, ...] = ()
    keys: tuple[object, ...] = ()
    cls: type | None = None


_LEAF = BatchTree("leaf")


def flatten(batch: object, *, where: str = "batch") -> tuple[list[torch.Tensor], BatchTree]:
    """Split a nested batch into its tensors (depth first) and the tree that rebuilds it."""
    leaves: list[torch.Tensor] = []
    tree = _flatten_into(batch, leaves, where)
    return leaves, tree


def _flatten_into(value: object, leaves: list[torch.Tensor], where: str) -> BatchTree:
    if isinstance(value, torch.Tensor):
        leaves.append(value)
        return _LEAF
    if isinstance(value, dict):
        keys = tuple(value.keys())
        children = tuple(_flatten_into(value[k], leaves, f"{where}[{k!r}]") for k in keys)
        return BatchTree("dict", children, keys)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        children = tuple(_flatten_into(v, leaves, f"{where}.{f}")
                         for f, v in zip(value._fields, value, strict=True))
        return BatchTree("namedtuple", children, cls=type(value))
    if isinstance(value, (list, tuple)):
        children = tuple(_flatten_into(v, leaves, f"{where}[{i}]") for i, v in enumerate(value))
        return BatchTree("list" if isinstance(value, list) else "tuple", children)
    parser = extensions.parser_for(type(value))
    if parser is not None:  # a type registered with poptorch.registerCustomArgParser
        children = tuple(_flatten_into(t, leaves, f"{where}.<tensor {i}>")
                         for i, t in enumerate(parser.yieldTensors(value)))
        return BatchTree("custom", children, keys=(value,), cls=type(value))
    raise TypeError(
        f"{where} is a {type(value).__name__}, but an asynchronous loader can only move "
        "tensors (alone or in dicts, tuples and lists) and types registered with "
        "poptorch.registerCustomArgParser (in the loader's process too: a spawned loader "
        "must register them on import). Convert it to a tensor in the dataset or collate_fn, "
        "register a parser, or use mode=DataLoaderMode.Sync.")


def unflatten(leaves: list[torch.Tensor], tree: BatchTree) -> Any:
    """Rebuild the nested batch that `flatten` split (inverse of `flatten`)."""
    position = iter(leaves)
    return _build(position, tree)


def _build(position: Iterator[torch.Tensor], tree: BatchTree) -> Any:
    if tree.kind == "leaf":
        return next(position)
    values = [_build(position, child) for child in tree.children]
    if tree.kind == "dict":
        return dict(zip(tree.keys, values, strict=True))
    if tree.kind in ("list", "tuple"):
        return values if tree.kind == "list" else tuple(values)
    assert tree.cls is not None, tree  # namedtuple and custom trees name their class
    if tree.kind == "namedtuple":
        return tree.cls(*values)
    parser = extensions.parser_for(tree.cls)
    if parser is None:
        raise TypeError(f"No poptorch.ICustomArgParser is registered for {tree.cls.__name__} "
                        "in this process: call registerCustomArgParser before iterating")
    return parser.reconstruct(tree.keys[0], iter(values))


def tensors_in(value: object) -> list[torch.Tensor]:
    """Every tensor of a nested value, skipping anything else (strings, numbers)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_in(v)]
    return []


def num_bytes(leaves: list[torch.Tensor]) -> int:
    """Bytes the tensors of one batch occupy (what crosses to the device)."""
    return sum(t.numel() * t.element_size() for t in leaves)


def batch_rows(leaves: list[torch.Tensor]) -> int | None:
    """Items in a batch: the first dimension shared by every tensor (None if they differ)."""
    sizes = {t.shape[0] if t.dim() > 0 else None for t in leaves}
    return sizes.pop() if len(sizes) == 1 else None


def _is_sequence(value: object) -> TypeGuard[list[object] | tuple[object, ...]]:
    return isinstance(value, (list, tuple)) and not hasattr(value, "_fields")


def concat_batches(batches: list[object], *, where: str = "batch") -> Any:
    """Join collated batches of one structure along dim 0 (tensors are concatenated, dicts
    and tuples joined key by key, lists of non-tensors such as strings put end to end).

    `batches[k]` is named "batch k" in errors: a structure, key or shape (beyond dim 0) that
    differs from batch 0 cannot be joined; tensors of different dtypes are promoted as
    `torch.cat` promotes them.
    """
    first = batches[0]
    if len(batches) == 1:
        return first
    if isinstance(first, torch.Tensor):
        return _concat_tensors(batches, where)
    kinds = {type(b) for b in batches}
    if len(kinds) != 1:
        names = [type(b).__name__ for b in batches]
        raise TypeError(f"{where}: the collated batches are of different types {names}; "
                        "collate_fn must return one structure for every batch.")
    if isinstance(first, dict):
        keys = list(first)
        dicts = [b for b in batches if isinstance(b, dict)]  # all of them: one type
        for k, batch in enumerate(dicts):
            if list(batch) != keys:
                raise ValueError(f"{where}: collated batch {k} has keys {list(batch)} but "
                                 f"batch 0 has {keys}; collate_fn must return the same keys.")
        return type(first)((key, concat_batches([b[key] for b in dicts],
                                                where=f"{where}[{key!r}]")) for key in keys)
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(concat_batches(list(parts), where=f"{where}.{name}")
                             for name, parts in zip(first._fields, zip(*batches, strict=True),
                                                    strict=True)))
    parser = extensions.parser_for(type(first))
    if parser is not None:  # a registerCustomArgParser type (PopTorch's CustomBatch): its
        # tensors joined position by position, then rebuilt around batch 0's object
        parts = [list(parser.yieldTensors(batch)) for batch in batches]
        joined = [concat_batches(list(column), where=f"{where}.<tensor {i}>")
                  for i, column in enumerate(zip(*parts, strict=True))]
        return parser.reconstruct(first, iter(joined))
    sequences = [b for b in batches if _is_sequence(b)]  # all or none: one type
    if _is_sequence(first) and any(tensors_in(b) for b in sequences):
        lengths = [len(b) for b in sequences]
        if len(set(lengths)) != 1:
            raise ValueError(f"{where}: the collated batches hold {lengths} items; collate_fn "
                             "must return the same number of items for every batch.")
        joined = [concat_batches(list(parts), where=f"{where}[{i}]")
                  for i, parts in enumerate(zip(*sequences, strict=True))]
        return joined if isinstance(first, list) else tuple(joined)
    if _is_sequence(first):  # strings, numbers: one entry per sample, put end to end
        return type(first)(item for batch in sequences for item in batch)
    raise TypeError(f"{where} is a {type(first).__name__}: collated batches can only be "
                    "joined when they hold tensors (alone or in dicts, tuples and lists) or "
                    "lists of per-sample values.")


def _concat_tensors(batches: list[object], where: str) -> torch.Tensor:
    tensors: list[torch.Tensor] = []
    for k, batch in enumerate(batches):
        if not isinstance(batch, torch.Tensor):
            raise TypeError(f"{where}: collated batch {k} is a {type(batch).__name__} where "
                            "batch 0 is a tensor; collate_fn must return one structure.")
        tensors.append(batch)
        if batch.dim() == 0 or batch.shape[1:] != tensors[0].shape[1:]:
            raise ValueError(
                f"{where}: collated batch {k} is {list(batch.shape)} but batch 0 is "
                f"{list(tensors[0].shape)}. The batches of one host call are joined along dim 0, "
                "so they need a batch dimension and the same other dimensions: pad them to "
                "one shape in collate_fn.")
    # Dtypes may differ (a collate_fn padding with float zeros): torch.cat promotes them to
    # one dtype, as PopTorch's joined batches are.
    return torch.cat(tensors)
