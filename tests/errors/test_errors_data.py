"""DataLoader mistakes named when the loader is built (unusable dataset, too few samples) or
when a batch is collated (a None or ragged sample, by its dataset index)."""
from __future__ import annotations

import pytest
import torch

import pipetorch as poptorch
from error_cases import no_worker_started

Sync, Async = poptorch.DataLoaderMode.Sync, poptorch.DataLoaderMode.Async


class Samples(torch.utils.data.Dataset):
    """Sample i is a [3] tensor and the label i, except those `replace` gives."""

    def __init__(self, length, replace=None):
        self.length, self.replace = length, replace or {}

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        if i in self.replace:
            return self.replace[i]
        return torch.full((3,), float(i)), i


# Issue 23: a generator failed with "object of type 'generator' has no len()".
def test_a_generator_is_refused_with_what_to_pass_instead():
    with no_worker_started(), pytest.raises(TypeError) as info:
        poptorch.DataLoader(poptorch.Options(), (torch.zeros(3) for _ in range(8)))
    assert str(info.value) == (
        "dataset is a generator, which has no __getitem__ or __len__: a DataLoader reads "
        "samples by index (dataset[i], len(dataset)), every epoch. Pass a list (e.g. "
        "list(samples)) or a torch.utils.data.Dataset with __getitem__ and __len__; for a "
        "stream, subclass torch.utils.data.IterableDataset and yield the samples from __iter__")


# Issue 23: a batch larger than the dataset gave a loader of length 0 that yielded nothing.
def test_a_dataset_smaller_than_one_host_call_is_refused():
    opts = poptorch.Options().deviceIterations(4)
    opts.Training.gradientAccumulation(2)
    with no_worker_started(), pytest.raises(ValueError) as info:
        poptorch.DataLoader(opts, Samples(20), batch_size=4)
    assert str(info.value) == (
        "The dataset has 20 samples, fewer than the 32 one host call takes (batch_size 4 x "
        "deviceIterations 4 x gradientAccumulation 2): with drop_last=True the DataLoader "
        "would yield nothing (len 0). Use a smaller batch_size or deviceIterations, or a "
        "larger dataset")


def test_exactly_one_host_call_is_enough():
    loader = poptorch.DataLoader(poptorch.Options().deviceIterations(4), Samples(8),
                                 batch_size=2)
    assert len(loader) == 1 and len(list(loader)) == 1


def _first_error(loader):
    with pytest.raises(Exception) as info:
        for _ in loader:
            pass
    if hasattr(loader, "terminate"):
        loader.terminate()
    return info


# Issue 23: collate's "expected Tensor as element 1 in argument 0, but got NoneType".
@pytest.mark.parametrize("mode, workers", [(Sync, 0), (Sync, 1), (Async, 0)])
def test_a_none_sample_is_named_by_dataset_index(mode, workers):
    dataset = Samples(8, replace={5: (torch.zeros(3), None)})
    info = _first_error(poptorch.DataLoader(poptorch.Options(), dataset, batch_size=2,
                                            num_workers=workers, mode=mode))
    assert info.type in (TypeError, poptorch.errors.LoaderError)
    assert ("dataset[5] returned None at [1]: a batch is built from tensors, numbers, "
            "strings and containers of them. Make __getitem__ return a value for it, or leave "
            "such samples out of the dataset") in str(info.value)


def test_a_sample_returned_as_none_is_named():
    info = _first_error(poptorch.DataLoader(poptorch.Options(), Samples(4, {2: None}),
                                            batch_size=4))
    assert str(info.value).startswith("dataset[2] returned None: ")


# Issue 23: ragged samples gave "stack expects each tensor to be equal size".
def test_a_ragged_sample_is_named_with_both_shapes():
    dataset = Samples(8, replace={6: (torch.zeros(4), 6)})
    info = _first_error(poptorch.DataLoader(poptorch.Options(), dataset, batch_size=4))
    assert info.type is ValueError
    assert str(info.value) == (
        "dataset[6] has shape [4] at [0] but dataset[4] has [3]: samples are stacked into a "
        "batch, so each must have the same shape. Pad or crop them to one shape in the "
        "dataset, or pass a collate_fn that pads")


def test_a_sample_of_another_structure_is_named():
    dataset = Samples(4, replace={3: (torch.zeros(3),)})
    info = _first_error(poptorch.DataLoader(poptorch.Options(), dataset, batch_size=4))
    assert str(info.value).startswith("dataset[3] is (tensor,) but dataset[0] is (tensor, int): "
                                      "every sample must have the same structure")


def test_shuffled_batches_name_the_real_index():
    torch.manual_seed(0)
    dataset = Samples(16, replace={11: (torch.zeros(2), 11)})
    info = _first_error(poptorch.DataLoader(poptorch.Options(), dataset, batch_size=4,
                                            shuffle=True))
    assert str(info.value).startswith("dataset[11] has shape [2] at [0] but dataset[")


def test_a_users_collate_fn_keeps_its_own_errors():
    def collate(samples):
        raise RuntimeError("my collate refuses")

    dataset = Samples(4, replace={1: None})
    info = _first_error(poptorch.DataLoader(poptorch.Options(), dataset, batch_size=4,
                                            collate_fn=collate))
    assert str(info.value) == "my collate refuses"
