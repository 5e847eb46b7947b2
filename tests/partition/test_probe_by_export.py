"""A split model's findings come from its one torch.export capture, the same as an eager probe's;
forward runs once before the first step (twice only when the blocks are found by running it)."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

import pipetorch as poptorch
from matrix.matrix_cases import VARIANTS, ConvNet, MatrixNet, annotate, make_data
from pipetorch.partition.probe import probe, probe_by_export


def findings(capture) -> tuple:
    leaves = [(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t
              for t in pytree.tree_leaves(capture.output)]
    return (capture.blocks, capture.ops_before_blocks, capture.uses_recomputation,
            capture.mutated_buffers, capture.loss_index, leaves,
            pytree.tree_structure(capture.output))


class Checkpointed(nn.Module):
    """Ops before the first block, a recomputation checkpoint, and BatchNorm in a block."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor):
        x = x * 2
        with poptorch.Block("A", ipu_id=0):
            x = poptorch.recomputationCheckpoint(self.norm(self.a(x)))
        with poptorch.Block("B", ipu_id=1):
            out = self.b(x)
            return out, torch.nn.functional.cross_entropy(out, labels)


MODELS = {**{f"mlp_{v}": (lambda v=v: annotate(MatrixNet(v, batchnorm=True), [0, 0, 1, 1]))
             for v in VARIANTS},
          "cnn": lambda: annotate(ConvNet("first"), [0, 1, 1, 1]),
          "checkpointed": Checkpointed}


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("name", MODELS)
def test_the_capture_finds_what_the_eager_probe_finds(name, training):
    model = MODELS[name]()
    x, labels = make_data(model, 4, seed=0, dtype=torch.float32) if name != "checkpointed" \
        else (torch.randn(4, 8), torch.randint(0, 4, (4,)))
    before = {n: b.clone() for n, b in model.named_buffers()}
    eager = probe(model, (x, labels), {}, training=training)
    captured, traced = probe_by_export(model, (x, labels), {}, training=training)
    assert findings(captured) == findings(eager)
    assert [b.user_id for b in traced.blocks] == [b.user_id for b in eager.blocks]
    if name in ("mlp_last", "checkpointed"):  # the buffers forward changes, in training only
        assert bool(captured.mutated_buffers) is training
    for n, b in model.named_buffers():  # neither run changed the model
        assert torch.equal(b, before[n]), n


def test_two_independent_losses_get_poptorch_s_error_from_the_capture():
    class TwoLosses(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
            poptorch.BeginBlock(self.b, "B", ipu_id=1)

        def forward(self, x):
            y = self.b(self.a(x))
            return poptorch.identity_loss(x.sum(), "mean"), poptorch.identity_loss(y.sum(), "mean")

    with pytest.raises(poptorch.Error, match="Multiple independent losses found in graph"):
        probe_by_export(TwoLosses(), (torch.randn(2, 4),), {}, training=True)


class Recorded(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


class Printing(nn.Module):
    def __init__(self, in_forward_blocks: bool) -> None:
        super().__init__()
        self.blocks_in_forward = in_forward_blocks
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)
        if not in_forward_blocks:
            poptorch.BeginBlock(self.b, "B", ipu_id=1)

    def forward(self, x, labels):
        if self.blocks_in_forward:
            with poptorch.Block("A", ipu_id=0):
                x = poptorch.ipu_print_tensor(self.a(x), "seen")
            with poptorch.Block("B", ipu_id=1):
                return torch.nn.functional.cross_entropy(self.b(x), labels)
        x = poptorch.ipu_print_tensor(self.a(x), "seen")
        return torch.nn.functional.cross_entropy(self.b(x), labels)


@pytest.mark.slow
@pytest.mark.parametrize("in_forward_blocks, runs", [(False, 1), (True, 2)],
                         ids=["begin_block", "block_in_forward"])
def test_forward_runs_once_before_the_first_step_when_the_split_is_declared(
        request, in_forward_blocks, runs):
    model = Printing(in_forward_blocks)
    seen: list[int] = []
    model.register_forward_pre_hook(lambda *_: seen.append(1))
    opts = poptorch.Options().showCompilationProgressBar(False)
    opts.Training.gradientAccumulation(3)
    wrapper = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    request.addfinalizer(wrapper.destroy)
    printed = Recorded()
    logging.getLogger("pipetorch.print").addHandler(printed)
    try:
        wrapper.compile(torch.randn(6, 4), torch.randint(0, 2, (6,)))
    finally:
        logging.getLogger("pipetorch.print").removeHandler(printed)
    assert len(seen) == runs  # in this process: compiling's (the steps run in the workers)
    # The eager probe prints (real values); the capture runs on fake tensors and prints nothing.
    assert len(printed.records) == runs - 1


class Embedded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(10, 4), nn.Linear(4, 3)
        poptorch.BeginBlock(self.head, "head", ipu_id=1)

    def forward(self, ids, labels):
        return torch.nn.functional.cross_entropy(self.head(self.embed(ids)), labels)


@pytest.mark.parametrize("ids, labels, wrong", [
    ([1, 9], [0, 2], False),
    ([1, 9], [0, -100], False),  # cross_entropy's ignore_index
    ([1, 10], [0, 2], True),  # past the embedding table
    ([1, 9], [0, 3], True),  # a class the head does not have
    ([1, 9], [-1, 2], True),
])
def test_the_capture_shows_indices_a_real_kernel_would_refuse(ids, labels, wrong):
    from pipetorch.partition.suspects import suspect

    real = (torch.tensor([1, 2]), torch.tensor([0, 1]))
    _, traced = probe_by_export(Embedded(), real, {}, training=True)
    assert suspect(traced.module.graph, [torch.tensor(ids), torch.tensor(labels)]) is wrong


def test_the_capture_shows_an_integer_input_to_float_weights():
    from pipetorch.partition.suspects import suspect

    model = annotate(MatrixNet("last"), [0, 0, 1, 1])
    x, labels = make_data(model, 2, seed=0, dtype=torch.float32)
    _, fine = probe_by_export(model, (x, labels), {}, training=True)
    _, mixed = probe_by_export(model, (x.long(), labels), {}, training=True)
    assert not suspect(fine.module.graph, [x, labels])
    assert suspect(mixed.module.graph, [x.long(), labels])
