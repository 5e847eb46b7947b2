"""Issue 54: inputs and outputs of the shapes PopTorch's data loader and input tests use: a
batch sampler's collate_fn returning a registered custom type (PopTorch's CustomBatch), a
forward returning a dict subclass, and dict inputs whose keys come in another order."""
import collections

import pytest
import torch
import torch.nn as nn
from torch.testing import assert_close

import pipetorch as poptorch


class Pair:
    """A collated batch of (data, label), rebuilt by its registered parser."""

    def __init__(self, data, label):
        self.data, self.label = data, label


class PairParser(poptorch.ICustomArgParser):
    def yieldTensors(self, struct):
        yield struct.data
        yield struct.label

    def reconstruct(self, struct, tensor_iterator):
        return type(struct)(*tensor_iterator)


poptorch.registerCustomArgParser(Pair, PairParser())


class Numbers(torch.utils.data.Dataset):
    def __len__(self):
        return 30

    def __getitem__(self, index):
        return torch.full((2,), float(index)), torch.tensor([index])


def pairs(samples):
    return Pair(torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples]))


@pytest.mark.parametrize("workers", [0, 2])
def test_collated_custom_batches_of_one_call_are_joined_into_one(workers):
    # the DataLoader refused to join a collate_fn's CustomBatch objects (only tensors, dicts..)
    opts = poptorch.Options().deviceIterations(3)
    sampler = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(Numbers()), 4,
                                            drop_last=False)
    loader = poptorch.DataLoader(opts, Numbers(), batch_sampler=sampler, collate_fn=pairs,
                                 num_workers=workers)
    calls = list(loader)
    assert len(calls) == 2 and all(isinstance(c, Pair) for c in calls)
    assert calls[1].label.flatten().tolist() == list(range(12, 24))
    assert_close(calls[0].data, torch.arange(12.0).repeat_interleave(2).reshape(12, 2))


class Outputs(collections.OrderedDict):
    """A forward's own result type, as PopTorch's test_custom_arg_parser returns."""


class Summed(nn.Module):
    def forward(self, x):
        out = Outputs()
        out["sum"] = x.sum(dim=1)
        out["x"] = x * 2
        return out


def test_a_dict_subclass_output_holds_each_calls_tensors_in_its_order():
    # the OrderedDict subclass was one opaque leaf: every call returned the first call's result
    model = Summed()
    wrapped = poptorch.inferenceModel(model)
    for seed in range(3):
        x = torch.randn(4, 3, generator=torch.Generator().manual_seed(seed))
        got, want = wrapped(x), model(x)
        assert type(got) is Outputs and list(got) == ["sum", "x"]
        for key in want:
            assert_close(got[key], want[key])


class Divide(nn.Module):
    def forward(self, d):
        return d["x"] / d["y"]


def test_a_dict_input_may_list_its_keys_in_another_order():
    # PopTorch matches a dict argument by its keys; pipetorch called the order a new signature
    wrapped = poptorch.inferenceModel(Divide())
    x, y = torch.tensor([1.0, 6.0]), torch.tensor([2.0, 3.0])
    assert_close(wrapped({"x": x, "y": y}), x / y)
    assert_close(wrapped({"y": y, "x": x}), x / y)


@pytest.mark.parametrize("keys, phrase", [
    (["y"], "Missing arguments: x."),
    (["x", "y", "z"], "Unexpected arguments: z."),
])
def test_a_dict_input_with_other_keys_is_refused_in_poptorchs_words(keys, phrase):
    wrapped = poptorch.inferenceModel(Divide())
    wrapped({"x": torch.ones(2), "y": torch.ones(2)})
    with pytest.raises(poptorch.Error, match=f"Keys mismatch for d: {phrase}"):
        wrapped({k: torch.ones(2) for k in keys})


class EveryOther(torch.utils.data.Sampler):
    """A sampler in PopTorch's (torch 2.0's) style: it hands its data source to Sampler."""

    def __init__(self, source):
        super().__init__(source)
        self.source = source

    def __iter__(self):
        return iter(range(0, len(self.source), 2))

    def __len__(self):
        return len(self.source) // 2


def test_a_sampler_passing_its_data_source_to_sampler_init_still_works():
    # torch dropped Sampler.__init__(data_source): PopTorch's tests' samplers raised TypeError
    loader = poptorch.DataLoader(poptorch.Options(), Numbers(), batch_size=5,
                                 sampler=EveryOther(Numbers()))
    assert [b[1].flatten().tolist() for b in loader] == [[0, 2, 4, 6, 8], [10, 12, 14, 16, 18],
                                                         [20, 22, 24, 26, 28]]
