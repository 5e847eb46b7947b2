"""Issue 17 group 5: several losses, integer-label losses, for_loop / cond, BeginBlock on a
function, as PopTorch documents them, compared with plain PyTorch."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.testing import assert_close

import pipetorch as poptorch
from pipetorch.partition import blocks


class ManyLosses(nn.Module):
    """Partial losses of every kind, combined into one final identity_loss returned first;
    with `combine=False` it returns them as four independent losses."""

    def __init__(self, combine: bool = True) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.combine = combine

    def forward(self, x, labels, target):
        out = self.fc(x)
        ce = F.cross_entropy(out, labels)  # integer labels
        squared = poptorch.identity_loss((out - target) ** 2, reduction="none")
        absolute = poptorch.identity_loss((out - target).abs(), reduction="mean")
        total = poptorch.identity_loss(out.sum(), reduction="sum")
        if not self.combine:
            return ce, out, squared, (absolute, total)
        final = poptorch.identity_loss(ce + squared.sum() + absolute + total, reduction="none")
        return final, out, squared, (absolute, total)


def _train_once(model, *inputs):
    opt = poptorch.optim.SGD(model.parameters(), lr=0.1)
    return poptorch.trainingModel(model, optimizer=opt)(*inputs)


def test_partial_losses_train_on_the_final_one_returned_first():
    torch.manual_seed(0)
    model = ManyLosses()
    plain = copy.deepcopy(model)
    x, labels, target = torch.randn(5, 4), torch.tensor([0, 2, 1, 1, 0]), torch.randn(5, 3)
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    wrapped = poptorch.trainingModel(model, optimizer=poptorch.optim.SGD(model.parameters(),
                                                                         lr=0.1))
    for _ in range(3):  # the later calls run on trained weights
        final, out, squared, (absolute, total) = wrapped(x, labels, target)
        opt.zero_grad()
        p_final, p_out, p_sq, (p_abs, p_total) = plain(x, labels, target)
        p_final.backward()
        opt.step()
        for got, want in [(final, p_final), (out, p_out), (squared, p_sq), (absolute, p_abs),
                          (total, p_total)]:
            assert_close(got, want.detach())
    assert squared.shape == (5, 3)  # reduction="none" is returned unreduced
    assert_close(model.fc.weight, plain.fc.weight)
    assert_close(model.fc.bias, plain.fc.bias)


def test_independent_losses_get_poptorchs_error():
    x, labels, target = torch.randn(5, 4), torch.tensor([0, 2, 1, 1, 0]), torch.randn(5, 3)
    with pytest.raises(poptorch.Error, match=r"(?s)Multiple independent losses found in graph"
                       r".*4 losses.*F\.cross_entropy #1 \(returned as output\[0\]\)"):
        _train_once(ManyLosses(combine=False), x, labels, target)


class IntLabelLoss(nn.Module):
    """nll_loss on int64 labels plus an MSE on floats; the loss is the last output."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x, labels, target):
        out = self.fc(x)
        return out, F.nll_loss(out.log_softmax(-1), labels) + F.mse_loss(out, target)


def test_integer_label_loss_mixed_with_float_loss_matches_torch():
    torch.manual_seed(1)
    model = IntLabelLoss()
    plain = copy.deepcopy(model)
    x, labels, target = torch.randn(4, 4), torch.tensor([2, 0, 1, 2]), torch.randn(4, 3)
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(2)
    opt = poptorch.optim.SGD(model.parameters(), lr=0.05)
    out, loss = poptorch.trainingModel(model, opts, optimizer=opt)(x, labels, target)

    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.05)
    losses = []
    for half in (slice(0, 2), slice(2, 4)):
        _, l = plain(x[half], labels[half], target[half])
        (l / 2).backward()
        losses.append(l.detach())
    plain_opt.step()
    assert_close(loss, losses[-1])  # outputMode Final: the last micro-batch's
    assert_close(model.fc.weight, plain.fc.weight)


class LoopAndBranch(nn.Module):
    """for_loop over a single tensor with a constant input, then cond, both trained through."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.head = nn.Linear(3, 2)

    def forward(self, x, target):
        bias = torch.full((3,), 0.5)  # a constant made in forward
        x = poptorch.for_loop(3, lambda h: torch.tanh(self.fc(h) + bias), x)[0]
        gate = x.sum() > 0
        y = poptorch.cond(gate, lambda a: self.head(a), x, lambda a: self.head(-a), [x])[0]
        return y, F.mse_loss(y, target)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_for_loop_and_cond_train_like_plain_torch(sign):
    torch.manual_seed(2)
    model = LoopAndBranch()
    plain = copy.deepcopy(model)
    x, target = sign * torch.rand(4, 3), torch.randn(4, 2)
    out, loss = _train_once(model, x, target)

    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    p_out, p_loss = plain(x, target)
    p_loss.backward()
    opt.step()
    assert_close(out, p_out.detach())
    assert_close(loss, p_loss.detach())
    for name, param in plain.named_parameters():
        assert_close(model.get_parameter(name), param, msg=name)


def test_for_loop_and_cond_accept_a_single_tensor():
    x = torch.ones(2)
    assert torch.equal(poptorch.for_loop(2, lambda a: a * 3, x)[0], torch.full((2,), 9.0))
    assert torch.equal(poptorch.cond(torch.tensor([0.0]) > 1, lambda a: a, x,
                                     lambda a: -a, x)[0], -x)


def _scaled(x):
    return x * 2


def test_begin_block_on_a_function_starts_its_block():
    begin = poptorch.BeginBlock(_scaled, "head", ipu_id=1)
    assert begin.__name__ == "_scaled"
    with blocks.recording() as rec:
        with poptorch.Block("body", ipu_id=0):
            y = torch.ones(2) + 1
        assert torch.equal(begin(y), torch.full((2,), 4.0))
        assert rec.current() == "head"  # lasts until the next block starts
    assert [(b.user_id, b.ipu_id) for b in rec.ordered()] == [("body", 0), ("head", 1)]
    assert torch.equal(begin(torch.ones(1)), torch.full((1,), 2.0))  # outside a capture: a call
    with pytest.raises(TypeError, match="nn.Module or a function, got int"):
        poptorch.BeginBlock(3, "x")


class ShardedLoop(nn.Module):
    """for_loop on ipu 0, cond on ipu 1 (its head begun by BeginBlock on a function), a loss
    on each."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.head = nn.Linear(3, 2)
        self.begin_head = poptorch.BeginBlock(self._head, "B2", ipu_id=1)

    def _head(self, x):
        gate = x.sum() > 0
        return poptorch.cond(gate, lambda a: self.head(a), x, lambda a: self.head(-a), x)[0]

    def forward(self, x, target):
        with poptorch.Block("B1", ipu_id=0):
            x = poptorch.for_loop(2, lambda h: torch.tanh(self.fc(h)), [x])[0]
            small = poptorch.identity_loss(x.pow(2), reduction="mean")  # a loss on ipu 0
        y = self.begin_head(x)
        # a partial loss from each device, combined into the final one on ipu 1
        return small, y, poptorch.identity_loss(small + F.mse_loss(y, target), reduction="sum")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["sharded", "phased"])
def test_for_loop_and_cond_on_two_ipus_train_like_torch(strategy):
    torch.manual_seed(3)
    model = ShardedLoop()
    plain = copy.deepcopy(model)
    opts = poptorch.Options().deviceIterations(2)
    if strategy == "sharded":
        opts.setExecutionStrategy(poptorch.ShardedExecution("B1", "B2"))
    else:
        opts.setExecutionStrategy(poptorch.SerialPhasedExecution(
            poptorch.Phase(poptorch.Stage("B1").ipu(0)),
            poptorch.Phase(poptorch.Stage("B2").ipu(1))))
    x = torch.cat([torch.rand(2, 3), -torch.rand(2, 3)])  # one step per branch
    target = torch.randn(4, 2)
    wrapped = poptorch.trainingModel(model, opts, optimizer=poptorch.optim.SGD(
        model.parameters(), lr=0.1))
    try:
        wrapped(x, target)
    finally:
        wrapped.destroy()
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    for rows in (slice(0, 2), slice(2, 4)):
        opt.zero_grad()
        _, _, p_loss = plain(x[rows], target[rows])
        p_loss.backward()
        opt.step()
    for name, param in plain.named_parameters():
        assert_close(model.get_parameter(name), param, msg=name)


