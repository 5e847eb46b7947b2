"""Issue 22, inputs: the input forms real PopTorch scripts pass, trained against plain PyTorch,
and PopTorch's errors when a later call's inputs differ from the compiled ones."""
import collections
import copy

import pytest
import torch
import torch.nn as nn
from torch.testing import assert_close

import pipetorch as poptorch
from helpers.models import TinyMLP, data

D, B = 2, 3


class Batch(collections.OrderedDict):
    """A script's own batch type: an OrderedDict subclass torch's pytree does not know."""


class DictInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = TinyMLP()

    def forward(self, batch):
        assert isinstance(batch, dict)
        return self.mlp(batch["x"], batch["labels"])


class OptionalInputs(nn.Module):
    """forward(x, mask=None, scale=None, labels=None): the optional inputs scripts leave out."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x, mask=None, scale=None, labels=None):
        out = self.fc(x)
        if mask is not None:
            out = out * mask
        if scale is not None:
            out = out * scale
        if labels is None:
            return out
        return out, nn.functional.cross_entropy(out, labels)


def train_both(model, calls, *, options=None):
    """Each call through a trainingModel and through a plain SGD loop of D steps; the
    wrapper's losses (OutputMode.All) and the final weights must agree."""
    plain = copy.deepcopy(model)
    options = options or poptorch.Options().deviceIterations(D).outputMode(poptorch.OutputMode.All)
    d = options.device_iterations
    wrapper = poptorch.trainingModel(model, options,
                                     optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    for args, kwargs, split in calls:
        got = wrapper(*args, **kwargs)[1]
        want = []
        for step in range(d):
            opt.zero_grad()
            s_args, s_kwargs = split(args, kwargs, step, d)
            loss = plain(*s_args, **s_kwargs)[1]
            loss.backward()
            opt.step()
            want.append(loss.detach())
        assert_close(got.as_subclass(torch.Tensor).reshape(-1), torch.stack(want))
    wrapper.destroy()
    for (name, got), want in zip(model.state_dict().items(), plain.state_dict().values()):
        assert_close(got, want, msg=name)
    return wrapper


def rows(tree, step, d):
    """Micro-batch `step` of `d` of every tensor with a batch dimension."""
    def cut(x):
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            return x.chunk(d)[step]
        return x
    if isinstance(tree, dict):
        return type(tree)((k, rows(v, step, d)) for k, v in tree.items())
    if isinstance(tree, (tuple, list)):
        return type(tree)(rows(v, step, d) for v in tree)
    return cut(tree)


def split(args, kwargs, step, d):
    return rows(args, step, d), rows(kwargs, step, d)


def test_an_ordered_dict_subclass_input_trains_like_plain_pytorch():
    calls = []
    for seed in range(2):
        x, labels = data(D * B, seed=seed)
        calls.append(((Batch(x=x, labels=labels),), {}, split))
    train_both(DictInput(), calls)


@pytest.mark.parametrize("style", ["positional", "keyword"])
def test_none_for_optional_inputs_trains_like_plain_pytorch(style):
    calls = []
    for seed in range(2):
        x, labels = data(D * B, seed=seed)
        scale = torch.rand(D * B, 3, generator=torch.Generator().manual_seed(seed)) + 0.5
        if style == "positional":
            calls.append(((x, None, scale, labels), {}, split))
        else:
            calls.append(((x,), {"mask": None, "scale": scale, "labels": labels}, split))
    train_both(OptionalInputs(), calls)


def test_another_pattern_of_none_on_a_later_call_is_poptorchs_type_mismatch():
    x, labels = data(D * B)
    scale = torch.ones(D * B, 3)
    wrapper = poptorch.trainingModel(OptionalInputs(), poptorch.Options().deviceIterations(D))
    wrapper(x, None, scale, labels)
    with pytest.raises(poptorch.Error, match=r"Type mismatch for mask: .*changed from None to a "
                                             r"tensor.*destroy\(\)"):
        wrapper(x, scale, None, labels)
    wrapper.destroy()


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = TinyMLP()

    def forward(self, x, temperature, labels):
        out = self.mlp(x) / temperature
        return out, nn.functional.cross_entropy(out, labels)


def test_a_scalar_tensor_input_of_a_one_micro_batch_call_trains_like_plain_pytorch():
    # PopTorch takes a 0-dim tensor as a batch of one: fine when a call is one micro-batch.
    calls = []
    for seed in range(3):
        x, labels = data(B, seed=seed)
        calls.append(((x, torch.tensor(2.0 + seed), labels), {}, split))
    train_both(Scaled(), calls, options=poptorch.Options().outputMode(poptorch.OutputMode.All))


def test_a_scalar_tensor_input_of_several_micro_batches_is_refused_with_the_fix():
    x, labels = data(D * B)
    wrapper = poptorch.trainingModel(Scaled(), poptorch.Options().deviceIterations(D))
    with pytest.raises(ValueError, match=r"argument 1 \(temperature\) is a 0-dim tensor.*"
                                         r"temperature.expand\(2\)"):
        wrapper(x, torch.tensor(2.0), labels)


class ZeroSized(nn.Module):
    """Takes an extra input with no features (a model's empty optional feature set)."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = TinyMLP()

    def forward(self, x, extra, labels):
        out, loss = self.mlp(x, labels)
        return out, loss + extra.sum(), extra * 2


def test_a_zero_sized_input_trains_like_plain_pytorch_and_comes_back_zero_sized():
    calls = []
    for seed in range(2):
        x, labels = data(D * B, seed=seed)
        calls.append(((x, torch.zeros(D * B, 0), labels), {}, split))
    train_both(ZeroSized(), calls)
    wrapper = poptorch.inferenceModel(ZeroSized(), poptorch.Options().deviceIterations(D))
    x, labels = data(D * B)
    assert wrapper(x, torch.zeros(D * B, 0), labels)[2].shape == (D * B, 0)


@pytest.mark.parametrize("change, phrase", [
    (lambda x, y: (x[:B], y[:B]), r"Shape mismatch for x: expected torch.Size\(\[6, 6\]\) but "
                                  r"got torch.Size\(\[3, 6\]\) \(argument 0 \(x\) changed "
                                  r"shape from \[6, 6\] to \[3, 6\]\)"),
    (lambda x, y: (x.double(), y), r"Data type mismatch for x: .*torch.float32 to torch.float64"),
    (lambda x, y: (x, y.int()), r"Data type mismatch for labels: .*labels.long\(\)"),
])
def test_a_changed_shape_or_dtype_is_poptorchs_error(change, phrase):
    x, labels = data(D * B)
    wrapper = poptorch.inferenceModel(TinyMLP(), poptorch.Options().deviceIterations(D))
    wrapper(x, labels)
    with pytest.raises(poptorch.Error, match=phrase) as info:
        wrapper(*change(x, labels))
    assert isinstance(info.value, ValueError)  # what pipetorch raised before: still caught
    assert "build a new trainingModel/inferenceModel, or call destroy()" in str(info.value)


@pytest.mark.slow
def test_a_dict_subclass_and_none_inputs_train_split_over_two_devices_like_plain_pytorch():
    # The same input forms reach stage workers in other processes (pipelined over 2 devices):
    # each tensor of the dict is an input of the captured graph.
    class Split(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = nn.Linear(6, 8)
            self.fc2 = poptorch.BeginBlock(nn.Linear(8, 3), ipu_id=1)

        def forward(self, batch, mask=None, labels=None):
            out = self.fc2(torch.relu(self.fc1(batch["x"])) + batch["shift"])
            if mask is not None:
                out = out * mask
            return out, nn.functional.cross_entropy(out, labels)

    G = 3
    opts = poptorch.Options().deviceIterations(D).outputMode(poptorch.OutputMode.All)
    opts.Training.gradientAccumulation(G)
    torch.manual_seed(0)
    model = Split()
    plain = copy.deepcopy(model)
    wrapper = poptorch.trainingModel(model, opts.showCompilationProgressBar(False),
                                     optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    try:
        for seed in range(2):
            x, labels = data(D * G * B, seed=seed)
            shift = torch.randn(D * G * B, 8, generator=torch.Generator().manual_seed(seed))
            got = wrapper(Batch(x=x, shift=shift), None, labels=labels)[1]
            want = []
            for step in range(D):
                optimizer.zero_grad()
                for micro in range(G):
                    rows = slice((step * G + micro) * B, (step * G + micro + 1) * B)
                    loss = plain({"x": x[rows], "shift": shift[rows]}, None,
                                 labels=labels[rows])[1]
                    (loss / G).backward()
                    want.append(loss.detach())
                optimizer.step()
            assert_close(got.as_subclass(torch.Tensor), torch.stack(want))
        assert len(wrapper._compiled.engine.worker_pids) == 2
    finally:
        wrapper.destroy()
    for (name, got), want in zip(model.state_dict().items(), plain.state_dict().values()):
        assert_close(got, want, msg=name)


# --- a model of no inputs ------------------------------------------------------------------
class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros(1))

    def forward(self):
        self.count += 1.0
        return self.count * 2


class ParamsOnly(nn.Module):
    """A loss of the parameters alone, over two blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([3.0, -1.0]))

    def forward(self):
        with poptorch.Block("a", ipu_id=0):
            y = self.w * 2
        with poptorch.Block("b", ipu_id=1):
            loss = poptorch.identity_loss((y - 1.0).pow(2).sum(), "sum")
        return y, loss


def test_a_model_of_no_inputs_runs_once_per_call_as_plain_pytorch():
    # PopTorch runs forward() of buffers or constants alone (its test_no_input_but_one_buffer
    # counts 2, 3, 4, 5); pipetorch refused a call without a tensor input.
    model, plain = Counter(), Counter()
    wrapped = poptorch.inferenceModel(model)
    for _ in range(3):
        assert_close(wrapped(), plain())
    wrapped.copyWeightsToHost()
    assert_close(model.count, plain.count)


def test_a_model_given_only_python_numbers_runs_as_plain_pytorch():
    # PopTorch's test_none_input_dispatch_args_kwargs calls model(2): forward must run (and
    # raise its own errors), where pipetorch refused a call without a tensor.
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.tensor([1.5, -2.0]))

        def forward(self, n, *rest):
            return self.w * n + sum(rest)

    model = Scale()
    wrapped = poptorch.inferenceModel(model)
    assert_close(wrapped(3), model(3))
    assert_close(wrapped(3), model(3))


@pytest.mark.slow
def test_training_a_model_of_no_inputs_over_two_devices_equals_plain_pytorch():
    model = ParamsOnly()
    reference = copy.deepcopy(model)
    opts = poptorch.Options()
    opts.setExecutionStrategy(poptorch.ShardedExecution("a", "b"))
    wrapped = poptorch.trainingModel(model, opts,
                                     optimizer=poptorch.optim.SGD(model.parameters(), lr=0.1))
    plain_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(3):
        out, loss = wrapped()
        plain_opt.zero_grad()
        plain_out, plain_loss = reference()
        plain_loss.backward()
        plain_opt.step()
        assert_close(loss, plain_loss.detach())
        assert_close(out, plain_out.detach())
    wrapped.copyWeightsToHost()
    assert_close(model.w, reference.w)


def test_no_inputs_with_several_micro_batches_is_refused_with_the_fix():
    opts = poptorch.Options().deviceIterations(2)
    with pytest.raises(ValueError, match=r"without any tensor input, but this call takes "
                       r"deviceIterations \(2\) x .* = 2 micro-batches.*set all three to 1"):
        poptorch.inferenceModel(Counter(), opts)()
