"""Issue 32 A: a batch_sampler whose batches vary in size, padded by a collate_fn.

PopTorch combines a user's batch_sampler by batches, not by samples: each host call takes
deviceIterations x gradientAccumulation x replicas of the sampler's batches, each collated on
its own by the collate_fn, joined along dim 0. len(loader) = len(batch_sampler) // that
count (one more, shorter host call with drop_last=False when there is a remainder).
"""
import copy

import pytest
import torch
from torch.testing import assert_close
from torch.utils.data import Dataset, Sampler

import pipetorch as poptorch
from helpers.models import TinyMLP

Sync, Async, Rebatched = (poptorch.DataLoaderMode.Sync, poptorch.DataLoaderMode.Async,
                          poptorch.DataLoaderMode.AsyncRebatched)
B = 4  # the collate_fn pads every batch to B rows
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


class Numbers(Dataset):
    """Item i: features filled with i and label i (a tuple), or the same in a dict."""

    def __init__(self, length, as_dict=False):
        self.length, self.as_dict = length, as_dict

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        x, y = torch.full((3,), float(index)), torch.tensor(index)
        return {"x": x, "y": y} if self.as_dict else (x, y)


class Cycling(Sampler):
    """Batches of 1, 2, 3, 4, 1, 2, ... consecutive indices until `length` is used up."""

    def __init__(self, length):
        self.length = length

    def __iter__(self):
        start, k = 0, 0
        while start < self.length:
            size = k % B + 1
            yield list(range(start, min(start + size, self.length)))
            start, k = start + size, k + 1

    def __len__(self):
        return sum(1 for _ in self)


def pad(samples):
    """Stack the samples and pad to B rows: features -1, label -1."""
    missing = B - len(samples)
    if isinstance(samples[0], dict):
        x, y = pad([(s["x"], s["y"]) for s in samples])
        return {"x": x, "y": y}
    x = torch.stack([s[0] for s in samples])
    y = torch.stack([s[1] for s in samples])
    return (torch.cat([x, torch.full((missing, 3), -1.0)]),
            torch.cat([y, torch.full((missing,), -1, dtype=y.dtype)]))


def plain_batches(dataset, sampler):
    """What torch's own DataLoader yields for the sampler: one padded batch per index list."""
    return list(torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=pad))


def as_tuple(batch):
    return (batch["x"], batch["y"]) if isinstance(batch, dict) else tuple(batch)


def joined(batches):
    return tuple(torch.cat([as_tuple(b)[i] for b in batches]) for i in range(2))


@pytest.mark.parametrize("mode", [Sync, Async, Rebatched])
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("as_dict", [False, True])
def test_each_host_call_joins_device_iterations_padded_batches(mode, num_workers, as_dict):
    # The case: 300 items in batches of 1,2,3,4 -> 120 batches; D2 -> 60 host calls of
    # 8 rows. pipetorch used to combine by sample count and yielded far fewer.
    dataset, sampler = Numbers(300, as_dict), Cycling(300)
    want = plain_batches(dataset, sampler)
    assert len(want) == 120
    loader = poptorch.DataLoader(poptorch.Options().deviceIterations(2), dataset,
                                 batch_sampler=sampler, collate_fn=pad, num_workers=num_workers,
                                 mode=mode)
    assert len(loader) == 60
    got = []
    for batch in loader:
        assert isinstance(batch, dict) == as_dict
        got.append(tuple(t.clone() for t in as_tuple(batch)))
    assert len(got) == 60
    for call, (x, y) in enumerate(got):
        want_x, want_y = joined(want[2 * call:2 * call + 2])
        assert x.shape == (2 * B, 3)
        assert_close(x, want_x)
        assert_close(y, want_y)
    loader.terminate()


@pytest.mark.parametrize("mode", [Sync, Async, Rebatched])
@pytest.mark.parametrize("drop_last,calls", [(True, 20), (False, 21)])
def test_the_unit_is_d_g_r_batches_and_drop_last_keeps_the_remainder(mode, drop_last, calls):
    # 303 items -> 122 batches. D2 x G3 x R1 = 6 batches per host call: 20 full calls, and
    # 2 batches left over that drop_last=False keeps as a 21st, shorter call (2 x B rows).
    dataset, sampler = Numbers(303), Cycling(303)
    want = plain_batches(dataset, sampler)
    assert len(want) == 122
    opts = poptorch.Options().deviceIterations(2)
    opts.Training.gradientAccumulation(3)
    loader = poptorch.DataLoader(opts, dataset, batch_sampler=sampler, collate_fn=pad,
                                 drop_last=drop_last, mode=mode)
    assert len(loader) == calls
    rows, labels = [], []
    for x, y in loader:
        rows.append(x.shape[0])
        labels.append(y.clone())
    assert rows == [6 * B] * 20 + ([2 * B] if not drop_last else [])
    assert_close(torch.cat(labels), joined(want[:6 * calls])[1])
    loader.terminate()


def test_replicas_are_part_of_the_unit():
    opts = poptorch.Options().deviceIterations(3).replicationFactor(2)
    loader = poptorch.DataLoader(opts, Numbers(300), batch_sampler=Cycling(300),
                                 collate_fn=pad)
    assert len(loader) == 120 // 6
    x, _ = next(iter(loader))
    assert x.shape == (6 * B, 3)


def test_a_batch_sampler_with_a_batch_size_sets_the_combined_batch_size():
    sampler = torch.utils.data.BatchSampler(range(20), batch_size=4, drop_last=False)
    loader = poptorch.DataLoader(poptorch.Options().deviceIterations(2), Numbers(20),
                                 batch_sampler=sampler)
    assert loader.combinedBatchSize == 8
    assert len(loader) == 5 // 2


def test_training_on_padded_batches_matches_plain_pytorch():
    # Each host call runs D steps, one per collated batch, with the loss of plain PyTorch's
    # step on that same padded batch (padding rows get label 0 here, a valid class).
    class Features(Dataset):
        def __init__(self):
            g = torch.Generator().manual_seed(0)
            self.x, self.y = torch.randn(40, 6, generator=g), torch.randint(0, 3, (40,), generator=g)

        def __len__(self):
            return 40

        def __getitem__(self, i):
            return self.x[i], self.y[i]

    def pad_zero(samples):
        x = torch.stack([s[0] for s in samples])
        y = torch.stack([s[1] for s in samples])
        missing = B - len(samples)
        return torch.cat([x, torch.zeros(missing, 6)]), torch.cat([y, torch.zeros(missing, dtype=y.dtype)])

    dataset, sampler, D = Features(), Cycling(40), 2
    plain_data = list(torch.utils.data.DataLoader(dataset, batch_sampler=sampler,
                                                  collate_fn=pad_zero))
    torch.manual_seed(0)
    model = TinyMLP()
    plain = copy.deepcopy(model)
    opts = poptorch.Options().deviceIterations(D).outputMode(poptorch.OutputMode.All)
    loader = poptorch.DataLoader(opts, dataset, batch_sampler=sampler, collate_fn=pad_zero)
    wrapper = poptorch.trainingModel(model, opts,
                                     optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    for call, (x, y) in enumerate(loader):
        want = []
        for px, py in plain_data[call * D:(call + 1) * D]:
            optimizer.zero_grad()
            loss = plain(px, py)[1]
            loss.backward()
            optimizer.step()
            want.append(loss.detach())
        assert_close(wrapper(x, y)[1].as_subclass(torch.Tensor), torch.stack(want))
    assert call + 1 == len(plain_data) // D == 8
    wrapper.destroy()
    assert_close(model.fc1.weight, plain.fc1.weight)


def ragged(samples):
    return torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples])


def test_batches_of_one_call_that_cannot_be_joined_are_named():
    loader = poptorch.DataLoader(poptorch.Options().deviceIterations(2), Numbers(10),
                                 batch_sampler=Cycling(10), collate_fn=lambda s: torch.zeros(len(s), len(s)))
    with pytest.raises(ValueError, match=r"collated batch 1 is \[2, 2\] .* batch 0 is \[1, 1\]"
                                         r".*pad them to one shape in collate_fn"):
        next(iter(loader))


def test_batches_of_different_sizes_without_padding_are_joined_in_sync_mode():
    # No padding: a host call's rows are the sum of its batches' sizes (1 + 2, 3 + 4, ...).
    loader = poptorch.DataLoader(poptorch.Options().deviceIterations(2), Numbers(20),
                                 batch_sampler=Cycling(20), collate_fn=ragged)
    assert [x.shape[0] for x, _ in loader] == [3, 7, 3, 7]


def test_rebatched_worker_size_is_refused_with_a_batch_sampler():
    with pytest.raises(ValueError, match="rebatched_worker_size=2 cannot be used with a "
                                         "batch_sampler"):
        poptorch.DataLoader(poptorch.Options(), Numbers(10), batch_sampler=Cycling(10),
                            collate_fn=pad, mode=Rebatched, rebatched_worker_size=2)


def test_fewer_batches_than_one_host_call_with_drop_last_is_refused():
    with pytest.raises(ValueError, match="yields 4 batches, fewer than the 5 one host call"):
        poptorch.DataLoader(poptorch.Options().deviceIterations(5), Numbers(10),
                            batch_sampler=Cycling(10), collate_fn=pad)
