"""PopTorch's functional ops: values, gradients, logging, call recording and error messages."""
from __future__ import annotations

import logging
import sys

import pytest
import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

import pipetorch as poptorch
from pipetorch import ops


@pytest.fixture
def printed():
    """The messages logged on "pipetorch.print" during a test."""
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Collect()
    ops.print_logger.addHandler(handler)
    yield records
    ops.print_logger.removeHandler(handler)


def test_public_names_are_poptorch_ops():
    assert sorted(ops.__all__) == sorted([
        "identity_loss", "recomputationCheckpoint", "ipu_print_tensor", "set_available_memory",
        "nop", "for_loop", "cond", "isRunningOnIpu"])
    for name in ops.__all__:
        assert getattr(poptorch, name) is getattr(ops, name)


# --- identity_loss -----------------------------------------------------------------------
@pytest.mark.parametrize("reduction, expected", [
    ("sum", lambda x: x.sum()), ("mean", lambda x: x.mean()), ("none", lambda x: x)])
def test_identity_loss_reduces_like_torch(reduction, expected):
    x = torch.randn(3, 4, requires_grad=True)
    reference = x.detach().clone().requires_grad_()
    loss = poptorch.identity_loss(x, reduction)
    assert torch.equal(loss, expected(reference))
    loss.sum().backward()
    expected(reference).sum().backward()
    assert torch.equal(x.grad, reference.grad)


def test_identity_loss_rejects_unknown_reduction():
    with pytest.raises(ValueError, match=r"reduction='max'.*'sum', 'mean', 'none'"):
        poptorch.identity_loss(torch.ones(2), "max")
    with pytest.raises(ValueError, match=r"reduction=1"):
        poptorch.identity_loss(torch.ones(2), 1)


def test_identity_loss_rejects_non_tensor():
    with pytest.raises(TypeError, match="identity_loss expects x to be a torch.Tensor, got float"):
        poptorch.identity_loss(1.0, "sum")


# --- recomputationCheckpoint ----------------------------------------------------------------
def test_checkpoint_returns_inputs_unchanged():
    a, b = torch.ones(2), torch.zeros(3)
    assert poptorch.recomputationCheckpoint(a) is a
    both = poptorch.recomputationCheckpoint(a, b)
    assert type(both) is tuple and both[0] is a and both[1] is b
    as_list = poptorch.recomputationCheckpoint([a, b])
    assert type(as_list) is list and as_list[0] is a and as_list[1] is b
    as_tuple = poptorch.recomputationCheckpoint((a, b))
    assert type(as_tuple) is tuple and as_tuple[1] is b
    assert poptorch.recomputationCheckpoint() == ()


def test_checkpoint_rejects_non_tensor():
    with pytest.raises(TypeError, match="argument 1 to be a torch.Tensor, got int"):
        poptorch.recomputationCheckpoint(torch.ones(1), 3)


# --- ipu_print_tensor ----------------------------------------------------------------------
def test_print_tensor_logs_value_and_gradient(printed):
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    y = poptorch.ipu_print_tensor(x * 3, "tripled")
    assert torch.equal(y, torch.tensor([3.0, 6.0]))
    assert printed == ["tripled: (3., 6.)"]
    (y * torch.tensor([0.5, 0.25])).sum().backward()
    assert printed == ["tripled: (3., 6.)", "tripled_gradient: (0.5 , 0.25)"]
    assert torch.equal(x.grad, torch.tensor([1.5, 0.75]))


def test_print_tensor_without_gradient_print(printed):
    x = torch.tensor([1.0], requires_grad=True)
    y = poptorch.ipu_print_tensor(x, "t", print_gradient=False)
    y.sum().backward()
    assert printed == ["t: (1.)"]
    assert y is x


def test_print_tensor_layout_options(printed):
    poptorch.ipu_print_tensor(torch.arange(10), "n", summarise_threshold=5, edge_items=2,
                              separator=" ", open_bracket="<", close_bracket=">")
    poptorch.ipu_print_tensor(torch.tensor([1234.5]), "s", float_format="scientific", digits=2)
    poptorch.ipu_print_tensor(torch.tensor([[1.0, 2.0]], dtype=torch.bfloat16))
    assert printed == ["n: <0 1 ... 8 9>", "s: (1.23e+03)", "tensor: ((1., 2.))"]


def test_print_tensor_errors():
    with pytest.raises(ValueError, match=r"float_format='hex'.*'auto', 'fixed'"):
        poptorch.ipu_print_tensor(torch.ones(1), float_format="hex")
    with pytest.raises(TypeError, match="ipu_print_tensor expects tensor to be a torch.Tensor"):
        poptorch.ipu_print_tensor([1.0])


def test_print_logger_writes_to_stderr_by_default():
    handlers = [h for h in ops.print_logger.handlers if isinstance(h, logging.StreamHandler)]
    assert any(h.stream is sys.stderr for h in handlers)
    assert ops.print_logger.isEnabledFor(logging.INFO)


# --- set_available_memory and nop --------------------------------------------------------------
def test_set_available_memory_validates_proportion():
    x = torch.ones(2)
    assert poptorch.set_available_memory(x, 0.6) is x
    assert poptorch.set_available_memory(x, 1) is x
    for bad in (0, 1.5, -0.1):
        with pytest.raises(ValueError, match=rf"available_memory_proportion={bad}; .*\(0, 1\]"):
            poptorch.set_available_memory(x, bad)
    with pytest.raises(TypeError, match="got str"):
        poptorch.set_available_memory(x, "0.5")


def test_nop_is_a_differentiable_identity():
    x = torch.randn(3, requires_grad=True)
    y = poptorch.nop(x)
    assert torch.equal(y, x)
    (y * 2).sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0))
    with pytest.raises(TypeError, match="nop expects tensor"):
        poptorch.nop(None)


# --- for_loop ----------------------------------------------------------------------------
def test_for_loop_feeds_outputs_back():
    x, s = torch.tensor([1.0, 2.0]), torch.zeros(1)
    out = poptorch.for_loop(3, lambda a, b: (a * 2 + 1, b + a.sum()), [x, s])
    assert isinstance(out, list)
    assert torch.equal(out[0], torch.tensor([15.0, 23.0]))
    assert torch.equal(out[1], torch.tensor([3.0 + 8.0 + 18.0]))
    assert torch.equal(x, torch.tensor([1.0, 2.0]))


def test_for_loop_single_tensor_body_and_zero_count():
    x = torch.ones(2)
    assert torch.equal(poptorch.for_loop(2, lambda a: a + 1, [x])[0], torch.full((2,), 3.0))
    unchanged = poptorch.for_loop(0, lambda a: a + 1, [x])
    assert torch.equal(unchanged[0], x) and unchanged[0] is not x


def test_for_loop_passes_inputs_by_value():
    x = torch.ones(2)

    def body(a):
        a.add_(1)  # in place: must not reach the caller's tensor
        return a

    poptorch.for_loop(2, body, [x])
    assert torch.equal(x, torch.ones(2))


def test_for_loop_body_output_mismatch_names_both():
    with pytest.raises(ValueError, match=r"inputs have shapes \[\(2,\)\], the body returned "
                                         r"\[\(2,\), \(2,\)\]"):
        poptorch.for_loop(1, lambda a: (a, a), [torch.ones(2)])
    with pytest.raises(ValueError, match=r"\[\(2,\)\], the body returned \[\(1,\)\]"):
        poptorch.for_loop(1, lambda a: a[:1], [torch.ones(2)])


@pytest.mark.parametrize("count", [-1, 1.5, True, "2"])
def test_for_loop_rejects_bad_count(count):
    with pytest.raises(ValueError, match=rf"count to be an int >= 0, got {count!r}"):
        poptorch.for_loop(count, lambda a: a, [torch.ones(1)])


def test_for_loop_rejects_non_list_inputs():
    # PopTorch's words and ValueError (tests/compat/test_buffers_loops_compat.py), a TypeError too
    with pytest.raises(TypeError, match=r"\(Object is not list\) Got dict"):
        poptorch.for_loop(1, lambda a: a, {"a": torch.ones(1)})
    with pytest.raises(TypeError, match=r"index 1 is not torch.tensor\) Got int"):
        poptorch.for_loop(1, lambda a, b: (a, b), [torch.ones(1), 2])


# --- cond --------------------------------------------------------------------------------
def test_cond_runs_the_chosen_branch():
    x, y = torch.tensor([2.0]), torch.tensor([5.0])
    then_body, else_body = (lambda a: a * 10), (lambda a, b: (a + b, b))
    assert poptorch.cond(torch.tensor(True), then_body, [x], else_body, [x, y]) == [x * 10]
    out = poptorch.cond(torch.tensor([False]), then_body, [x], else_body, [x, y])
    assert len(out) == 2 and torch.equal(out[0], x + y) and torch.equal(out[1], y)
    assert torch.equal(poptorch.cond(True, lambda: x, [], else_body, [x, y])[0], x)


def test_cond_errors():
    body = lambda a: a  # noqa: E731
    with pytest.raises(ValueError, match=r"one-element condition tensor, got shape \(2,\)"):
        poptorch.cond(torch.tensor([True, False]), body, [torch.ones(1)], body, [torch.ones(1)])
    with pytest.raises(TypeError, match="then_inps to be a tensor or a list of tensors, got int"):
        poptorch.cond(True, body, 3, body, [torch.ones(1)])


# --- isRunningOnIpu and record_calls ---------------------------------------------------------
def test_is_running_on_ipu_only_inside_device_context():
    assert poptorch.isRunningOnIpu() is False
    with ops.running_on_device():
        assert poptorch.isRunningOnIpu() is True
    assert poptorch.isRunningOnIpu() is False
    with pytest.raises(KeyError):
        with ops.running_on_device():
            raise KeyError("model failed")
    assert poptorch.isRunningOnIpu() is False


def test_record_calls_counts_poptorch_ops_and_torch_losses():
    x, target = torch.randn(4, 3), torch.tensor([0, 1, 2, 0])
    with ops.record_calls() as counts:
        h = poptorch.recomputationCheckpoint(torch.relu(x))
        poptorch.recomputationCheckpoint(h, h)
        poptorch.identity_loss(h, "mean")
        nn.CrossEntropyLoss()(h, target)
        nn.MSELoss()(h, x)
        F.binary_cross_entropy_with_logits(h, torch.ones_like(h))
        torch.nn.functional.relu(h)
    assert counts == {"recomputationCheckpoint": 2, "identity_loss": 1, "loss": 3}
    poptorch.identity_loss(x, "sum")
    F.l1_loss(x, x)
    assert counts == {"recomputationCheckpoint": 2, "identity_loss": 1, "loss": 3}


def test_record_calls_ignores_recomputation():
    with ops.record_calls() as counts, ops.recomputing():
        poptorch.identity_loss(torch.ones(1), "sum")
        F.mse_loss(torch.ones(1), torch.zeros(1))
    assert counts == {}


def test_model_without_loss_records_none():
    with ops.record_calls() as counts:
        nn.Linear(2, 2)(torch.ones(1, 2)).sum()
    assert counts["loss"] == 0 and counts["identity_loss"] == 0


# --- tracing ---------------------------------------------------------------------------------
def test_ops_are_single_nodes_under_fx_tracing():
    class Model(nn.Module):
        def forward(self, x):
            x = poptorch.recomputationCheckpoint(poptorch.nop(x) * 2)
            x = poptorch.ipu_print_tensor(x, "x")
            x = poptorch.set_available_memory(x, 0.5)
            return poptorch.identity_loss(x, reduction="sum")

    traced = torch.fx.symbolic_trace(Model())
    targets = [n.target for n in traced.graph.nodes if n.op == "call_function"]
    assert targets[0] is poptorch.nop and targets[2] is poptorch.recomputationCheckpoint
    assert targets[3:] == [poptorch.ipu_print_tensor, poptorch.set_available_memory,
                           poptorch.identity_loss]
    assert torch.equal(traced(torch.ones(3)), torch.tensor(6.0))
