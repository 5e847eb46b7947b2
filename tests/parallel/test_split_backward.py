"""The backward split in two (input gradient, then weight gradients): the same gradients as one
backward, with the weights' left for W."""
import copy

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from pipetorch.parallel.worker.split_backward import backward_input, backward_weight


class Chain(nn.Module):
    def __init__(self, tied=False, checkpointed=False):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 3)
        self.tied, self.checkpointed = tied, checkpointed

    def body(self, x):
        h = torch.tanh(self.a(x))
        if self.tied:  # the same weight twice: two intermediates, one below the other
            h = torch.tanh(self.a(h))
        return self.b(h)

    def forward(self, x):
        if self.checkpointed:
            return checkpoint(self.body, x, use_reentrant=False)
        return self.body(x)


def _full(model, x, seed):
    x = x.clone().requires_grad_(True)
    torch.autograd.backward([model(x)], [seed])
    return x.grad, [p.grad for p in model.parameters()]


@pytest.mark.parametrize("tied, checkpointed", [(False, False), (True, False), (False, True)])
def test_input_then_weights_equal_one_backward(tied, checkpointed):
    torch.manual_seed(0)
    model = Chain(tied, checkpointed)
    reference = copy.deepcopy(model)
    x, seed = torch.randn(5, 4), torch.randn(5, 3)
    expected_x, expected_params = _full(reference, x, seed)

    leaf = x.clone().requires_grad_(True)
    deferred = backward_input([model(leaf)], [seed], [leaf], list(model.parameters()))
    assert deferred is not None
    assert torch.allclose(leaf.grad, expected_x, rtol=0, atol=1e-6)
    assert all(p.grad is None for p in model.parameters())  # left for W
    backward_weight(deferred)
    for p, expected in zip(model.parameters(), expected_params):
        assert torch.allclose(p.grad, expected, rtol=0, atol=1e-6)


def test_a_weight_off_the_input_path_runs_the_whole_backward_in_b():
    torch.manual_seed(0)
    model = Chain()
    offset = nn.Parameter(torch.randn(3))
    leaf = torch.randn(5, 4, requires_grad=True)
    # `offset * 2` is a second output that never meets x's path: W could not reach it
    outputs = [model(leaf), offset * 2]
    deferred = backward_input(outputs, [torch.ones(5, 3), torch.ones(3)], [leaf],
                              [*model.parameters(), offset])
    assert deferred is None
    assert leaf.grad is not None and offset.grad is not None
    assert all(p.grad is not None for p in model.parameters())


def test_no_input_to_differentiate_runs_the_whole_backward_in_b():
    # the first stage: its inputs come from the host and need no gradient
    model = Chain()
    x = torch.randn(5, 4)
    assert backward_input([model(x)], [torch.ones(5, 3)], [x], list(model.parameters())) is None
    assert all(p.grad is not None for p in model.parameters())
    backward_weight(None)  # W of such a micro-batch has nothing to do


class Counted(torch.autograd.Function):
    """Identity whose backward counts its runs."""

    runs = 0

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        Counted.runs += 1
        return grad


def test_w_does_not_run_the_input_path_again():
    # W once ran one autograd call from every intermediate: starting at b's, it went down
    # the input path through Counted again to reach a's weight, a whole second backward.
    torch.manual_seed(0)
    a, b = nn.Linear(4, 4), nn.Linear(4, 3)
    leaf = torch.randn(5, 4, requires_grad=True)
    out = b(torch.tanh(Counted.apply(a(leaf))))
    Counted.runs = 0
    deferred = backward_input([out], [torch.ones(5, 3)], [leaf],
                              [*a.parameters(), *b.parameters()])
    assert Counted.runs == 1
    backward_weight(deferred)
    assert Counted.runs == 1
    assert all(p.grad is not None for p in [*a.parameters(), *b.parameters()])
