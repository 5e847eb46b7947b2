"""Datasets for the data-loading tests: each sample's values are its index."""
from __future__ import annotations

import math
import os
import signal
import time

import torch


class IncrementDataset(torch.utils.data.Dataset):
    """Item i is a tensor of `shape` filled with i."""

    def __init__(self, length, shape=(2, 3), dtype=torch.float32):
        self.length, self.shape, self.dtype = length, tuple(shape), dtype

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        if index >= self.length:
            raise IndexError(index)
        return torch.full(self.shape, index, dtype=self.dtype)


class IncrementIterableDataset(torch.utils.data.IterableDataset):
    """Yields start, start+1, ... (length items); a worker_init_fn may narrow the range."""

    def __init__(self, length, shape=(2, 3), start=0):
        self.length, self.shape, self.start = length, tuple(shape), start

    def __iter__(self):
        for index in range(self.start, self.start + self.length):
            yield torch.full(self.shape, index, dtype=torch.float32)


class IncrementIterableDatasetWithLen(IncrementIterableDataset):
    def __len__(self):
        return self.length


def split_between_workers(worker_id):
    """worker_init_fn: worker w reads its ceil(N / workers) slice of the stream."""
    info = torch.utils.data.get_worker_info()
    dataset = info.dataset
    total = dataset.length
    per_worker = math.ceil(total / info.num_workers)
    dataset.start = per_worker * worker_id
    dataset.length = max(0, min(per_worker, total - dataset.start))


class DictDataset(torch.utils.data.Dataset):
    def __init__(self, length, shape=(2, 3)):
        self.length, self.shape = length, tuple(shape)

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        return {"data": torch.full(self.shape, index, dtype=torch.float32),
                "label": torch.full((1,), index, dtype=torch.long)}


class NestedDataset(DictDataset):
    def __getitem__(self, index):
        sample = super().__getitem__(index)
        return (sample["data"], {"label": sample["label"], "pair": [sample["label"] * 2,
                                                                      sample["label"] * 3]})


class BrokenDataset(torch.utils.data.Dataset):
    """Raises at item `fail_at` (so earlier batches load fine)."""

    def __init__(self, length, fail_at=0):
        self.length, self.fail_at = length, fail_at

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        if index >= self.fail_at:
            assert False, f"Broken dataset at item {index}"
        return torch.full((2,), index, dtype=torch.float32)


class FailingLabels(BrokenDataset):
    """(data, int64 label) items; from item `fail_at` the label's lookup fails (`KeyError`)
    or the label turns float32 (`dtype`, which the ring buffer's int64 slots refuse)."""

    def __init__(self, length, fail_at, how):
        super().__init__(length, fail_at)
        self.how = how

    def __getitem__(self, index):
        data = torch.full((2,), index, dtype=torch.float32)
        if index < self.fail_at:
            return data, torch.tensor(index)
        if self.how == "KeyError":
            raise KeyError(f"label of item {index}")
        return data, torch.tensor(index, dtype=torch.float32)


class DyingDataset(BrokenDataset):
    """Kills its own process (as the OOM killer would) at item `fail_at`."""

    def __getitem__(self, index):
        if index >= self.fail_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return torch.full((2,), index, dtype=torch.float32)


class SlowDataset(IncrementDataset):
    def __getitem__(self, index):
        time.sleep(0.01)
        return super().__getitem__(index)


class CountingGetitems(IncrementDataset):
    """Has __getitems__ and counts how it is called (in this process only)."""

    def __init__(self, length):
        super().__init__(length)
        self.calls = []

    def __getitems__(self, indices):
        self.calls.append(list(indices))
        return [self[i] for i in indices]


def values(batch):
    """The sample indices in a batch of IncrementDataset items (first element of each)."""
    return [int(v) for v in batch.reshape(batch.shape[0], -1)[:, 0]]
