"""What an asynchronous DataLoader's loader process iterates: one epoch of batches per pass."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypedDict

import torch
from torch.utils.data import IterableDataset

from pipetorch.data.fetch import CollateFn, DirectFetch, TensorBatches, fetch
from pipetorch.data.samples import IndexBatchSampler, UserDataset
from pipetorch.data.sampling import CombinedBatchSampler, IndexBatches

if TYPE_CHECKING:
    from multiprocessing.context import BaseContext

__all__: list[str] = []


class _PassedOn(TypedDict, total=False):
    """torch DataLoader arguments that pipetorch's DataLoader hands on as they are."""

    timeout: float
    worker_init_fn: Callable[[int], None] | None
    multiprocessing_context: BaseContext | str | None
    generator: torch.Generator | None
    prefetch_factor: int | None
    pin_memory_device: str
    in_order: bool


class TorchLoaderOptions(_PassedOn, total=False):
    """The torch DataLoader arguments pipetorch's DataLoader takes as **kwargs."""

    sampler: Iterable[int] | None
    batch_sampler: IndexBatches | None
    collate_fn: CollateFn | None
    pin_memory: bool


class TorchLoaderKwargs(_PassedOn, total=False):
    """The arguments of torch's DataLoader as pipetorch's DataLoader builds them (BatchSource
    makes its loader from them, in any process)."""

    dataset: UserDataset
    batch_size: int | None
    sampler: Iterable[int] | None
    batch_sampler: IndexBatchSampler | CombinedBatchSampler | None
    num_workers: int
    collate_fn: CollateFn
    drop_last: bool
    persistent_workers: bool


class BatchSource:
    """The batches of a DataLoader, built the way its settings say, in any process.

    `torch_kwargs` are exactly what torch's DataLoader gets (dataset, sampling, collate,
    workers). When the dataset is fetched by tensor indexing and no worker is needed, the
    loader process skips torch's DataLoader and fetches each batch itself, straight into
    its ring-buffer slot (`epoch(direct=True)` yields DirectFetch items for that).
    """

    def __init__(self, torch_kwargs: TorchLoaderKwargs, *, rebatched_drop_last: bool = True,
                 batched: bool = True) -> None:
        self.torch_kwargs = torch_kwargs
        self.rebatched_drop_last = rebatched_drop_last
        self.batched = batched
        self._loader: torch.utils.data.DataLoader | None = None

    @property
    def dataset(self) -> UserDataset:
        return self.torch_kwargs["dataset"]

    @property
    def index_batches(self) -> IndexBatchSampler | CombinedBatchSampler | None:
        return self.torch_kwargs.get("batch_sampler")

    def epoch(self, *, direct: bool = False) -> Iterator[Any]:
        """One epoch of batches (DirectFetch items where `direct` and the dataset allow)."""
        dataset, batches = self.dataset, self.index_batches
        if self.torch_kwargs.get("num_workers", 0) != 0 or batches is None \
                or isinstance(dataset, IterableDataset):  # (never with a batch_sampler)
            return iter(self._torch_loader())
        collate = self.torch_kwargs["collate_fn"]
        # torch's iterator draws its workers' base seed before sampling; drawing it too keeps
        # the shuffled order identical to Sync mode's for the same generator or global seed.
        torch.empty((), dtype=torch.int64).random_(generator=self.torch_kwargs.get("generator"))
        if direct and isinstance(dataset, TensorBatches) and isinstance(batches, IndexBatchSampler):
            return (DirectFetch(dataset, indices, collate) for indices in batches)
        return (fetch(dataset, indices, collate) for indices in batches)

    def __iter__(self) -> Iterator[Any]:
        return self.epoch()

    def __len__(self) -> int:
        return len(self._torch_loader())

    def _torch_loader(self) -> torch.utils.data.DataLoader:
        # Built once and kept, so persistent workers survive from one epoch to the next.
        if self._loader is None:
            self._loader = torch.utils.data.DataLoader(
                **self.torch_kwargs)  # type: ignore[arg-type]  # torch reads lists too
        return self._loader

    def close(self) -> None:
        """Stop torch's workers now rather than at garbage collection."""
        iterator = getattr(self._loader, "_iterator", None)
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        self._loader = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_loader"] = None  # holds worker processes; rebuilt on the other side
        return state
