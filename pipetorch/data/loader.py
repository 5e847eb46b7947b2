"""pipetorch.DataLoader: torch's DataLoader yielding one host call's worth of samples per step.

Each step is a combined batch of B x deviceIterations x gradientAccumulation x replicas
samples (laid out [D][G][R][B]), so `len(loader)` counts host calls. The signature is
PopTorch's, positional arguments included, so PopTorch scripts run unchanged.

Modes: Sync iterates torch's DataLoader in the calling process; Async runs the same
batches in a loader process that fills a shared-memory ring (see accessor.py);
AsyncRebatched (and Async with drop_last=False) has the workers produce batches of
`rebatched_worker_size` and repacks them to exactly the combined size, so items a worker
could not fill a batch with are not lost.

A user's `batch_sampler` is combined by batches, as PopTorch does: each host call takes
deviceIterations x gradientAccumulation x replicas of its batches, each collated on its own
by `collate_fn` (which may pad it), joined along dim 0 (see CombinedBatchSampler).

`shuffle=True` in the processes of one pipeline (stagesAcrossProcesses) orders the data from
one seed they share (see shared_seed.py); in one process, from the global RNG, as PopTorch.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, Literal, get_args

import torch
from torch.utils.data import IterableDataset, RandomSampler, SequentialSampler
from torch.utils.data._utils.collate import default_convert

from pipetorch.data.accessor import AsyncOptions, AsynchronousDataAccessor, CompletionEvent
from pipetorch.data import samples, shared_seed
from pipetorch.data.fetch import BatchCollate, CollateFn, CollatedGroups, LoaderStats, TensorBatches
from pipetorch.data.samples import UserDataset
from pipetorch.data.sampling import (
    CombinedBatchSampler, DistributedShareSampler, IndexBatches, combined_batch_size, length_of,
    micro_batches_per_call, rebatched_length,
)
from pipetorch.data.source import BatchSource, TorchLoaderKwargs, TorchLoaderOptions, _PassedOn
from pipetorch.enums import DataLoaderMode

if TYPE_CHECKING:
    from torch.utils.data.dataloader import _BaseDataLoaderIter
    from typing_extensions import Unpack

    from pipetorch.options import Options

__all__ = ["DataLoader"]

logger = logging.getLogger(__name__)

ASYNC_OPTIONS = ("buffer_size", "miss_sleep_time_in_ms", "load_indefinitely", "early_preload",
                 "sharing_strategy")
_WorkerOnly = Literal["prefetch_factor", "multiprocessing_context", "persistent_workers", "timeout"]
_WORKER_ONLY: tuple[_WorkerOnly, ...] = get_args(_WorkerOnly)


def _mode(mode: DataLoaderMode | int) -> DataLoaderMode:
    try:
        return DataLoaderMode(mode)
    except ValueError:
        valid = ", ".join(f"DataLoaderMode.{m.name}" for m in DataLoaderMode)
        raise ValueError(f"mode must be one of {valid}; got {mode!r}.") from None


def _check_async_options(async_options: AsyncOptions | None,
                         mode: DataLoaderMode) -> AsyncOptions:
    if async_options is None:
        return {}
    if mode == DataLoaderMode.Sync:
        raise ValueError("async_options only apply to mode=DataLoaderMode.Async or "
                         "AsyncRebatched; this DataLoader is Sync. Pass a mode or drop them.")
    if not isinstance(async_options, dict):
        raise TypeError(f"async_options must be a dict, got {type(async_options).__name__}.")
    unknown = sorted(set(async_options) - set(ASYNC_OPTIONS))
    if unknown:
        raise ValueError(f"Unknown async_options key(s) {unknown}; valid keys are "
                         f"{list(ASYNC_OPTIONS)} (rebatched_size is set by "
                         "mode=DataLoaderMode.AsyncRebatched).")
    return async_options.copy()


def _check_batch_sampler(batch_sampler: IndexBatches | None, batch_size: int | None,
                         shuffle: bool, sampler: Iterable[int] | None, iterable: bool, *,
                         processes: int) -> None:
    if batch_sampler is None:
        return
    if processes > 1:
        raise ValueError(
            f"batch_sampler cannot be combined with auto_distributed_partitioning over "
            f"{processes} processes: pass auto_distributed_partitioning=False and give each "
            "process its own batch_sampler.")
    if batch_size != 1 or shuffle or sampler is not None:
        raise ValueError(
            f"batch_sampler is mutually exclusive with batch_size, shuffle and sampler (got "
            f"batch_size={batch_size!r}, shuffle={shuffle!r}, sampler={sampler!r}): its "
            "batches are the micro-batches, so leave those arguments at their defaults.")
    if iterable:
        raise ValueError("batch_sampler cannot be used with an IterableDataset: it has no "
                         "indices to sample.")


def _check_sampler_batches(batch_sampler: IndexBatches, per_call: int, drop_last: bool) -> None:
    """A batch_sampler's batches, counted: one host call takes `per_call` of them."""
    try:
        batches = length_of(batch_sampler)
    except TypeError:
        return  # a sampler without a length: counted as it runs
    if batches == 0:
        raise ValueError("The batch_sampler yields no batch (len(batch_sampler) == 0): a "
                         "DataLoader needs at least one batch.")
    if drop_last and batches < per_call:
        raise ValueError(
            f"The batch_sampler yields {batches} batches, fewer than the {per_call} one host "
            "call takes (deviceIterations x gradientAccumulation x replicas): with "
            "drop_last=True the DataLoader would yield nothing (len 0). Use drop_last=False "
            "or fewer device iterations.")
    if not drop_last and batches % per_call:
        logger.warning(
            "The batch_sampler's %d batches are not divisible by the %d batches one host call "
            "takes and drop_last=False: the last host call will have %d batches. Use "
            "drop_last=True to avoid handling that case.", batches, per_call, batches % per_call)


def _factors(options: Options, micro: int) -> str:
    """How a host call's batch is made: "batch_size 4 x deviceIterations 8"."""
    parts = [("batch_size", micro), ("deviceIterations", options.device_iterations),
             ("gradientAccumulation", options.Training.gradient_accumulation),
             ("replicas", micro_batches_per_call(options) // (
                 options.device_iterations * options.Training.gradient_accumulation))]
    return " x ".join(f"{name} {value}" for name, value in parts if value != 1 or name ==
                      "batch_size")


def _check_rebatching(mode: DataLoaderMode, rebatch: bool, worker_size: int | None,
                      combined: int | None, *, batch_sampler: bool) -> None:
    if worker_size is not None and batch_sampler:
        raise ValueError(
            f"rebatched_worker_size={worker_size} cannot be used with a batch_sampler: each "
            "host call is made of the sampler's own batches, so there is nothing to rebatch. "
            "Drop rebatched_worker_size.")
    if mode == DataLoaderMode.AsyncRebatched and combined is None and not batch_sampler:
        raise ValueError("mode=DataLoaderMode.AsyncRebatched needs a batch_size (got None): "
                         "it repacks batches to the combined batch size.")
    if worker_size is None:
        return
    if not rebatch:
        raise ValueError(
            f"rebatched_worker_size={worker_size} only applies when the loader rebatches: use "
            "mode=DataLoaderMode.AsyncRebatched (or Async with drop_last=False).")
    if isinstance(worker_size, bool) or not isinstance(worker_size, int) or worker_size < 1:
        raise ValueError(f"rebatched_worker_size must be an int >= 1, got {worker_size!r}.")
    if combined is not None and worker_size > combined:
        raise ValueError(f"The rebatched_worker_size ({worker_size}) must be <= to the "
                         f"combined batch size ({combined}).")


class DataLoader(torch.utils.data.DataLoader):
    """torch's DataLoader whose batches are whole host calls (see the module docstring).

    Extra attributes: `combinedBatchSize`, `options`, `stats` (a LoaderStats: batches,
    items and bytes handed out) and `bytes_per_item`. In the Async modes the yielded tensors
    are views of shared memory, valid until the next step: clone what you keep, and pass
    the event of a non_blocking copy from them to `release_after`.
    """

    def __init__(self, options: Options, dataset: UserDataset, batch_size: int | None = 1,
                 shuffle: bool = False, num_workers: int = 0, drop_last: bool = True,
                 persistent_workers: bool | None = None,
                 auto_distributed_partitioning: bool = True,
                 mode: DataLoaderMode = DataLoaderMode.Sync,
                 async_options: AsyncOptions | None = None,
                 rebatched_worker_size: int | None = None,
                 **kwargs: Unpack[TorchLoaderOptions]) -> None:
        if not (hasattr(options, "device_iterations") and hasattr(options, "_freeze")):
            raise TypeError(f"options must be a pipetorch.Options, got "
                            f"{type(options).__name__}.")
        options._freeze(by="poptorch.DataLoader")
        # No __del__ here: an iteration may outlive a temporary DataLoader, so the accessor
        # stops its process when it is itself collected (or at exit).
        self._accessor: AsynchronousDataAccessor | None = None
        mode = _mode(mode)
        if persistent_workers is None:
            persistent_workers = num_workers > 0
        user_batch_sampler = kwargs.pop("batch_sampler", None)
        user_sampler = kwargs.pop("sampler", None)
        user_collate = kwargs.pop("collate_fn", None)
        pin_memory = kwargs.pop("pin_memory", torch.cuda.is_available())
        passed_on: _PassedOn = kwargs  # the rest, handed to torch as they are
        iterable = isinstance(dataset, IterableDataset)
        samples.check_dataset(dataset)
        _check_batch_sampler(user_batch_sampler, batch_size, shuffle, user_sampler, iterable,
                             processes=options.Distributed.data_share[1]
                             if auto_distributed_partitioning else 1)

        micro = batch_size if user_batch_sampler is None else getattr(
            user_batch_sampler, "batch_size", None)
        combined = combined_batch_size(options, micro)
        rebatch = user_batch_sampler is None and combined is not None and (
            mode == DataLoaderMode.AsyncRebatched
            or (mode == DataLoaderMode.Async and not drop_last))
        _check_rebatching(mode, rebatch, rebatched_worker_size, combined,
                          batch_sampler=user_batch_sampler is not None)
        async_options = _check_async_options(async_options, mode)

        self._options = options
        self._combined = combined
        self._mode = mode
        self._rebatch = rebatch
        self._batched = combined is not None or user_batch_sampler is not None
        self._share: DistributedShareSampler | None = None
        self.rebatched_drop_last = drop_last
        self._stats = LoaderStats()

        if user_batch_sampler is None:
            base_sampler = self._base_sampler(dataset, shuffle, drop_last, user_sampler,
                                              auto_distributed_partitioning, num_workers, kwargs)
        else:
            base_sampler = None
            _check_sampler_batches(user_batch_sampler, micro_batches_per_call(options), drop_last)
        if not isinstance(dataset, IterableDataset) and drop_last and combined is not None \
                and user_batch_sampler is None:
            assert micro is not None  # combined is
            samples.check_enough(len(dataset) if self._share is None else len(self._share),
                                 combined, _factors(options, micro))
        worker_batch = (rebatched_worker_size or combined) if rebatch else combined
        fetch_dataset = TensorBatches.wrap(dataset, collate_fn=user_collate)
        if user_batch_sampler is not None:
            assert not isinstance(fetch_dataset, IterableDataset)  # _check_batch_sampler refuses it
            fetch_dataset = CollatedGroups(fetch_dataset, user_collate)
        collate: CollateFn = BatchCollate(user_collate)
        if combined is None and user_batch_sampler is None:  # no batching: torch's rule
            collate = user_collate or default_convert
        torch_kwargs: TorchLoaderKwargs = dict(
            dataset=fetch_dataset, num_workers=num_workers, collate_fn=collate,
            persistent_workers=persistent_workers, **passed_on,
            **self._batching_kwargs(iterable, base_sampler, user_batch_sampler, worker_batch,
                                    drop_last))
        super().__init__(**torch_kwargs,  # type: ignore[arg-type]  # torch reads lists too
                         pin_memory=pin_memory and mode == DataLoaderMode.Sync)

        self._async_options = async_options
        self._source_kwargs = self._loader_process_kwargs(torch_kwargs, fetch_dataset)
        if mode != DataLoaderMode.Sync:
            self._accessor = self._new_accessor()

    # -- construction helpers ---------------------------------------------------------

    def _batching_kwargs(self, iterable: bool, base_sampler: Iterable[int] | None,
                         user_batch_sampler: IndexBatches | None, worker_batch: int | None,
                         drop_last: bool) -> TorchLoaderKwargs:
        """How torch's DataLoader should batch: per worker (iterable) or by index lists."""
        # Rebatching keeps the workers' short batches; without batching there is no last
        # batch to drop (torch refuses drop_last with batch_size=None).
        torch_drop_last = drop_last and not self._rebatch and worker_batch is not None
        if iterable:
            return {"batch_size": worker_batch, "drop_last": torch_drop_last}
        if user_batch_sampler is not None:
            count = micro_batches_per_call(self._options)
            return {"batch_sampler": CombinedBatchSampler(user_batch_sampler, count=count,
                                                          drop_last=drop_last)}
        if worker_batch is None:
            return {"sampler": base_sampler, "batch_size": None}
        assert base_sampler is not None  # only an IterableDataset has none
        return {"batch_sampler": samples.IndexBatchSampler(base_sampler, worker_batch,
                                                          torch_drop_last)}

    def _base_sampler(self, dataset: UserDataset, shuffle: bool,
                      drop_last: bool, user_sampler: Iterable[int] | None,
                      auto_partition: bool, num_workers: int,
                      kwargs: TorchLoaderOptions) -> Iterable[int] | None:
        processes = self._options.Distributed.data_share[1]
        if isinstance(dataset, IterableDataset):
            if auto_partition and processes > 1:
                raise ValueError(
                    f"auto_distributed_partitioning is not supported for an IterableDataset "
                    f"({processes} processes): split the stream yourself (for example by "
                    "options.Distributed.processId) and pass "
                    "auto_distributed_partitioning=False.")
            if num_workers > 1 and "worker_init_fn" not in kwargs:
                logger.warning(
                    "IterableDataset used with num_workers=%d but no worker_init_fn: every "
                    "worker iterates the whole dataset, so each element is returned %d times "
                    "(see torch.utils.data.IterableDataset).", num_workers, num_workers)
            return None
        num_items = len(dataset)
        if num_items == 0:
            raise ValueError("The dataset is empty (len(dataset) == 0): a DataLoader needs at "
                             "least one combined batch of samples.")
        step = self._combined
        if not drop_last and step is not None and num_items % (step * processes):
            logger.warning(
                "The number of elements in the dataset (%d) is not divisible by the number of "
                "elements processed per step (%d) and drop_last=False: the last batch will "
                "have %d elements. Use drop_last=True to avoid handling that case.",
                num_items, step * processes, num_items % (step * processes))
        if auto_partition and processes > 1:
            return self._distributed_sampler(num_items, shuffle, drop_last, user_sampler)
        if user_sampler is not None:
            if shuffle:
                raise ValueError("sampler is mutually exclusive with shuffle=True: the sampler "
                                 "decides the order. Drop one of them.")
            return user_sampler
        if shuffle:
            generator = kwargs.get("generator")
            if generator is None:
                generator = shared_seed.shuffle_generator(self._options)
            return RandomSampler(dataset, generator=generator)
        return SequentialSampler(dataset)

    def _distributed_sampler(self, num_items: int, shuffle: bool, drop_last: bool,
                             user_sampler: Iterable[int] | None) -> DistributedShareSampler:
        distributed = self._options.Distributed
        if self._combined is None:
            raise ValueError("batch_size=None is not allowed with "
                             "auto_distributed_partitioning over several processes.")
        if user_sampler is not None:
            raise ValueError(
                f"sampler cannot be combined with auto_distributed_partitioning over "
                f"{distributed.num_processes} processes: pass "
                "auto_distributed_partitioning=False and split the data in your sampler.")
        seed = self._options.random_seed
        if shuffle and seed is None and distributed._agrees_on_shuffle_seed:
            # popdist.poptorch.Options: the instances draw one seed together, so that a
            # PopDist script shuffles without randomSeed.
            seed = shared_seed.agreed_seed(distributed.process_id, distributed.num_processes)
        self._share = DistributedShareSampler(
            num_items, process_id=distributed.process_id,
            num_processes=distributed.num_processes, step=self._combined, shuffle=shuffle,
            seed=seed, drop_last=drop_last)
        return self._share

    @staticmethod
    def _loader_process_kwargs(torch_kwargs: TorchLoaderKwargs,
                               dataset: UserDataset) -> TorchLoaderKwargs:
        kwargs = torch_kwargs.copy()
        # Workers only add copies for tensor indexing: the loader process fetches directly.
        if isinstance(dataset, TensorBatches) and kwargs.get("worker_init_fn") is None \
                and "batch_sampler" in kwargs:
            kwargs["num_workers"] = 0
            for name in _WORKER_ONLY:
                kwargs.pop(name, None)
        return kwargs

    def _new_accessor(self) -> AsynchronousDataAccessor:
        source = BatchSource(self._source_kwargs, rebatched_drop_last=self.rebatched_drop_last,
                             batched=self._batched)
        accessor = AsynchronousDataAccessor(
            source, **self._async_options,
            rebatched_size=self._combined if self._rebatch else None)
        accessor.stats = self._stats  # one count across restarts after terminate()
        return accessor

    # -- public surface ---------------------------------------------------------------

    def __len__(self) -> int:
        if self._rebatch:
            num_items = len(self._share) if self._share is not None else length_of(self.dataset)
            assert self._combined is not None  # rebatching needs a combined batch size
            return rebatched_length(num_items, self._combined,
                                    drop_last=self.rebatched_drop_last)
        return super().__len__()

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]  # not a _BaseDataLoaderIter
        if self._mode == DataLoaderMode.Sync:
            return _Counted(super().__iter__(), self._stats, self._batched)
        if self._accessor is None:
            self._accessor = self._new_accessor()  # restarted after terminate()
        return iter(self._accessor)

    @property
    def combinedBatchSize(self) -> int | None:  # noqa: N802 - PopTorch's name
        """Samples consumed by one host call: B x D x G x replicas (None without batching)."""
        return self._combined

    @property
    def options(self) -> Options:
        """The (frozen) options this loader was built with."""
        return self._options

    @property
    def stats(self) -> LoaderStats:
        """Batches, items and bytes handed out so far (see LoaderStats)."""
        return self._stats

    @property
    def bytes_per_item(self) -> float | None:
        """Bytes moved per sample by the batches so far (None before the first batch)."""
        return self.stats.bytes_per_item

    def release_after(self, event: CompletionEvent) -> None:
        """Async modes: keep the last batch's shared-memory slot until `event` (a
        torch.cuda.Event recorded after a non_blocking copy from the batch) has completed; see
        AsynchronousDataAccessor.release_after. Sync mode: nothing to do, as torch's batches
        are never reused."""
        if self._mode != DataLoaderMode.Sync:
            if self._accessor is None:
                raise ValueError("release_after(event) applies to the batch last returned by "
                                 "next(); this loader has not started: call it after next()")
            self._accessor.release_after(event)

    def terminate(self) -> None:
        """Stop the loader process of an Async loader (no effect in Sync mode)."""
        if self._accessor is not None:
            self._accessor.terminate()
            self._accessor = None



class _Counted:
    """torch's iterator, counting what it hands out into LoaderStats."""

    def __init__(self, inner: _BaseDataLoaderIter, stats: LoaderStats,
                 batched: bool) -> None:
        self._inner = inner
        self._stats = stats
        self._batched = batched

    def __iter__(self) -> _Counted:
        return self

    def __next__(self) -> Any:
        batch = next(self._inner)
        self._stats.record(batch, items=None if self._batched else 1)
        return batch

    def __len__(self) -> int:
        return len(self._inner)
