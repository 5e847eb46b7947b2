"""Nested batches (tensors in dicts, tuples, lists) as a flat list of tensors plus a tree."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pipetorch import extensions

__all__: list[str] = []


@dataclass(frozen=True)
class Tree:
    """The shape of a nested batch: kind is 'leaf', 'dict', 'list', 'tuple', 'namedtuple' or
    'custom' (an ICustomArgParser type; keys holds the first object, the structure to rebuild)."""

    kind: str
    children: tuple[Tree, ...] = ()
    keys: tuple[Any, ...] = ()
    cls: Any = None


_LEAF = Tree("leaf")


def flatten(batch: Any, *, where: str = "batch") -> tuple[list[torch.Tensor], Tree]:
    """Split a nested batch into its tensors (depth first) and the tree that rebuilds it."""
    leaves: list[torch.Tensor] = []
    tree = _flatten_into(batch, leaves, where)
    return leaves, tree


def _flatten_into(value: Any, leaves: list[torch.Tensor], where: str) -> Tree:
    if isinstance(value, torch.Tensor):
        leaves.append(value)
        return _LEAF
    if isinstance(value, dict):
        keys = tuple(value.keys())
        children = tuple(_flatten_into(value[k], leaves, f"{where}[{k!r}]") for k in keys)
        return Tree("dict", children, keys)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        children = tuple(_flatten_into(v, leaves, f"{where}.{f}")
                         for f, v in zip(value._fields, value))
        return Tree("namedtuple", children, cls=type(value))
    if isinstance(value, (list, tuple)):
        children = tuple(_flatten_into(v, leaves, f"{where}[{i}]") for i, v in enumerate(value))
        return Tree("list" if isinstance(value, list) else "tuple", children)
    parser = extensions.parser_for(type(value))
    if parser is not None:  # a type registered with poptorch.registerCustomArgParser
        children = tuple(_flatten_into(t, leaves, f"{where}.<tensor {i}>")
                         for i, t in enumerate(parser.yieldTensors(value)))
        return Tree("custom", children, keys=(value,), cls=type(value))
    raise TypeError(
        f"{where} is a {type(value).__name__}, but an asynchronous loader can only move "
        "tensors (alone or in dicts, tuples and lists) and types registered with "
        "poptorch.registerCustomArgParser (in the loader's process too: a spawned loader "
        "must register them on import). Convert it to a tensor in the dataset or collate_fn, "
        "register a parser, or use mode=DataLoaderMode.Sync.")


def unflatten(leaves: list[torch.Tensor], tree: Tree) -> Any:
    """Rebuild the nested batch that `flatten` split (inverse of `flatten`)."""
    position = iter(leaves)
    return _build(position, tree)


def _build(position: Any, tree: Tree) -> Any:
    if tree.kind == "leaf":
        return next(position)
    values = [_build(position, child) for child in tree.children]
    if tree.kind == "dict":
        return dict(zip(tree.keys, values))
    if tree.kind == "namedtuple":
        return tree.cls(*values)
    if tree.kind == "custom":
        parser = extensions.parser_for(tree.cls)
        if parser is None:
            raise TypeError(f"No poptorch.ICustomArgParser is registered for {tree.cls.__name__} "
                            "in this process: call registerCustomArgParser before iterating")
        return parser.reconstruct(tree.keys[0], iter(values))
    return values if tree.kind == "list" else tuple(values)


def tensors_in(value: Any) -> list[torch.Tensor]:
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
