"""Issue 22, errors: PopTorch's error classes and their attributes, wrapping a wrapped model,
and compilationTime() / cycleCount() without IPU hardware."""
import copy
import datetime

import pytest
import torch
from torch.testing import assert_close

import pipetorch as poptorch
from helpers.models import TinyMLP, data


def test_poptorchs_error_classes_carry_type_location_and_recovery_action():
    assert issubclass(poptorch.RecoverableError, poptorch.Error)
    assert issubclass(poptorch.UnrecoverableError, poptorch.Error)
    assert not issubclass(poptorch.UnrecoverableError, poptorch.RecoverableError)
    recoverable = poptorch.RecoverableError("worker 1 failed")
    assert (recoverable.type, recoverable.location, recoverable.message) == (
        "recoverable_runtime_error", "", "worker 1 failed")
    assert recoverable.recovery_action == "FULL_RESET"
    assert poptorch.UnrecoverableError("x").type == "unrecoverable_runtime_error"
    made = poptorch.errors.createPoptorchError("bad input")
    assert isinstance(made, poptorch.Error)
    assert (made.type, made.message, str(made)) == ("poptorch_py_error", "bad input",
                                                    "'poptorch_py_error': bad input")
    with pytest.raises(poptorch.Error) as info:  # scripts catch the base class
        raise poptorch.errors.DeviceError("device 0 stopped answering")
    assert info.value.recovery_action == "FULL_RESET"


@pytest.mark.parametrize("rewrap", [lambda w, m: m, lambda w, m: w], ids=["model", "wrapper"])
def test_training_a_model_twice_is_poptorchs_runtime_error_until_destroy(rewrap):
    torch.manual_seed(0)
    model = TinyMLP()
    plain = copy.deepcopy(model)
    training = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    x, labels = data(4)
    training(x, labels)
    with pytest.raises(RuntimeError, match=r"Model has already been wrapped in "
                                           r"'poptorch.trainingModel'\. Call model\.destroy\(\) on "
                                           r"the model to unwrap before wrapping again") as info:
        poptorch.trainingModel(rewrap(training, model))
    assert isinstance(info.value, poptorch.Error)
    model.destroy()
    again = poptorch.trainingModel(rewrap(training, model),
                                   optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert again.model is model
    loss = again(x, labels)[1]
    # the new wrapper starts from the weights the first one trained
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    for step in range(2):
        opt.zero_grad()
        want = plain(x, labels)[1]
        want.backward()
        opt.step()
    assert_close(loss.as_subclass(torch.Tensor), want.detach())
    again.destroy()
    assert_close(model.fc1.weight, plain.fc1.weight)


def test_compilation_time_needs_a_compiled_model():
    wrapper = poptorch.inferenceModel(TinyMLP())
    with pytest.raises(RuntimeError, match=r"compilationTime\(\) needs a compiled model"):
        wrapper.compilationTime()
    wrapper.compile(data(4)[0])
    assert isinstance(wrapper.compilationTime(), datetime.timedelta)


def test_cycle_count_errors_as_poptorchs_then_needs_ipu_hardware():
    x = data(4)[0]
    plain = poptorch.inferenceModel(TinyMLP())
    with pytest.raises(poptorch.Error, match=r"Cycle count logging is disabled\. Please set "
                                             r"option logCycleCount to True to enable\."):
        plain.cycleCount()
    wrapper = poptorch.inferenceModel(TinyMLP(), poptorch.Options().logCycleCount(True))
    with pytest.raises(poptorch.Error, match=r"Please run the model at least once before "
                                             r"obtaining cycle count\."):
        wrapper.cycleCount()
    wrapper.compile(x)  # compiled but not run: still PopTorch's message
    with pytest.raises(poptorch.Error, match="at least once"):
        wrapper.cycleCount()
    wrapper(x)
    with pytest.raises(poptorch.errors.IpuOnlyError, match=r"getComputeLatency\(\)"):
        wrapper.cycleCount()
