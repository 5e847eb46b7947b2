"""Balancing real runs: an unbalanced CNN's report proposes a move, its balanced placement
trains equal to plain PyTorch with even stages; a model of Block scopes balanced by
pipetorch.balance and by opts.autoBalance; a small BERT balanced over 4 devices."""
import time
import warnings

import pytest
import torch
import torch.nn as nn

import pipetorch as poptorch
from helpers.models import HeavyLastBlocks
from parallel.parallel_cases import (assert_in_processes, assert_same_result, assert_same_state,
                                     cleaned, one_thread_everywhere, plain_call, twin)
from pipetorch.cli.report import show_report
from pipetorch.partition.balance import evaluate
from pipetorch.partition.candidates import candidates
from pipetorch.planning.costs import cost_table
from pipetorch.profiling.recorder import Profiler, load
from pipetorch.profiling.rebalance import stage_compute

pytestmark = pytest.mark.slow

D, G, MICRO = 1, 3, 8


@pytest.fixture(autouse=True)
def _one_thread(request, monkeypatch):
    one_thread_everywhere(request, monkeypatch)


class UnevenCNN(nn.Module):
    """A narrow first block and three wide ones; the loss is in the last block."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 32, 3, padding=1),
            nn.Conv2d(32, 32, 3, padding=1),
            nn.Sequential(nn.Conv2d(32, 32, 3, padding=1), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(32, 10)))
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, labels):
        out = self.layers(torch.relu(x))
        return out, self.loss(out, labels)


def uneven(blocks_on_device_0: int) -> UnevenCNN:
    torch.manual_seed(0)
    model = UnevenCNN()
    for k, layer in enumerate(model.layers):
        poptorch.BeginBlock(layer, f"B{k}", ipu_id=0 if k < blocks_on_device_0 else 1)
    return model


def batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    n = D * G * MICRO
    return torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)


def profiled_training(model, directory, calls: int):
    """Train `model` pipelined for `calls` calls while recording a report; return outputs."""
    opts = poptorch.Options().deviceIterations(D).showCompilationProgressBar(False)
    opts.outputMode(poptorch.OutputMode.All)
    opts.Training.gradientAccumulation(G)
    opts.setExecutionStrategy(poptorch.PipelinedExecution(poptorch.AutoStage.SameAsIpu))
    wrapper = poptorch.trainingModel(model, opts,
                                     optimizer=torch.optim.SGD(model.parameters(), lr=0.01))
    x, y = batch(0)
    wrapper.compile(x, y)
    profiler = Profiler(directory, wrapper._compiled, training=True, options=wrapper.options,
                        sample=((x[:MICRO], y[:MICRO]), {}))
    outputs = []
    try:
        for call in range(calls):
            x, y = batch(call)
            start = time.monotonic_ns()
            outputs.append(wrapper(x, y))
            profiler.record_call(start, time.monotonic_ns(), len(x))
        profiler.write()
        return wrapper, outputs
    finally:
        wrapper.destroy()


def test_unbalanced_report_proposes_a_move_and_the_balanced_split_trains_evenly(tmp_path):
    # Deliberately unbalanced: one narrow block on device 0, three wide ones on device 1.
    natural = uneven(1)
    profiled_training(natural, tmp_path / "natural", calls=2)
    text = show_report(tmp_path / "natural")
    assert "stage 1 is the bottleneck" in text
    assert "Move block 'B1' from stage 1 to stage 0 (ipu_id=0)" in text

    model = uneven(1)
    sample = tuple(t[:MICRO] for t in batch(0))
    table = cost_table(model, candidates(model), sample)
    placement = poptorch.balance(model, *sample, devices=2)
    before = evaluate(table, (0, 1))
    assert placement.starts != (0, 1)
    # both from one measurement (balance() timed its own: under load the two differ by 20%)
    assert evaluate(table, placement.starts).bottleneck_seconds < before.bottleneck_seconds
    assert [s.segments[0] for s in placement.stages][0] == "layers.0"
    assert "poptorch.BeginBlock(model.layers[" in placement.begin_block_lines()[1]

    plain = twin(model)
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.01)
    wrapper, outputs = profiled_training(model, tmp_path / "balanced", calls=3)
    for call, got in enumerate(outputs):
        want = plain_call(plain, plain_optimizer, batch(call), D=D, G=G)
        assert_same_result(got, want, what=f"balanced call {call}")
    assert_same_state(wrapper.model, plain, what="balanced: ")

    balanced = stage_compute(load(tmp_path / "balanced")[0])
    unbalanced = stage_compute(load(tmp_path / "natural")[0])
    spread, before = max(balanced) / min(balanced), max(unbalanced) / min(unbalanced)
    if spread > 1.15 or spread >= before:  # timing on a shared host: reported, never a failure
        warnings.warn(f"balanced stages measured {balanced} ms, {spread:.2f}x apart (target "
                      f"1.15x; the natural split was {before:.2f}x)")


def scoped_batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    n = D * G * MICRO
    return torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g)


def scoped_options():
    opts = poptorch.Options().deviceIterations(D).showCompilationProgressBar(False)
    opts.outputMode(poptorch.OutputMode.All)
    opts.Training.gradientAccumulation(G)
    return opts


def train_scoped_like_plain(request, model, opts, *, calls: int = 3):
    """Train `model` under `opts` against a plain-PyTorch twin; return the wrapper."""
    plain = twin(model)
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.05)
    wrapper = cleaned(request, poptorch.trainingModel(
        model, opts, optimizer=torch.optim.SGD(model.parameters(), lr=0.05)))
    for call in range(calls):
        got = wrapper(*scoped_batch(call))
        want = plain_call(plain, plain_optimizer, scoped_batch(call), D=D, G=G)
        assert_same_result(got, want, what=f"scoped call {call}")
    assert_same_state(wrapper.model, plain, what="scoped: ")
    return wrapper


def test_block_scopes_balanced_over_two_devices_train_equal_to_plain(request):
    torch.manual_seed(0)
    model = HeavyLastBlocks()
    opts = scoped_options()
    sample = tuple(t[:MICRO] for t in scoped_batch(0))
    placement = poptorch.balance(model, *sample, devices=2, options=opts)
    assert [s.segments for s in placement.stages] == [("L1", "L2", "L3"), ("Heavy",)]
    wrapper = train_scoped_like_plain(request, model, opts)
    assert [s.block_ids for s in wrapper._compiled.stages] == [("L1", "L2", "L3"), ("Heavy",)]
    assert_in_processes(wrapper, 2)


def test_auto_balance_of_block_scopes_trains_equal_to_plain(request):
    # The scopes carry no ipu_id: without the balanced strategy AutoStage.SameAsIpu refuses.
    torch.manual_seed(0)
    model = HeavyLastBlocks()
    opts = scoped_options().autoBalance(2)
    wrapper = train_scoped_like_plain(request, model, opts)
    assert [(s.ipu_id, s.block_ids) for s in wrapper._compiled.stages] == [
        (0, ("L1", "L2", "L3")), (1, ("Heavy",))]
    assert_in_processes(wrapper, 2)


@pytest.mark.transformers
def test_bert_over_four_devices_groups_embeddings_and_layers_and_trains_equal(request):
    """pipetorch.balance's placement, and opts.autoBalance training equal to plain PyTorch."""
    from models.hf_cases import bert_config, plain_call as hf_plain_call, qa_inputs
    from models.hf_cases import twin as hf_twin
    transformers = pytest.importorskip("transformers")

    torch.manual_seed(0)
    model = transformers.BertForQuestionAnswering(bert_config())
    placement = poptorch.balance(model, sample_kwargs=qa_inputs(2, 0), devices=4, apply=False)
    names = [n for s in placement.stages for n in s.segments]
    assert names == ["bert.embeddings", *(f"bert.encoder.layer.{i}" for i in range(4)),
                     "qa_outputs"]
    assert placement.stages[0].segments[0] == "bert.embeddings"
    assert len(placement.stages) == 4

    plain = hf_twin(model)
    Gb, Db, Bb = 7, 2, 2
    opts = poptorch.Options().deviceIterations(Db).showCompilationProgressBar(False)
    opts.outputMode(poptorch.OutputMode.All)
    opts.Training.gradientAccumulation(Gb)
    opts.setExecutionStrategy(poptorch.PipelinedExecution(poptorch.AutoStage.SameAsIpu))
    opts.autoBalance(4)  # balanced again inside compile, on the first micro-batch
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)  # noqa: E731
    wrapper = cleaned(request, poptorch.trainingModel(model, opts, optimizer=sgd(model)))
    plain_optimizer = sgd(plain)
    for call in range(2):
        inputs = qa_inputs(Db * Gb * Bb, call)
        got = wrapper(**inputs)
        want = hf_plain_call(plain, plain_optimizer, inputs, D=Db, G=Gb, B=Bb)
        for g, w in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
            torch.testing.assert_close(g.as_subclass(torch.Tensor), w, msg=f"bert call {call}")
    assert len(wrapper._compiled.engine.worker_pids) >= 4
    assert len(wrapper._compiled.stages) == 4
    assert_same_state(wrapper.model, plain, what="bert: ")
