"""Issue 40: collated batches of different dtypes (a collate_fn padding short batches with
float zeros makes an int64 label float32) are joined into one host call as torch.cat joins
them, promoting the dtype, in every DataLoader mode and with any number of workers."""
import pytest
import torch

import pipetorch as poptorch

SIZE, ITERATIONS, ROWS = 3, 2, 20


class Labelled(torch.utils.data.Dataset):
    def __len__(self):
        return ROWS

    def __getitem__(self, index):
        return torch.full((2,), float(index)), torch.full((1,), index, dtype=torch.long)


class GrowingBatches(torch.utils.data.Sampler):
    """Batches of 1, 2, 3, 1, 2, 3, ... indices: the short ones get padded."""

    def __iter__(self):
        start, size = 0, 1
        while start < ROWS:
            yield list(range(start, min(start + size, ROWS)))
            start, size = start + size, size % SIZE + 1

    def __len__(self):
        return len(list(iter(self)))


def pad(samples):
    """Stack the samples, padding up to SIZE rows with float32 zeros (as PopTorch's test does)."""
    missing = SIZE - len(samples)
    return tuple(torch.stack([s[i] for s in samples]
                             + [torch.zeros(samples[0][i].shape) for _ in range(missing)])
                 for i in range(2))


def expected():
    """Plain PyTorch: each host call's collated batches joined by torch.cat."""
    batches = [pad([Labelled()[i] for i in indices]) for indices in GrowingBatches()]
    calls = [batches[i:i + ITERATIONS] for i in range(0, len(batches) - ITERATIONS + 1,
                                                      ITERATIONS)]  # drop_last, the default
    return [tuple(torch.cat(parts) for parts in zip(*call)) for call in calls]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("mode", ["Sync", "Async", "AsyncRebatched"])
def test_collated_batches_of_two_dtypes_join_as_torch_cat(mode, workers):
    # pipetorch refused: "collated batch 1 is [3, 1] torch.int64 but batch 0 is [3, 1]
    # torch.float32 ... pad them to one shape in collate_fn"
    opts = poptorch.Options().deviceIterations(ITERATIONS)
    loader = poptorch.DataLoader(opts, Labelled(), batch_sampler=GrowingBatches(),
                                 collate_fn=pad, num_workers=workers,
                                 mode=getattr(poptorch.DataLoaderMode, mode))
    # the asynchronous modes' batches live in recycled shared slots: keep copies
    got, want = [tuple(t.clone() for t in batch) for batch in loader], expected()
    assert len(got) == len(want)
    for (data, label), (want_data, want_label) in zip(got, want):
        torch.testing.assert_close(data, want_data)
        # Sync returns torch.cat's dtype; the asynchronous modes' shared slots hold every
        # batch in the first one's dtype (a promoted one: float32 here), values unchanged
        dtype = want_label.dtype if mode == "Sync" else torch.float32
        torch.testing.assert_close(label, want_label.to(dtype))


def test_first_batch_dtype_the_later_one_does_not_fit_in_is_refused_async():
    # the asynchronous modes' slots are shaped by the first batch: a float batch cannot be
    # stored in an int64 slot, and says so instead of truncating
    class FloatLater(Labelled):
        def __getitem__(self, index):
            data, label = super().__getitem__(index)
            return data, (label.float() + 0.5 if index >= 4 else label)

    loader = poptorch.DataLoader(poptorch.Options(), FloatLater(), batch_size=4,
                                 mode=poptorch.DataLoaderMode.Async)
    with pytest.raises(poptorch.Error, match=r"torch.float32 but the ring buffer slots hold "
                                             r"\[4, 1\] torch.int64"):
        list(loader)
