"""Fetching a whole combined batch with one call, and counting the bytes it moves.

torch's DataLoader calls `dataset[i]` once per sample and then stacks the samples: for a
combined batch of 800 images that is 800 Python calls plus a copy. Here a batch is fetched
with one call when the dataset allows it:
- `torch.utils.data.TensorDataset`: one `index_select` per tensor (optionally straight into
  a ring-buffer slot, so the loader process copies each byte once);
- a dataset with `__getitems__(indices)`: one call, then collate (torch's own convention);
- anything else: one `dataset[i]` per index, then collate.
Dtypes are never changed: uint8 images stay uint8 up to the device.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch
from torch.utils.data import TensorDataset, default_collate, get_worker_info

from pipetorch.data import samples
from pipetorch.data.samples import MapDataset, UserDataset
from pipetorch.data.structure import batch_rows, concat_batches, num_bytes, tensors_in

__all__: list[str] = []

# A collate_fn: called with the list of one batch's samples (or with what the dataset's
# `__getitems__` returned), returns the batch: any callable, as in torch.
CollateFn: TypeAlias = Callable[..., object]


class Prebatched:
    """A batch fetched in one call: collate passes it through untouched."""

    __slots__ = ("batch",)

    def __init__(self, batch: object) -> None:
        self.batch = batch


class BatchCollate:
    """collate_fn that leaves pre-fetched batches alone and collates per-sample lists.

    When torch's default collation fails, the sample that made it fail (None, another
    structure or shape) is named by its dataset index.
    """

    def __init__(self, collate_fn: CollateFn | None = None) -> None:
        self.collate_fn = collate_fn or default_collate
        self._explains = collate_fn is None  # a user's collate_fn may accept ragged samples

    def __call__(self, data: Prebatched | list[object]) -> Any:
        if isinstance(data, Prebatched):
            return data.batch
        indices = samples.take_fetching()
        try:
            return self.collate_fn(data)
        except Exception as error:  # collate's own words: torch's, by the sample's kind
            better = samples.explain(data, indices) if self._explains else None
            if better is None:
                raise
            raise better from error


def _shared_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    storage = torch.UntypedStorage._new_shared(math.prod(shape) * dtype.itemsize)
    return torch.empty(0, dtype=dtype).set_(storage).view(shape)


def _index(indices: Sequence[int] | torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(indices, dtype=torch.long)


class TensorBatches(TensorDataset):
    """A TensorDataset whose batches come from one `index_select` per tensor.

    It is a TensorDataset (same `.tensors`, same items), so code that inspects
    `loader.dataset` still sees the user's kind of dataset. Batches are lists, as
    `default_collate` returns for tuple samples.
    """

    def __getitems__(self, indices: Sequence[int]) -> Prebatched:
        index = _index(indices)
        if get_worker_info() is None:
            return Prebatched([t.index_select(0, index) for t in self.tensors])
        # In a torch worker the batch travels to the main process through shared memory:
        # select straight into it, as default_collate stacks straight into it.
        out = [_shared_empty((len(index), *t.shape[1:]), t.dtype) for t in self.tensors]
        self.fetch_into(index, out)
        return Prebatched(out)

    def fetch_into(self, indices: Sequence[int] | torch.Tensor, out: list[torch.Tensor]) -> None:
        """Write the rows `indices` of every tensor into `out` (pre-allocated, same dtypes)."""
        index = _index(indices)
        for tensor, target in zip(self.tensors, out, strict=True):
            torch.index_select(tensor, 0, index, out=target)

    @classmethod
    def wrap(cls, dataset: UserDataset, *, collate_fn: CollateFn | None) -> UserDataset:
        """The fast-path twin of a plain TensorDataset, else the dataset itself.

        Subclasses may override `__getitem__` and a custom collate_fn expects samples, so
        only an exact TensorDataset with the default collate takes the fast path.
        """
        if type(dataset) is TensorDataset and collate_fn is None:
            return cls(*dataset.tensors)
        return dataset


def fetch(dataset: MapDataset, indices: Sequence[Any], collate: CollateFn) -> Any:
    """One combined batch of `dataset` (the same result torch's fetcher would give); `indices`
    are what the dataset reads: ints, or index lists for CollatedGroups."""
    getitems = getattr(dataset, "__getitems__", None)
    data = getitems(indices) if getitems else [dataset[i] for i in indices]
    return collate(data)


class CollatedGroups(torch.utils.data.Dataset):
    """A dataset read by groups of a user's batch_sampler batches (sampling.CombinedBatchSampler).

    Each batch of a group is fetched and collated on its own, so the user's collate_fn sees
    exactly the indices its batch_sampler chose (and may pad them to any size); the group's
    collated batches are then joined along dim 0 into one host call's batch, [D][G][R][B].
    Other attributes are the user's dataset's.
    """

    def __init__(self, dataset: MapDataset, collate_fn: CollateFn | None) -> None:
        self.dataset = dataset
        self.collate = BatchCollate(collate_fn)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, group: Sequence[Sequence[int]]) -> Prebatched:
        batches = [fetch(self.dataset, samples.IndexBatch(indices), self.collate)
                   for indices in group]
        return Prebatched(concat_batches(batches, where="the collated batches of one host call"))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("dataset", "collate"):  # unpickling: not set yet
            raise AttributeError(name)
        return getattr(self.dataset, name)


class DirectFetch:
    """A batch the loader process may write straight into its ring-buffer slot."""

    __slots__ = ("dataset", "indices", "collate")

    def __init__(self, dataset: TensorBatches, indices: Sequence[int],
                 collate: CollateFn) -> None:
        self.dataset = dataset
        self.indices = indices
        self.collate = collate

    @property
    def rows(self) -> int:
        return len(self.indices)

    def materialize(self) -> Any:
        return fetch(self.dataset, self.indices, self.collate)

    def write_into(self, out: list[torch.Tensor]) -> None:
        self.dataset.fetch_into(self.indices, out)


@dataclass
class LoaderStats:
    """What a loader has handed out: batches, items, and the bytes of those batches.

    `bytes_per_item` is what moves to the device per sample (every tensor of the batch,
    labels included): 4x smaller for uint8 images than for float32 ones.
    """

    batches: int = 0
    items: int = 0
    bytes: int = 0

    @property
    def bytes_per_item(self) -> float | None:
        return self.bytes / self.items if self.items else None

    def record(self, batch: object, *, items: int | None = None) -> None:
        """Count one batch; `items` defaults to the batch's first dimension."""
        leaves = tensors_in(batch)
        rows = items if items is not None else batch_rows(leaves)
        self.batches += 1
        self.items += rows if rows is not None else 1
        self.bytes += num_bytes(leaves)
