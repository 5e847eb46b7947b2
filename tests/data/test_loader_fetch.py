"""Batched fetching (one call per combined batch), dtypes, bytes per item, nested batches."""
import collections

import pytest
import torch
from loader_datasets import CountingGetitems, IncrementDataset, values
from torch.utils.data import TensorDataset

import pipetorch as poptorch
from pipetorch.data.fetch import TensorBatches
from pipetorch.data.structure import flatten, unflatten

Sync, Async, Rebatched = (poptorch.DataLoaderMode.Sync, poptorch.DataLoaderMode.Async,
                          poptorch.DataLoaderMode.AsyncRebatched)


def tensor_dataset(n=40, dtype=torch.float32):
    images = torch.arange(n * 12).reshape(n, 1, 3, 4).to(dtype)
    return TensorDataset(images, torch.arange(n) % 10)


@pytest.mark.parametrize("mode", [Sync, Async, Rebatched])
@pytest.mark.parametrize("shuffle", [False, True])
def test_tensor_dataset_batches_equal_torchs(mode, shuffle):
    dataset = tensor_dataset()
    opts = poptorch.Options().deviceIterations(2)
    ours = poptorch.DataLoader(opts, dataset, batch_size=3, shuffle=shuffle, mode=mode,
                               generator=torch.Generator().manual_seed(5))
    theirs = torch.utils.data.DataLoader(dataset, batch_size=6, shuffle=shuffle, drop_last=True,
                                         generator=torch.Generator().manual_seed(5))
    assert type(ours.dataset) is TensorBatches and isinstance(ours.dataset, TensorDataset)
    got = [[t.clone() for t in batch] for batch in ours]
    expected = list(theirs)
    assert len(got) == len(expected) == len(ours) == 6
    for (x, y), (tx, ty) in zip(got, expected):
        torch.testing.assert_close(x, tx, rtol=0, atol=0)
        torch.testing.assert_close(y, ty, rtol=0, atol=0)
    ours.terminate()


def test_tensor_dataset_through_torch_workers():
    dataset = tensor_dataset()
    ours = poptorch.DataLoader(poptorch.Options(), dataset, batch_size=8, num_workers=2)
    for (x, y), (tx, ty) in zip(ours, torch.utils.data.DataLoader(dataset, batch_size=8)):
        assert torch.equal(x, tx) and torch.equal(y, ty)
    assert ours.stats.batches == 5


def test_subclassed_tensor_dataset_keeps_per_item_fetching():
    class Doubled(TensorDataset):
        def __getitem__(self, index):
            return tuple(t[index] * 2 for t in self.tensors)

    loader = poptorch.DataLoader(poptorch.Options(), Doubled(torch.arange(8.)), batch_size=4)
    assert type(loader.dataset) is Doubled
    assert [b[0].tolist() for b in loader] == [[0., 2., 4., 6.], [8., 10., 12., 14.]]


def test_getitems_is_called_once_per_combined_batch():
    dataset = CountingGetitems(40)
    loader = poptorch.DataLoader(poptorch.Options().deviceIterations(4), dataset, batch_size=2)
    assert [values(b) for b in loader][1] == list(range(8, 16))
    assert [len(c) for c in dataset.calls] == [8] * 5


@pytest.mark.parametrize("mode", [Sync, Async])
def test_uint8_stays_uint8_and_moves_a_quarter_of_the_bytes(mode):
    per_item = {}
    for dtype in (torch.float32, torch.uint8):
        images = torch.arange(64 * 256).reshape(64, 1, 16, 16).to(dtype)
        loader = poptorch.DataLoader(poptorch.Options(), TensorDataset(images), batch_size=8,
                                     mode=mode)
        for (batch,) in loader:
            assert batch.dtype == dtype
        per_item[dtype] = loader.bytes_per_item
        loader.terminate()
    assert per_item == {torch.float32: 1024.0, torch.uint8: 256.0}


def test_sync_stats():
    loader = poptorch.DataLoader(poptorch.Options(), tensor_dataset(12), batch_size=4)
    list(loader)
    # 4 images of 12 float32 (48 bytes) + 4 int64 labels per batch.
    assert (loader.stats.batches, loader.stats.items, loader.stats.bytes) == (3, 12, 3 * 224)
    assert loader.bytes_per_item == 56


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
@pytest.mark.parametrize("mode", [Sync, Async])
def test_batches_are_pinned_with_a_gpu(mode):
    loader = poptorch.DataLoader(poptorch.Options(), tensor_dataset(), batch_size=4, mode=mode)
    images, _ = next(iter(loader))
    assert images.is_pinned()
    loader.terminate()


def test_no_pinning_without_a_gpu():
    loader = poptorch.DataLoader(poptorch.Options(), tensor_dataset(), batch_size=4)
    assert loader.pin_memory == torch.cuda.is_available()


Pair = collections.namedtuple("Pair", "left right")


def test_flatten_and_unflatten_round_trip():
    a, b, c = torch.zeros(1), torch.ones(2), torch.full((3,), 2.)
    batch = {"x": (a, [b]), "y": Pair(c, {"z": a})}
    leaves, tree = flatten(batch)
    assert [t.numel() for t in leaves] == [1, 2, 3, 1]
    rebuilt = unflatten(leaves, tree)
    assert isinstance(rebuilt["y"], Pair) and isinstance(rebuilt["x"], tuple)
    assert rebuilt["x"][1][0] is b and rebuilt["y"].right["z"] is a


def test_flatten_names_the_non_tensor_leaf():
    with pytest.raises(TypeError, match=r"batch\['x'\]\[1\] is a int, but an asynchronous "
                                        r"loader can only move tensors"):
        flatten({"x": (torch.zeros(1), 3)})


def test_async_and_sync_agree_on_a_generic_dataset():
    opts = poptorch.Options().deviceIterations(3)
    sync = poptorch.DataLoader(opts, IncrementDataset(50), batch_size=2)
    asynchronous = poptorch.DataLoader(opts, IncrementDataset(50), batch_size=2, mode=Async)
    assert [values(b) for b in sync] == [values(b) for b in asynchronous]
    asynchronous.terminate()
