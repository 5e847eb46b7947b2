"""Issue 32, group 7: buffers removed or reassigned by forward, or changed after compiling,
copyNamedBuffersToDevice with options that cannot work, and for_loop's input checks, with
PopTorch's messages (its buffers_test and loop_test)."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.testing import assert_close

import pipetorch as poptorch
from parallel.parallel_cases import cleaned, one_thread_everywhere

REMOVED = r"Buffer y is removed from the model when calling the forward method\."
REASSIGNED = (r"Buffer y is reassigned within the model when calling the forward method\. "
              r"This is not supported\. Consider using self\.y\.copy_\(src\) to copy data "
              r"from a source tensor, where src is the name of the source tensor\.")


class RemovesBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.register_buffer("y", torch.tensor([2.0]))

    def forward(self, x):
        if "y" in self._buffers:
            del self._buffers["y"]
        out = self.fc(x)
        return out, poptorch.identity_loss(out.sum(), reduction="sum")


class ReassignsBuffer(RemovesBuffer):
    def forward(self, x):
        out = self.fc(x)
        self.y = out.sum().detach().reshape(1)  # pylint: disable=attribute-defined-outside-init
        return out, poptorch.identity_loss(out.sum(), reduction="sum")


def _wrap(model, training):
    if training:
        return poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    return poptorch.inferenceModel(model)


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("cls, message", [(RemovesBuffer, REMOVED), (ReassignsBuffer, REASSIGNED)],
                         ids=["removed", "reassigned"])
def test_forward_removing_or_reassigning_a_buffer_gets_poptorchs_error(cls, message, training):
    model = cls()
    buffer = model.y
    with pytest.raises(poptorch.Error, match=message):
        _wrap(model, training)(torch.ones(2, 2))
    assert model.y is buffer and torch.equal(buffer, torch.tensor([2.0]))  # put back


@pytest.fixture
def _one_thread(request, monkeypatch):
    one_thread_everywhere(request, monkeypatch)


def test_a_split_model_removing_a_buffer_gets_the_same_error(request, _one_thread):
    # A model on two devices finds it in its torch.export capture, not in an eager run.
    model = RemovesBuffer()
    model.fc = poptorch.BeginBlock(model.fc, ipu_id=1)
    wrapped = cleaned(request, poptorch.inferenceModel(
        model, poptorch.Options().deviceIterations(2)))
    with pytest.raises(poptorch.Error, match=REMOVED):
        wrapped(torch.ones(4, 2))
    assert "y" in model._buffers


class Counter(nn.Module):
    """A model whose buffer forward changes in place: what PopTorch supports."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.register_buffer("y", torch.zeros(1))

    def forward(self, x, target):
        self.y.add_(1)
        out = self.fc(x)
        return out, F.mse_loss(out, target)


def test_a_buffer_changed_in_place_is_fine_and_counts_like_torch():
    model = Counter()
    plain = copy.deepcopy(model)
    wrapped = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    for seed in range(3):
        x, target = torch.randn(2, 2, generator=torch.Generator().manual_seed(seed)), torch.ones(2, 2)
        wrapped(x, target)
        optimizer.zero_grad()
        plain(x, target)[1].backward()
        optimizer.step()
    assert model.y.item() == 3.0
    assert_close(model.fc.weight, plain.fc.weight)


@pytest.mark.parametrize("change", ["removed", "redefined"])
def test_a_buffer_removed_or_redefined_after_compiling_is_refused(change):
    model = Counter()
    wrapped = poptorch.trainingModel(model)
    x, target = torch.ones(2, 2), torch.zeros(2, 2)
    wrapped(x, target)
    if change == "removed":
        del model._buffers["y"]
    else:
        model.y = torch.zeros(1)
    with pytest.raises(poptorch.Error, match=f"{change} \\['y'\\]"):
        wrapped(x, target)


# --- copyNamedBuffersToDevice with options that cannot work --------------------------------
class Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(2)

    def forward(self, x):
        return self.bn(x)


@pytest.mark.parametrize("names, message", [
    (None, r"no buffers were named; list them with Options\.updatableNamedBuffers"),
    (["bn.unknown"], r"\['bn\.unknown'\] are not buffers of the model; its buffers are "
                     r"\['bn\.num_batches_tracked', 'bn\.running_mean', 'bn\.running_var'\]"),
    (["bn.weight"], r"\['bn\.weight'\] are not buffers of the model"),  # a parameter
], ids=["none", "unknown", "parameter"])
def test_copy_named_buffers_with_invalid_options_raises(names, message):
    opts = poptorch.Options()
    if names is not None:
        opts.updatableNamedBuffers(names)
    model = Normed().eval()
    wrapped = poptorch.inferenceModel(model, opts)
    wrapped(torch.ones(4, 2))
    with pytest.raises(poptorch.Error, match=message):
        wrapped.copyNamedBuffersToDevice()


def test_copy_named_buffers_before_compiling_raises():
    opts = poptorch.Options().updatableNamedBuffers(["bn.running_mean"])
    wrapped = poptorch.inferenceModel(Normed(), opts)
    with pytest.raises(RuntimeError, match="Model has not been compiled"):
        wrapped.copyNamedBuffersToDevice()


# --- for_loop's inputs ---------------------------------------------------------------------
@pytest.mark.parametrize("inputs, message", [
    (3, r"expects input tensors \(inputs\) to be a list of tensors\. \(Object is not list\)"),
    ({"x": torch.ones(1)}, r"\(Object is not list\) Got dict"),
    ([torch.ones(1), 2.0], r"\(Object contained in list at index 1 is not torch\.tensor\)"),
], ids=["int", "dict", "float-in-list"])
def test_for_loop_refuses_what_is_not_a_list_of_tensors(inputs, message):
    with pytest.raises(ValueError, match=r"^poptorch\.for_loop .*" + message):
        poptorch.for_loop(2, lambda *a: a, inputs)


def test_for_loop_errors_surface_from_a_wrapped_model():
    class Loop(nn.Module):
        def forward(self, x):
            return poptorch.for_loop(2, lambda a: a * 2, [x, 1])[0]

    with pytest.raises(ValueError, match=r"index 1 is not torch\.tensor"):
        poptorch.inferenceModel(Loop())(torch.ones(2))
