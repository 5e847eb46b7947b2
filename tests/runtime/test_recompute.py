"""Recomputation at recomputationCheckpoint calls: same numbers as plain PyTorch, less kept."""
from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pipetorch as poptorch
from pipetorch import ops
from pipetorch.errors import CompileError
from pipetorch.parallel.worker.recompute import _RecomputedModule

from helpers.activations import saved_activation_bytes

BATCH, WIDTH = 16, 32
ACTIVATION_BYTES = BATCH * WIDTH * 4  # one float32 [BATCH, WIDTH] activation


class CheckpointedMLP(nn.Module):
    """Six Linear+ReLU layers, checkpoints after the 2nd and 4th, dropout inside a segment."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(6))
        self.acts = nn.ModuleList(nn.ReLU() for _ in range(6))
        self.dropout = nn.Dropout(0.25)

    def forward(self, x, target):
        for index, (layer, act) in enumerate(zip(self.layers, self.acts)):
            x = act(layer(x))
            if index == 0:
                x = self.dropout(x)
            if index in (1, 3):
                x = poptorch.recomputationCheckpoint(x)
        return x, F.mse_loss(x, target)


class SkipModel(nn.Module):
    """A residual that jumps over a checkpoint, and two tensors checkpointed together."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(WIDTH, WIDTH) for _ in range(4))

    def forward(self, x):
        skip = torch.tanh(self.a(x))
        h = torch.relu(self.b(skip))
        h, g = poptorch.recomputationCheckpoint(h, h * 2)
        h = torch.sigmoid(self.c(h + g))
        h = poptorch.recomputationCheckpoint(h)
        return poptorch.identity_loss(self.d(h) + skip, reduction="mean")


class BatchNormModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear, self.norm = nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x):
        h = poptorch.recomputationCheckpoint(torch.relu(self.norm(self.linear(x))))
        return self.head(h).pow(2).mean()


def _run(model, inputs, seed=0):
    torch.manual_seed(seed)
    out = model(*inputs)
    loss = out[-1] if isinstance(out, tuple) else out
    loss.backward()
    return out


def _assert_same_training_step(plain, wrapped_of, inputs):
    """wrapped_of(copy) must give bitwise the outputs and gradients of `plain`."""
    original = copy.deepcopy(plain)
    wrapped = wrapped_of(original)
    expected, got = _run(plain, inputs), _run(wrapped, inputs)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    for (name, p), q in zip(plain.named_parameters(), original.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0, msg=name)
        assert torch.equal(q.grad, p.grad), name
    for (name, b), c in zip(plain.named_buffers(), original.buffers()):
        assert torch.equal(c, b), name


def test_mlp_outputs_and_gradients_are_bitwise_equal():
    torch.manual_seed(0)
    inputs = (torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH))
    _assert_same_training_step(CheckpointedMLP(), _RecomputedModule, inputs)


def test_skip_connection_over_checkpoint_is_bitwise_equal():
    torch.manual_seed(0)
    _assert_same_training_step(SkipModel(), _RecomputedModule, (torch.randn(BATCH, WIDTH),))


def test_batchnorm_statistics_update_once_despite_recompute():
    # Recomputing the forward in backward runs BatchNorm again; its running statistics and
    # num_batches_tracked must still move exactly once per step.
    torch.manual_seed(0)
    _assert_same_training_step(BatchNormModel(), _RecomputedModule, (torch.randn(BATCH, WIDTH),))


def test_segments_are_checkpointed_and_cut_at_each_checkpoint():
    wrapped = _RecomputedModule(CheckpointedMLP())
    segments = [type(m).__name__ for m in wrapped._program().children()]
    assert segments == ["_CheckpointedSegment", "_CheckpointedSegment", "GraphModule"]


def test_shares_parameters_and_trains_with_optimiser_on_original():
    torch.manual_seed(0)
    plain = SkipModel()
    original = copy.deepcopy(plain)
    wrapped = _RecomputedModule(original)
    assert [id(p) for p in wrapped.parameters()] == [id(p) for p in original.parameters()]
    x = torch.randn(BATCH, WIDTH)
    for model, params in ((plain, plain.parameters()), (wrapped, original.parameters())):
        optimiser = torch.optim.SGD(params, lr=0.1)
        for _ in range(3):
            optimiser.zero_grad()
            model(x).backward()
            optimiser.step()
    for p, q in zip(plain.parameters(), original.parameters()):
        assert torch.equal(p, q)


def test_recomputation_saves_fewer_activation_bytes():
    torch.manual_seed(0)
    plain = CheckpointedMLP()
    wrapped = _RecomputedModule(copy.deepcopy(plain))
    inputs = (torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH))
    plain_bytes = saved_activation_bytes(plain, inputs)
    wrapped_bytes = saved_activation_bytes(wrapped, inputs)
    # Plain saves x, the six ReLU outputs r1..r6, the dropout output and mask, and the target.
    # Wrapped saves the values crossing segments (x, r2, r4; checkpoint saves its inputs through
    # autograd too) and the last segment's r5, r6 and target: r1, the dropout output and mask,
    # and r3 live only inside checkpointed segments and are recomputed in backward.
    assert plain_bytes >= 9 * ACTIVATION_BYTES
    assert wrapped_bytes <= 6 * ACTIVATION_BYTES
    assert plain_bytes - wrapped_bytes >= 3 * ACTIVATION_BYTES


def test_checkpointed_segments_rerun_in_backward():
    torch.manual_seed(0)
    wrapped = _RecomputedModule(CheckpointedMLP())
    calls = [0] * 6
    for index, act in enumerate(wrapped.module.acts):
        act.register_forward_hook(lambda m, i, o, index=index: calls.__setitem__(
            index, calls[index] + 1))
    _, loss = wrapped(torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH))
    assert calls == [1] * 6
    loss.backward()
    # The dropped activations (r1, r3) were rebuilt for backward; the last segment was not
    # rerun. (r2 and r4 are checkpoint values, which torch may not need to recompute.)
    assert calls[0] == 2 and calls[2] == 2
    assert calls[4:] == [1, 1]


def test_untraceable_forward_is_a_compile_error_naming_the_line():
    class DataDependent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(2, 2)

        def forward(self, x):
            x = poptorch.recomputationCheckpoint(self.linear(x))
            if x.sum() > 0:
                x = x * 2
            return x.sum()

    with pytest.raises(CompileError) as error:
        _RecomputedModule(DataDependent())
    message = str(error.value)
    assert "DataDependent.forward" in message
    assert "test_recompute.py" in message and "`if x.sum() > 0:`" in message
    assert "TraceError" in message and "control flow" in message
    assert "remove the poptorch.recomputationCheckpoint calls" in message
    assert "make forward traceable under torch.fx rules" in message


class _Scope:
    """A plain context manager like `with poptorch.Block(...)`."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_context_managers_in_forward_and_no_grad_path():
    class Blocks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 1)

        def forward(self, x):
            with _Scope():
                h = poptorch.recomputationCheckpoint(torch.relu(self.a(x)))
            with _Scope():
                return self.b(h).sum()

    torch.manual_seed(0)
    _assert_same_training_step(Blocks(), _RecomputedModule, (torch.randn(BATCH, WIDTH),))
    model = Blocks()
    wrapped = _RecomputedModule(model)
    x = torch.randn(BATCH, WIDTH)
    with torch.no_grad():
        assert torch.equal(wrapped(x), model(x))


def test_mode_specific_python_branches_are_traced_per_mode():
    class ModeBranch(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(WIDTH, WIDTH)

        def forward(self, x):
            h = poptorch.recomputationCheckpoint(self.linear(x))
            return (h * 3 if self.training else h).sum()

    model = ModeBranch()
    wrapped = _RecomputedModule(model)
    x = torch.randn(BATCH, WIDTH)
    assert torch.equal(wrapped(x), model(x))
    wrapped.eval()
    assert torch.equal(wrapped(x), model(x))
    assert not model.training


def test_ops_in_segments_print_once_and_count_once():
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage().split(":")[0])
    ops.print_logger.addHandler(handler)

    class Printing(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 1)

        def forward(self, x):
            h = poptorch.ipu_print_tensor(torch.tanh(self.a(x)), "h")
            h = poptorch.recomputationCheckpoint(torch.relu(h))
            return F.mse_loss(self.b(h), x[:, :1] * 0)

    try:
        wrapped = _RecomputedModule(Printing())
        with ops.record_calls() as counts:
            wrapped(torch.randn(BATCH, WIDTH)).backward()
    finally:
        ops.print_logger.removeHandler(handler)
    assert records == ["h", "h_gradient"]
    assert counts == {"recomputationCheckpoint": 1, "loss": 1}


_SHIFT = torch.tensor([0.5, -0.5])


class ScaledLinear(nn.Module):
    """Uses a Parameter directly (a get_attr in the trace), not only through leaf modules."""

    def __init__(self) -> None:
        super().__init__()
        self.linear, self.scale = nn.Linear(2, 2), nn.Parameter(torch.full((2,), 3.0))

    def forward(self, x):
        h = poptorch.recomputationCheckpoint(self.linear(x) + _SHIFT)
        return (h * self.scale).sum(), self.scale


def test_tensor_constants_and_returned_parameters():
    model = ScaledLinear()
    wrapped = _RecomputedModule(model)
    # fx parks constants on the traced module as `_tensor_constant0`; none may be left there.
    assert not [name for name in vars(model) if name.startswith("_tensor_constant")]
    x = torch.randn(4, 2)
    loss, scale = wrapped(x)
    assert scale is model.scale
    assert torch.equal(loss, model(x)[0])


def test_conversion_replacing_parameters_after_wrapping_retraces():
    # .double() with this torch flag swaps in new Parameter objects; a stale trace would train
    # the old `scale` and leave the model's gradient empty.
    model = ScaledLinear()
    wrapped = _RecomputedModule(model)
    previous = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        wrapped.double()
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(previous)
    loss, scale = wrapped(torch.randn(4, 2, dtype=torch.float64))
    loss.backward()
    assert scale is model.scale and loss.dtype == torch.float64
    assert all(p.grad is not None and p.grad.dtype == torch.float64 for p in model.parameters())
