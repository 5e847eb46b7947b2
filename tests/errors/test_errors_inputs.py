"""A call's inputs checked on the host before any worker sees them, and torch's common
failures of the first forward retold with the inputs' names, the user's line and the fix."""
from __future__ import annotations

import re

import pytest
import torch

import pipetorch as poptorch
from error_cases import TwoStageClassifier, descendants, no_worker_started
from helpers.models import TinyMLP

ERROR_CASES = "tests/errors/error_cases.py"
SIGNATURE_FIX = ("A wrapped model runs one input signature: call it with the arguments, shapes "
                 "and dtypes of its first call; for new inputs build a new "
                 "trainingModel/inferenceModel, or call destroy() first (pipetorch's "
                 "Options.inputSignatures(\"several\") lets one wrapper run several)")


def quiet():
    return poptorch.Options().showCompilationProgressBar(False)


def two_stages():
    """A model split over two devices (two worker processes once compiled)."""
    return poptorch.inferenceModel(TwoStageClassifier(), quiet().deviceIterations(2))


# Issue 23: `linear(): argument 'input' ... must be Tensor, not list`.
def test_a_list_of_numbers_instead_of_a_tensor():
    wrapper = two_stages()
    with no_worker_started(), pytest.raises(TypeError) as info:
        wrapper([[1.0, 2.0, 3.0, 4.0]] * 4, [0, 1, 2, 0])
    assert str(info.value) == (
        "The model was called without any tensor: argument 0 (x) holds Python numbers (a list "
        "or tuple), not a tensor. Pass torch.tensor(x) (or torch.stack of a list of tensors): "
        "dim 0 holds the samples of the host call")
    assert not wrapper.isCompiled()


def test_a_list_next_to_a_tensor_is_named_after_torch_refuses_it():
    wrapper = poptorch.trainingModel(TinyMLP(), quiet())
    with pytest.raises(TypeError) as info:
        wrapper(torch.randn(4, 6), [0, 1, 2, 0])
    message = str(info.value)
    assert message.startswith("argument 1 (labels) is a list or tuple of Python numbers where "
                              "the model needs a tensor (torch: ")
    assert "must be Tensor, not list" in message and "tests/helpers/models.py:" in message
    assert message.endswith("Pass torch.tensor(labels) instead")


# Issue 23: an int64 input to a float model gave torch's "mat1 and mat2 must have the same dtype".
def test_an_integer_input_to_a_float_model_names_the_argument_and_the_conversion():
    wrapper = two_stages()
    with no_worker_started(), pytest.raises(RuntimeError) as info:
        wrapper(torch.ones(4, 4, dtype=torch.int64), torch.zeros(4, dtype=torch.int64))
    message = str(info.value)
    assert message.startswith(
        "argument 0 (x) is torch.int64, argument 1 (labels) is torch.int64, but the model's "
        "weights are torch.float32 (torch: mat1 and mat2 must have the same dtype")
    assert re.search(rf"at \S*{ERROR_CASES}:\d+ in forward: out = self.fc2\(torch.relu\("
                     r"self.fc1\(x\)\)\)\)", message), message
    assert message.endswith("Convert the input to the model's dtype before the call or in the "
                            "dataset, e.g. x.float()")


# Issue 23: a wrong feature size gave "mat1 and mat2 shapes cannot be multiplied (2x5 and 4x8)".
def test_a_wrong_feature_size_shows_the_micro_batch_and_the_line():
    wrapper = two_stages()
    with no_worker_started(), pytest.raises(RuntimeError) as info:
        wrapper(torch.ones(4, 5), torch.zeros(4, dtype=torch.int64))
    message = str(info.value)
    assert message.startswith(
        "The model's forward failed on the first micro-batch, whose inputs are argument 0 (x) "
        "[2, 5] torch.float32, argument 1 (labels) [2] torch.int64 (torch: mat1 and mat2 "
        "shapes cannot be multiplied (2x5 and 4x8) at ")
    assert ERROR_CASES in message
    assert message.endswith("A layer was built for other sizes than the data has: check the "
                            "inputs' sizes after dim 0 against the model's layers")


def test_a_label_out_of_range_in_the_first_micro_batch():
    wrapper = two_stages()
    with no_worker_started(), pytest.raises(IndexError) as info:
        wrapper(torch.ones(4, 4), torch.tensor([0, 7, 1, 2]))
    message = str(info.value)
    assert message.startswith("A label is out of range for the loss (torch: Target 7 is out of "
                              "bounds. at ")
    assert message.endswith("; argument 1 (labels) holds 0..7. Class labels (targets) must be "
                            "in [0, C) for a model with C outputs: check the dataset's labels "
                            "against the model's output size")


# Issue 23: an empty tensor was "told that 0 is not a multiple of 4".
def test_an_empty_batch_is_called_empty():
    wrapper = two_stages()
    with no_worker_started(), pytest.raises(ValueError) as info:
        wrapper(torch.ones(0, 4), torch.zeros(0, dtype=torch.int64))
    assert str(info.value) == (
        "Zero-sized tensors are unsupported (Got shape [0, 4]): argument 0 (x) is empty: "
        "each host call takes 2 micro-batches of B >= 1 "
        "samples (deviceIterations (2) x gradientAccumulation (1) x replicationFactor (1) = "
        "2), so dim 0 must be 2*B. An empty batch usually comes from slicing past the end of "
        "the data or from an empty dataset")


def test_a_keyword_forward_does_not_take():
    wrapper = two_stages()
    with no_worker_started(), pytest.raises(TypeError) as info:
        wrapper(torch.ones(4, 4), label=torch.zeros(4, dtype=torch.int64))
    assert isinstance(info.value, poptorch.Error)  # PopTorch's "Mandatory parameter" Error
    assert str(info.value) == (
        "Mandatory parameter labels missing: TwoStageClassifier.forward(x: 'torch.Tensor', labels: 'torch.Tensor') cannot take this "
        "call: missing a required argument: 'labels'. Call the wrapped model with the "
        "arguments of the model's forward")


def test_dim_0_not_a_multiple_names_the_argument():
    with pytest.raises(ValueError, match=re.escape(
            "argument 1 (labels) has shape [3], but dim 0 must be a multiple of deviceIterations "
            "(2) x gradientAccumulation (1) x replicationFactor (1) = 2")):
        two_stages()(torch.ones(4, 4), torch.zeros(3, dtype=torch.int64))


# Issue 23: an argument left out on the second call printed a `TreeSpec(...)` dump whose
# advice (build a new wrapper) was wrong for a forgotten argument. Issue 32: each message
# starts with PopTorch's words (its inputs_test.py matches "expected X but got Y"), and
# forward's defaults are filled in first, as PopTorch's arguments parser does.
@pytest.mark.parametrize("call, problem", [
    (lambda w, x, y: w(x), "Type mismatch for labels: expected Tensor but got None (argument 1 "
                           "(labels) changed from a tensor to None, passed as None or left out "
                           "to forward's default)"),
    (lambda w, x, y: w(x.double(), y), "Data type mismatch for x: expected torch.float32 but "
                                       "got torch.float64 (argument 0 (x) changed dtype from "
                                       "torch.float32 to torch.float64); convert it back with "
                                       "x.float()"),
    (lambda w, x, y: w(x, y.int()), "Data type mismatch for labels: expected torch.int64 but "
                                    "got torch.int32 (argument 1 (labels) changed dtype from "
                                    "torch.int64 to torch.int32); convert it back with "
                                    "labels.long()"),
    (lambda w, x, y: w(x[:2], y[:2]), "Shape mismatch for x: expected torch.Size([4, 6]) but "
                                      "got torch.Size([2, 6]) (argument 0 (x) changed shape "
                                      "from [4, 6] to [2, 6])"),
    (lambda w, x, y: w((x,), y), "argument x changed its nesting from a tensor or value on "
                                 "the first call to a tuple of 1"),
])
def test_a_later_call_unlike_the_first_names_the_difference(call, problem):
    wrapper = poptorch.trainingModel(TinyMLP(), quiet())
    x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))
    wrapper(x, y)
    with pytest.raises(ValueError) as info:
        call(wrapper, x, y)
    assert str(info.value) == f"This model was compiled for other inputs: {problem}. {SIGNATURE_FIX}"
    wrapper(x, y)  # the refused call changed nothing


def test_a_later_call_forward_cannot_take_is_refused_by_forward_signature():
    wrapper = poptorch.trainingModel(TinyMLP(), quiet())
    x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))
    wrapper(x, y)
    with pytest.raises(TypeError, match=r"TinyMLP.forward\(.*\) cannot take this call: too many "
                                        r"positional arguments"):
        wrapper(x, y, 3)


def test_an_argument_by_position_or_by_keyword_is_one_signature():
    # PopTorch's test_optional_inputs calls one wrapper with (t1, t2) and (t4=.., t1=.., t2=..).
    wrapper = poptorch.inferenceModel(TinyMLP(), quiet())
    x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))
    first = wrapper(x, y)
    torch.testing.assert_close(wrapper(x, labels=y), first)
    torch.testing.assert_close(wrapper(labels=y, x=x), first)


@pytest.mark.slow
def test_a_later_call_unlike_the_first_reaches_no_worker():
    wrapper = two_stages()
    x, y = torch.ones(4, 4), torch.zeros(4, dtype=torch.int64)
    first = wrapper(x, y)
    before = descendants()
    with pytest.raises(TypeError, match="Mandatory parameter labels missing"):
        wrapper(x)
    assert descendants() == before  # the workers are those of the first call, unharmed
    torch.testing.assert_close(wrapper(x, y), first)
    wrapper.destroy()


@pytest.mark.parametrize("message, kind", [
    ("Target 7 is out of bounds.", "target"),
    ("Assertion `cur_target >= 0 && cur_target < n_classes` failed", "target"),
    ("Target size (torch.Size([4])) must be the same as input size", "shape"),
    ("mat1 and mat2 shapes cannot be multiplied (2x5 and 4x1)", "shape"),
    ("mat1 and mat2 must have the same dtype, but got Long and Float", "dtype"),
    ("linear(): argument 'input' (position 1) must be Tensor, not list", "not_tensor"),
    ("index 5 is out of bounds for dimension 0 with size 3", None),  # not a label: left as is
])
def test_torchs_common_messages_are_recognised(message, kind):
    from pipetorch.tracebacks import error_kind

    assert error_kind(message) == kind
