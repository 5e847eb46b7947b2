"""Issue 17, group 6: errors PopTorch raises that scripts catch, by PopTorch's exception type
and key phrase, with pipetorch's explanation after it."""
import pytest
import torch
import torch.nn as nn
from torch.testing import assert_close

import pipetorch as poptorch
from helpers.models import Shifted, TinyMLP, data


class KeepsAStrayTensor(nn.Module):
    """Keeps a tensor as a plain attribute (not a buffer), on another device than the model."""

    def __init__(self, device):
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.offset = torch.ones(3, device=device)

    def forward(self, x):
        return self.fc(x) + self.offset


def test_a_tensor_on_another_device_than_the_model_is_explained():
    # On a GPU the stray tensor is a CPU one; on this CPU-only run, a "meta" one plays its part.
    stray = "meta" if poptorch.inferenceModel(nn.Identity())._device.type == "cpu" else "cpu"
    wrapped = poptorch.inferenceModel(KeepsAStrayTensor(stray))
    with pytest.raises(RuntimeError, match="register_buffer") as info:
        wrapped(torch.ones(2, 3))
    assert isinstance(info.value, poptorch.errors.DeviceMismatchError)
    assert isinstance(info.value, poptorch.Error)
    # torch's own words come first, so scripts matching them still match
    assert "is not on the expected device" in str(info.value) or \
        "Expected all tensors to be on the same device" in str(info.value)


@pytest.mark.parametrize("change, phrase", [
    (lambda m: setattr(m, "shift", torch.ones(2)), "redefined ['shift']"),
    (lambda m: delattr(m, "shift") or m.register_buffer("shift2", torch.ones(2)),
     "added ['shift2'], removed ['shift']"),
])
def test_buffers_redefined_or_removed_after_compile_are_refused(change, phrase):
    model = Shifted()
    wrapped = poptorch.inferenceModel(model)
    x = torch.randn(3, 4)
    wrapped(x)
    change(model)
    with pytest.raises(RuntimeError, match="Buffers cannot be added, removed or redefined after "
                                           "the model is compiled") as info:
        wrapped(x)
    assert phrase in str(info.value)
    assert isinstance(info.value, poptorch.Error)


def test_buffer_values_changed_in_place_are_fine():
    model = Shifted()
    wrapped = poptorch.inferenceModel(model)
    x = torch.randn(3, 4)
    wrapped(x)
    with torch.no_grad():
        model.shift.fill_(2.0)
    wrapped.copyWeightsToDevice()
    assert_close(wrapped(x), model(x))


def test_backward_on_an_output_raises_torchs_message():
    with pytest.raises(RuntimeError) as plain:
        torch.ones(1).backward()  # what PopTorch's plain output tensors give
    key = str(plain.value)
    wrapped = poptorch.trainingModel(TinyMLP())
    _, loss = wrapped(*data(4))
    with pytest.raises(RuntimeError, match=key) as info:
        loss.backward()
    assert "already ran inside the call" in str(info.value)


def test_poptorch_error_attributes():
    error = poptorch.errors.ConfigError("bad")
    assert (error.message, error.location) == ("bad", "")
    assert issubclass(poptorch.errors.DeviceError, poptorch.RecoverableError)
    assert poptorch.RecoverableError("x").recovery_action == "FULL_RESET"
    assert issubclass(poptorch.UnrecoverableError, poptorch.Error)


class Lookup(nn.Module):
    """An embedding: an index out of range fails at run time, inside the worker."""

    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(5, 2)

    def forward(self, ids):
        return self.table(ids)


@pytest.mark.slow
def test_a_replica_failure_is_a_recoverable_error_naming_the_replica(request, monkeypatch):
    monkeypatch.setenv("PIPETORCH_THREADS_PER_DEVICE", "1")
    opts = poptorch.Options().replicationFactor(2)
    wrapped = poptorch.inferenceModel(Lookup(), opts)
    request.addfinalizer(wrapped.destroy)
    ids = torch.zeros(4, 3, dtype=torch.long)
    wrapped(ids)
    ids[3, 0] = 999  # rows 2-3 go to replica 1
    with pytest.raises(poptorch.RecoverableError) as info:
        wrapped(ids)
    error = info.value
    assert isinstance(error, poptorch.errors.DeviceError) and isinstance(error, RuntimeError)
    assert error.recovery_action == "FULL_RESET"
    assert "of replica 1" in str(error) and "index out of range" in str(error)
    with pytest.raises(poptorch.RecoverableError, match="call destroy\\(\\) and build a new"):
        wrapped(torch.zeros(4, 3, dtype=torch.long))
