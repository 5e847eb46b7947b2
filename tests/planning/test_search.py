"""plan(..., search=True) and `pipetorch plan --search`: every layout of the devices planned,
those that fit ranked by step time, the others with their reasons, the fastest as code."""
import copy
import json
import os

import pytest
import torch
import torch.nn as nn
from torch.testing import assert_close

import pipetorch as poptorch
from helpers.reference import plain_train_call
from pipetorch.parallel.layout import placement
from pipetorch.planning.search import Layout, layouts, python_path

WIDTH, BATCH = 64, 4


class Stack(nn.Module):
    """Identical layers (six) between an input layer and a head that returns the loss."""

    def __init__(self, layers=6):
        super().__init__()
        self.embed = nn.Linear(8, WIDTH)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.ReLU(),
                                                  nn.Linear(4 * WIDTH, WIDTH))
                                    for _ in range(layers))
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x, labels):
        h = self.embed(x)
        for layer in self.layers:
            h = h + layer(h)
        out = self.head(h)
        return out, nn.functional.cross_entropy(out, labels)


def inputs():
    return (torch.randn(BATCH, 8), torch.randint(0, 3, (BATCH,))), {}


def search(layers=6, **kwargs):
    torch.manual_seed(0)
    return poptorch.plan(Stack(layers), inputs(), devices=2, flops=1e9, search=True, **kwargs)


def test_every_layout_keeps_the_samples_per_step_and_saves_memory_cheapest_first():
    found = layouts(4, 8)
    shapes = {(w[0].stages, w[0].replicas, w[0].schedule) for w in found}
    assert shapes == {(4, 1, "1f1b"), (4, 1, "zero_bubble"), (8, 1, "interleaved"),
                      (2, 2, "1f1b"), (2, 2, "zero_bubble"), (4, 2, "interleaved"),
                      (1, 4, "none")}
    # interleaved: two stages on each device of the pipeline
    assert {w[0].devices * w[0].replicas for w in found} == {4}
    for ways in found:
        assert {w.accumulation * w.replicas for w in ways} == {8}
        assert ways[0].state == "whole" and not ways[0].recompute  # the cheapest first
        assert [w.recompute for w in ways] == sorted(w.recompute for w in ways)
        assert ("sharded" in {w.state for w in ways}) == (ways[0].replicas > 1)
    assert {(w[0].devices, w[0].replicas) for w in layouts(4, 6)} == {(4, 1), (2, 2)}  # 6 / 4


def test_the_layouts_that_fit_are_ranked_by_step_time_with_distinct_shapes():
    found = search()
    assert found.fitting and not found.refused  # no budget: every layout fits
    seconds = [c.plan.step_seconds for c in found.fitting]
    assert seconds == sorted(seconds)
    assert {(c.layout.stages, c.layout.replicas, c.layout.schedule) for c in found.fitting} == {
        (2, 1, "1f1b"), (2, 1, "zero_bubble"), (4, 1, "interleaved"), (1, 2, "none")}
    # with no budget the cheapest way is kept: nothing sharded, offloaded or recomputed
    assert all(c.layout.state == "whole" and not c.layout.recompute for c in found.fitting)
    data = found.to_json()
    assert [e["rank"] for e in data["layouts"]] == [1, 2, 3, 4]
    assert data["layouts"][0]["step_seconds"] == seconds[0] and data["code"] == found.code()
    assert "1 stage x 2 replicas" in found.table()
    # each layout's own lines, by rank (benchmarks/search_check.py runs the top 3's)
    codes = [found.code(rank) for rank in range(1, 5)]
    assert codes[0] == found.code() and found.code(5) == found.code(0) == []
    for code, considered in zip(codes, found.fitting, strict=True):
        layout = considered.layout
        assert sum("BeginBlock" in line for line in code) == layout.stages - 1, code
        assert ("opts.replicationFactor(2)" in code) == (layout.replicas == 2), code
        assert (f'opts.Training.pipelineSchedule("{layout.schedule}")' in code) == (
            layout.schedule in ("zero_bubble", "interleaved")), code


def tight_budget(layers=6):
    """Just under the least one device holding the whole model needs (its optimiser state
    offloaded, recomputing), and so under two stages' peak with nothing saved."""
    torch.manual_seed(0)
    least = poptorch.plan(Stack(layers), inputs(), devices=2, replicas=2, flops=1e9,
                          accumulation=2, offload=True, recompute=True)
    return max(least.peaks.values()) - 1


def test_a_budget_refuses_with_the_reason_and_saves_memory_the_cheapest_way():
    budget = tight_budget()
    found = search(device_memory=budget, accumulation=4)
    assert found.fitting and {c.layout.stages for c in found.fitting} == {2}
    for c in found.fitting:  # the whole state does not fit; offloading it is enough
        assert c.layout.state == "offloaded" and not c.layout.recompute
        assert max(c.plan.peaks.values()) <= budget
    interleaved, alone = found.refused
    assert interleaved.plan is None and "G 4 is below 7" in interleaved.reason
    # one stage, every way tried: the last one says by how much
    assert alone.layout.stages == 1 and alone.layout.recompute
    assert alone.layout.state == "offloaded" and "over the" in alone.reason
    assert max(alone.plan.peaks.values()) > budget


def test_the_fastest_layouts_lines_run_and_train():
    found = search(device_memory=tight_budget(), accumulation=4)
    best = found.fitting[0]
    lines = found.code()
    assert "opts.Training.gradientAccumulation(4)" in lines
    assert any("useOnChipStorage(False)" in line for line in lines)
    assert any("poptorch.BeginBlock(model.layers[" in line for line in lines)
    torch.manual_seed(0)
    model = Stack()
    scope = {"model": model, "poptorch": poptorch}
    exec("\n".join(lines), scope)
    opts = scope["opts"]
    opts.showCompilationProgressBar(False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    training = poptorch.trainingModel(model, opts, optimizer=optimizer)
    try:
        x, labels = torch.randn(4 * BATCH, 8), torch.randint(0, 3, (4 * BATCH,))
        _, loss = training(x, labels)
        assert torch.isfinite(loss).all()
        workers = [r for r in placement.live_workers() if r["host_pid"] == os.getpid()]
        assert len(workers) == best.layout.stages == 2
    finally:
        training.destroy()


def test_an_interleaved_layouts_lines_run_it_interleaved_and_train_as_plain_pytorch():
    # eight equal layers on two devices: interleaving halves the ramp, the fastest that fits
    found = search(layers=8, device_memory=tight_budget(8), accumulation=8)
    best = found.fitting[0]
    assert (best.layout.schedule, best.layout.stages, best.layout.devices) == (
        "interleaved", 4, 2)
    assert best.layout.describe().startswith("4 stages on 2 devices x 1 replica, interleaved")
    lines = found.code()
    assert 'opts.Training.pipelineSchedule("interleaved")' in lines
    blocks = [line for line in lines if "BeginBlock" in line]
    assert [line.split("ipu_id=")[1] for line in blocks] == ["1)", "0)", "1)"]
    torch.manual_seed(0)
    model = Stack(8)
    plain = copy.deepcopy(model)
    scope = {"model": model, "poptorch": poptorch}
    exec("\n".join(lines), scope)
    opts = scope["opts"]
    opts.showCompilationProgressBar(False)
    training = poptorch.trainingModel(model, opts, optimizer=torch.optim.SGD(
        model.parameters(), lr=0.1, momentum=0.9))
    try:
        x, labels = torch.randn(8 * BATCH, 8), torch.randint(0, 3, (8 * BATCH,))
        _, loss = training(x, labels)
        assert [s.ipu_id for s in training._compiled.stages] == [0, 1, 0, 1]
        spans = {t.stage: t.spans for t in training._compiled.engine.last_trace}
        # interleaved: device 0 runs stage 2's first forward before stage 0's last one
        assert (next(s.start for s in spans[2] if s.kind == "F")
                < [s.start for s in spans[0] if s.kind == "F"][-1])
        rows = plain_train_call(plain, torch.optim.SGD(plain.parameters(), lr=0.1,
                                                       momentum=0.9), x, labels, D=1, G=8, R=1)
        assert_close(loss, rows[-1][3])
        for got, want in zip(training.model.parameters(), plain.parameters(), strict=True):
            assert_close(got, want)
    finally:
        training.destroy()


def test_a_modules_name_becomes_the_python_that_reaches_it():
    assert python_path("transformer.h.6") == "model.transformer.h[6]"
    assert python_path("model.layers.40.mlp") == "model.model.layers[40].mlp"
    assert python_path("blocks.first-half") == "model.blocks['first-half']"
    assert Layout(2, 1, "1f1b", "offloaded", True, 8).describe() == (
        "2 stages x 1 replica, 1f1b, G 8, optimiser state offloaded, recomputation")
    assert Layout(8, 2, "interleaved", "sharded", False, 8).describe() == (
        "8 stages on 4 devices x 2 replicas, interleaved, G 8, optimiser state sharded")


@pytest.mark.parametrize("kwargs, message", [
    (dict(replicas=2), "chooses the replicas"),
    (dict(split=["layers.3"]), "leave them out"),
    (dict(flops=None), "give flops"),
])
def test_a_search_refuses_what_it_chooses_itself_and_needs_a_rate(kwargs, message):
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=message):
        poptorch.plan(Stack(), inputs(), devices=2, search=True, **{"flops": 1e9, **kwargs})


def test_the_command_lists_the_search_as_json_and_refuses_its_choices(tmp_path, monkeypatch,
                                                                    capsys):
    from pipetorch.cli.main import main

    (tmp_path / "search_net.py").write_text(
        "import torch\nfrom test_search import Stack, inputs\n"
        "def net(micro_batch):\n    torch.manual_seed(0)\n    return Stack(), inputs()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(os.path.dirname(__file__))
    assert main(["plan", "search_net:net", "--devices-per-machine", "2", "--flops", "1G",
                 "--search", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [e["rank"] for e in data["layouts"]] == [1, 2, 3, 4] and data["code"]
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "search_net:net", "--devices-per-machine", "2", "--flops", "1G",
              "--search", "--sharded"])
    assert exit_.value.code == 2
    assert "--search chooses --sharded itself" in capsys.readouterr().err
