"""Issue 54: the errors PopTorch's misc tests raise and inspect: its core's error-handling hook
(`poptorch_core.TestErrorType`, `_throwTestError`), backward() on an output and an empty
input, each with PopTorch's type and key phrase."""
import pytest
import torch

import pipetorch as poptorch
from pipetorch import poptorch_core
from helpers.models import TinyMLP, data

CONTEXT = ("throwTestError::topLevel", "throwTestError::bottomLevel")


@pytest.mark.parametrize("kind", list(poptorch_core.TestErrorType))
def test_every_test_error_is_a_poptorch_error_with_its_context(kind):
    # poptorch_core had no TestErrorType: PopTorch's misc tests failed at collection
    with pytest.raises(poptorch.Error) as info:
        poptorch_core._throwTestError(kind)
    assert all(c in info.value.args[0] for c in CONTEXT)
    assert all(c in info.value.location for c in CONTEXT)
    assert not any(c in info.value.message for c in CONTEXT)


@pytest.mark.parametrize("kind, cls, type_name", [
    ("PoplarRecoverableFullReset", poptorch.RecoverableError, "poplar_recoverable_runtime_error"),
    ("PoplarUnrecoverable", poptorch.UnrecoverableError, "poplar_unrecoverable_runtime_error"),
    ("PoplarLinkError", poptorch.Error, "poplar_link_error"),
])
def test_the_poplar_errors_keep_their_class_type_and_recovery_action(kind, cls, type_name):
    # scripts branch on RecoverableError.recovery_action and on `type`, as PopTorch's guide shows
    with pytest.raises(cls) as info:
        poptorch_core._throwTestError(poptorch_core.TestErrorType[kind])
    assert info.value.type == type_name
    if cls is poptorch.RecoverableError:
        assert info.value.recovery_action == "FULL_RESET"
    if kind == "PoplarLinkError":
        assert "-lfoo not found" in info.value.message


def test_backward_on_a_training_output_is_poptorchs_error_and_still_a_runtime_error():
    # PopTorch 3.x raises a poptorch.Error; pipetorch raised torch's RuntimeError only
    wrapped = poptorch.trainingModel(TinyMLP())
    out, loss = wrapped(*data(4))
    for tensor in (out, loss):
        with pytest.raises(poptorch.Error, match=r"backward\(\) cannot be called explicitly on "
                                                 r"outputs of a PopTorch model") as info:
            tensor.backward()
        assert isinstance(info.value, RuntimeError)
    wrapped.destroy()


def test_an_empty_batch_is_poptorchs_zero_sized_error():
    # PopTorch's words come first ("Zero-sized tensors are unsupported"), a ValueError as before
    wrapped = poptorch.inferenceModel(TinyMLP())
    with pytest.raises(poptorch.Error, match=r"Zero-sized tensors are unsupported \(Got shape "
                                             r"\[0, 6\]\)") as info:
        wrapped(torch.zeros(0, 6))
    assert isinstance(info.value, ValueError)
