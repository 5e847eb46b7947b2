"""A dataset's mistakes named by dataset index: unusable datasets, too few samples, and the
sample (None, or of another shape) that made collating a batch fail."""
from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Protocol, TypeAlias

import torch
from torch.utils import _pytree as pytree
from torch.utils.data import BatchSampler, IterableDataset

__all__: list[str] = []


class MapDataset(Protocol):
    """A map-style dataset as a DataLoader reads it: `dataset[i]` and `len(dataset)` (a list
    will do; torch's Dataset declares no `__len__`)."""

    def __getitem__(self, index: int, /) -> object: ...

    def __len__(self) -> int: ...


# What a DataLoader accepts as its dataset (check_dataset refuses anything else).
UserDataset: TypeAlias = "MapDataset | IterableDataset[object]"

# The indices of the batch this process fetches now. torch's fetchers do not hand indices to
# collate, but they iterate the index list the sampler gave them (in the main process or in a
# worker) just before collating it, so the list records itself when iterated.
_fetching: list[int] | None = None


class IndexBatch(list):
    """A batch's dataset indices that records itself as the batch being fetched."""

    def __iter__(self) -> Iterator[int]:
        global _fetching
        _fetching = self
        return super().__iter__()


class IndexBatchSampler(BatchSampler):
    """torch's BatchSampler, yielding IndexBatch lists."""

    def __iter__(self) -> Iterator[list[int]]:
        for batch in super().__iter__():
            yield IndexBatch(batch)


def take_fetching() -> list[int] | None:
    """The indices of the batch being collated (None if unknown), forgotten once read, so a
    later batch never reports a stale one."""
    global _fetching
    indices, _fetching = _fetching, None
    return indices


def check_dataset(dataset: object) -> None:
    """A map-style dataset must index and count its samples (an IterableDataset streams)."""
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return
    missing = [m for m in ("__getitem__", "__len__") if not hasattr(dataset, m)]
    if not missing:
        return
    kind = "a generator" if inspect.isgenerator(dataset) else f"a {type(dataset).__name__}"
    raise TypeError(
        f"dataset is {kind}, which has no {' or '.join(missing)}: a DataLoader reads samples "
        "by index (dataset[i], len(dataset)), every epoch. Pass a list (e.g. list(samples)) or "
        "a torch.utils.data.Dataset with __getitem__ and __len__; for a stream, subclass "
        "torch.utils.data.IterableDataset and yield the samples from __iter__")


def check_enough(num_items: int, combined: int, factors: str) -> None:
    """With drop_last, a dataset smaller than one host call's batch yields nothing."""
    if num_items < combined:
        raise ValueError(
            f"The dataset has {num_items} samples, fewer than the {combined} one host call "
            f"takes ({factors}): with drop_last=True the DataLoader would yield nothing "
            "(len 0). Use a smaller batch_size or deviceIterations, or a larger dataset")


def _none_at(value: object, where: str = "") -> str | None:
    """Where None sits in a sample ("" for the sample itself, "[1]", "['label']"), or None."""
    if value is None:
        return where
    items = (value.items() if isinstance(value, dict)
             else enumerate(value) if isinstance(value, (list, tuple)) else ())
    for key, item in items:
        found = _none_at(item, f"{where}[{key!r}]")
        if found is not None:
            return found
    return None


def _structure(value: object) -> str:
    """A sample's layout in Python's words: "(tensor, int)", "{'x': tensor}"."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_structure(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_structure(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
    return "tensor" if isinstance(value, torch.Tensor) else type(value).__name__


def _shape(leaf: object) -> list[int] | None:
    shape = getattr(leaf, "shape", None)
    if shape is not None:
        return list(shape)
    return [] if isinstance(leaf, (int, float, bool)) else None


def explain(samples: list[object], indices: list[int] | None) -> Exception | None:
    """The error naming the sample that default collation cannot batch, or None if no
    sample is None or differs in structure or shape from the first one."""
    def name(k: int) -> str:
        if indices is not None and len(indices) == len(samples):
            return f"dataset[{indices[k]}]"
        return f"sample {k} of the batch"

    for k, sample in enumerate(samples):
        where = _none_at(sample)
        if where is not None:
            return TypeError(
                f"{name(k)} returned None{f' at {where}' if where else ''}: a batch is built "
                "from tensors, numbers, strings and containers of them. Make __getitem__ "
                "return a value for it, or leave such samples out of the dataset")
    # The odd sample is the one that differs from most (the first one could be the odd one).
    layouts = [_structure(sample) for sample in samples]
    usual = max(layouts, key=layouts.count)
    ref = layouts.index(usual)
    for k, layout in enumerate(layouts):
        if layout != usual:
            return ValueError(
                f"{name(k)} is {layout} but {name(ref)} is {usual}: every sample must have "
                "the same structure (same number of items, same keys) to be batched. Return "
                "one structure from __getitem__")
    try:
        flat = [pytree.tree_flatten_with_path(sample)[0] for sample in samples]
    except ValueError:  # a custom node type without keys: torch's own message stands
        return None
    shapes = [tuple(str(_shape(leaf)) for _, leaf in leaves) for leaves in flat]
    usual_shapes = max(shapes, key=shapes.count)
    ref = shapes.index(usual_shapes)
    for k, leaves in enumerate(flat):
        for (path, a), (_, b) in zip(flat[ref], leaves, strict=False):
            if _shape(a) != _shape(b):
                at = f" at {pytree.keystr(path)}" if path else ""
                return ValueError(
                    f"{name(k)} has shape {_shape(b)}{at} but {name(ref)} has {_shape(a)}: "
                    "samples are stacked into a batch, so each must have the same shape. Pad "
                    "or crop them to one shape in the dataset, or pass a collate_fn that pads")
    return None
