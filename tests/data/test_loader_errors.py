"""Every user mistake the DataLoader reports, with the message that says how to fix it."""
import pytest
import torch
from loader_datasets import IncrementDataset, IncrementIterableDataset
from torch.utils.data import BatchSampler, SequentialSampler

import pipetorch as poptorch
from pipetorch.errors import LoaderError

Sync, Async, Rebatched = (poptorch.DataLoaderMode.Sync, poptorch.DataLoaderMode.Async,
                          poptorch.DataLoaderMode.AsyncRebatched)


def make(dataset=None, **kwargs):
    dataset = dataset if dataset is not None else IncrementDataset(16)
    return poptorch.DataLoader(poptorch.Options(), dataset, **kwargs)


@pytest.mark.parametrize("kwargs", [{"batch_size": 2}, {"shuffle": True}])
def test_batch_sampler_with_batch_size_or_shuffle(kwargs):
    sampler = BatchSampler(SequentialSampler(range(16)), batch_size=4, drop_last=True)
    with pytest.raises(ValueError, match="batch_sampler is mutually exclusive with "
                                         "batch_size, shuffle and sampler"):
        make(batch_sampler=sampler, **kwargs)


def test_rebatched_worker_size_above_combined_size():
    with pytest.raises(ValueError, match=r"The rebatched_worker_size \(5\) must be <= to the "
                                         r"combined batch size \(4\)"):
        make(batch_size=4, mode=Rebatched, rebatched_worker_size=5)


def test_rebatched_worker_size_without_rebatching():
    with pytest.raises(ValueError, match="rebatched_worker_size=2 only applies when the loader "
                                         "rebatches"):
        make(batch_size=4, rebatched_worker_size=2)


@pytest.mark.parametrize("mode", [Sync, Async])
def test_empty_dataset(mode):
    with pytest.raises(ValueError, match=r"The dataset is empty \(len\(dataset\) == 0\)"):
        make(IncrementDataset(0), mode=mode)


def test_empty_iterable_dataset_in_async_mode():
    # Raised when the loader starts: like PopTorch's, it waits for the first batch.
    with pytest.raises(LoaderError, match="The dataset is empty: its first epoch produced "
                                          "no batch"):
        make(IncrementIterableDataset(0), mode=Async)


def test_iterable_dataset_with_auto_partitioning_across_processes():
    opts = poptorch.Options()
    opts.Distributed.configureProcessId(1, 2)
    with pytest.raises(ValueError, match=r"auto_distributed_partitioning is not supported for "
                                         r"an IterableDataset \(2 processes\)"):
        poptorch.DataLoader(opts, IncrementIterableDataset(10))


def test_unknown_async_option_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"Unknown async_options key\(s\) \['bufer_size'\]; "
                                         r"valid keys are \['buffer_size', "
                                         r"'miss_sleep_time_in_ms', 'load_indefinitely', "
                                         r"'early_preload', 'sharing_strategy'\]"):
        make(mode=Async, async_options={"bufer_size": 2})


def test_async_options_in_sync_mode():
    with pytest.raises(ValueError, match="async_options only apply to mode=DataLoaderMode"):
        make(async_options={"buffer_size": 2})


@pytest.mark.parametrize("options,match", [
    ({"buffer_size": 0}, r"buffer_size must be an int >= 1 .*got 0"),
    ({"miss_sleep_time_in_ms": -1}, "miss_sleep_time_in_ms must be a number >= 0, got -1"),
    ({"sharing_strategy": 9}, "sharing_strategy must be one of SharingStrategy.SharedMemory"),
])
def test_bad_async_option_values(options, match):
    with pytest.raises(ValueError, match=match):
        make(mode=Async, async_options=options)


def test_bad_mode():
    with pytest.raises(ValueError, match=r"mode must be one of DataLoaderMode.Sync, "
                                         r"DataLoaderMode.Async, DataLoaderMode.AsyncRebatched"):
        make(mode=7)


def test_async_rebatched_needs_a_batch_size():
    with pytest.raises(ValueError, match="AsyncRebatched needs a batch_size"):
        make(IncrementIterableDataset(8), batch_size=None, mode=Rebatched)


def test_options_must_be_options():
    with pytest.raises(TypeError, match="options must be a pipetorch.Options, got dict"):
        poptorch.DataLoader({}, IncrementDataset(4))


def test_accessor_over_an_async_loader():
    loader = make(mode=Async)
    with pytest.raises(ValueError, match="already uses an AsynchronousDataAccessor"):
        poptorch.AsynchronousDataAccessor(loader)
    loader.terminate()


def test_sampler_with_shuffle():
    with pytest.raises(ValueError, match="sampler is mutually exclusive with shuffle=True"):
        make(sampler=SequentialSampler(range(16)), shuffle=True)


def test_unequal_batches_in_async_mode():
    class Ragged(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield torch.zeros(2, 3)
            yield torch.zeros(2, 4)

    loader = make(Ragged(), batch_size=None, mode=Async)
    iterator = iter(loader)
    next(iterator)
    with pytest.raises(LoaderError, match=r"batch 2 of the epoch: tensor 0 is \[2, 4\] "
                                          r"torch.float32 but the ring buffer slots hold "
                                          r"\[2, 3\] torch.float32"):
        next(iterator)


def test_non_tensor_samples_in_async_mode():
    class Strings(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, index):
            return torch.zeros(1), f"item {index}"

    with pytest.raises(LoaderError, match=r"the first batch\[1\]\[0\] is a str, but an "
                                          r"asynchronous loader can only move tensors"):
        make(Strings(), batch_size=2, mode=Async)


def test_batch_sampler_with_auto_partitioning_across_processes():
    opts = poptorch.Options()
    opts.Distributed.configureProcessId(0, 2)
    sampler = BatchSampler(SequentialSampler(range(16)), batch_size=4, drop_last=True)
    with pytest.raises(ValueError, match="batch_sampler cannot be combined with "
                                         "auto_distributed_partitioning over 2 processes"):
        poptorch.DataLoader(opts, IncrementDataset(16), batch_sampler=sampler)
