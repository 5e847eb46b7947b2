"""Issue 22, blocks: BeginBlock on a function, PopTorch's repr of a model with blocks, blocks
surviving pickle / torch.save, and removeBlocks; each split model trained against plain PyTorch."""
import copy
import io
import pickle

import pytest
import torch
import torch.nn as nn
from torch.testing import assert_close

import pipetorch as poptorch
from helpers.models import data
from parallel.parallel_cases import cleaned, one_thread_everywhere

D, G, B = 2, 3, 2


@pytest.fixture(autouse=True)
def _one_thread(request, monkeypatch):
    one_thread_everywhere(request, monkeypatch)


def head(x):
    """A plain function that starts the second block (PopTorch's legacy BeginBlock form)."""
    return torch.tanh(x) * 2


class FunctionBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 3)
        self.head = poptorch.BeginBlock(head, ipu_id=1)

    def forward(self, x, labels):
        out = self.fc2(self.head(self.fc1(x)))
        return out, nn.functional.cross_entropy(out, labels)


class HookAndFunction(nn.Module):
    """A BeginBlock hook on fc2 and a BlockFunction method, the two forms seeds use."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = poptorch.BeginBlock(nn.Linear(8, 8), ipu_id=1)
        self.fc3 = nn.Linear(8, 3)

    @poptorch.BlockFunction("last", ipu_id=1)
    def last(self, h, labels):
        out = self.fc3(h)
        return out, nn.functional.cross_entropy(out, labels)

    def forward(self, x, labels):
        return self.last(torch.relu(self.fc2(torch.relu(self.fc1(x)))), labels)


def options(*, devices: int = 2) -> poptorch.Options:
    opts = poptorch.Options().deviceIterations(D).outputMode(poptorch.OutputMode.All)
    opts.Training.gradientAccumulation(G if devices > 1 else 1)
    return opts.showCompilationProgressBar(False)


def train_like_plain(request, model, plain, opts, *, calls: int = 2):
    """Train `model` wrapped and `plain` by hand on the same data; losses and weights agree."""
    g = opts.Training.gradient_accumulation
    wrapper = cleaned(request, poptorch.trainingModel(
        model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=0.1)))
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    for call in range(calls):
        x, labels = data(D * g * B, seed=call)
        got = wrapper(x, labels)[1]
        want = []
        for step in range(D):
            optimizer.zero_grad()
            for micro in range(g):
                rows = slice((step * g + micro) * B, (step * g + micro + 1) * B)
                loss = plain(x[rows], labels[rows])[1]
                (loss / g).backward()
                want.append(loss.detach())
            optimizer.step()
        assert_close(got.as_subclass(torch.Tensor), torch.stack(want))
    wrapper.copyWeightsToHost()
    for (name, value), expected in zip(model.state_dict().items(), plain.state_dict().values()):
        assert_close(value, expected, msg=name)
    return wrapper


def test_the_wrapper_prints_begin_block_as_poptorch_does():
    model = HookAndFunction()
    text = repr(poptorch.inferenceModel(model, poptorch.Options()))
    assert "(fc2): BeginBlock(user_id=None, ipu_id=1) Linear(in_features=8, out_features=8" in text
    named = nn.Sequential(poptorch.BeginBlock(nn.Linear(2, 2), "first", ipu_id=0))
    assert "(0): BeginBlock(user_id=first, ipu_id=0) Linear(" in repr(
        poptorch.inferenceModel(named))


def test_begin_block_twice_on_a_module_is_refused():
    layer = poptorch.BeginBlock(nn.Linear(2, 2), ipu_id=1)
    with pytest.raises(ValueError, match="already begins block"):
        poptorch.BeginBlock(layer, ipu_id=0)


@pytest.mark.slow
def test_begin_block_on_a_function_splits_and_trains_like_plain_pytorch(request):
    torch.manual_seed(0)
    model = FunctionBlock()
    assert isinstance(model.head, nn.Module)  # PopTorch returns a module for a function too
    wrapper = train_like_plain(request, model, copy.deepcopy(model), options())
    assert [s.ipu_id for s in wrapper._compiled.stages] == [0, 1]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["pickle", "torch.save"])
def test_a_model_with_blocks_survives_saving_and_trains_split(request, how, tmp_path):
    torch.manual_seed(0)
    original = HookAndFunction()
    if how == "pickle":
        loaded = pickle.loads(pickle.dumps(original))
    else:
        path = tmp_path / "model.pt"
        torch.save(original, path)
        loaded = torch.load(path, weights_only=False)
    assert "BeginBlock(user_id=None, ipu_id=1)" in repr(poptorch.inferenceModel(loaded))
    wrapper = train_like_plain(request, loaded, copy.deepcopy(original), options())
    assert [s.ipu_id for s in wrapper._compiled.stages] == [0, 1]
    # and a function block pickled inside its model
    again = pickle.loads(pickle.dumps(FunctionBlock()))
    x, labels = data(B)
    assert again(x, labels)[0].shape == (B, 3)


class Hooks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = poptorch.BeginBlock(nn.Linear(8, 8), "middle", ipu_id=1)
        self.fc3 = poptorch.BeginBlock(nn.Linear(8, 3), "last", ipu_id=2)

    def forward(self, x, labels):
        out = self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))
        return out, nn.functional.cross_entropy(out, labels)


def test_remove_blocks_runs_the_model_on_one_device_like_plain_pytorch(request):
    torch.manual_seed(0)
    model = Hooks()
    assert poptorch.removeBlocks(model) is model
    assert "BeginBlock" not in repr(poptorch.inferenceModel(model))
    buffer = io.BytesIO()
    torch.save(model, buffer)  # removed blocks stay removed in a saved copy
    buffer.seek(0)
    assert "BeginBlock" not in repr(poptorch.inferenceModel(torch.load(buffer, weights_only=False)))
    plain = copy.deepcopy(model)
    wrapper = train_like_plain(request, model, plain, options(devices=1))
    assert [s.ipu_id for s in wrapper._compiled.stages] == [0]
    assert wrapper._compiled.devices == 1
