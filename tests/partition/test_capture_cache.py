"""The executable cache: a saved capture is reused when nothing it depends on changed."""
from __future__ import annotations

import copy
import importlib.util
import logging
import sys

import pytest
import torch

import pipetorch as poptorch
from helpers.models import MnistNetwork, WithLoss, mnist_data
from pipetorch.partition import cache
from pipetorch.partition.probe import probe
from pipetorch.partition.split import CaptureOnce, split_stages
from pipetorch.partition.strategies import StageSpec

STAGES = [StageSpec(0, 0, ("B1", "B2")), StageSpec(1, 1, ("B3", "B4"))]


def model_and_batch(*, rows: int = 4, seed: int = 0):
    torch.manual_seed(seed)
    x, y = mnist_data(rows)
    return WithLoss(MnistNetwork()), ((x,), {"labels": y})


def capture(folder, model, first, options=None) -> CaptureOnce:
    """What compiling does: the stored entry when there is one, else probe, capture, store
    (in eval mode: these models need no loss)."""
    settings = options.toDict() if options is not None else None
    stored = cache.lookup(folder, model, *first, settings=settings)
    training = model.training  # probing for no loss (these models return none) sets eval
    found = stored.probe if stored else probe(model, *first, training=False)
    model.train(training)
    once = CaptureOnce(model, first, cache_dir=str(folder), settings=settings, probe=found,
                       stored=stored)
    once()
    once.save()
    return once


def test_a_hit_splits_into_the_same_stages_without_capturing(tmp_path, monkeypatch):
    model, first = model_and_batch()
    assert not capture(tmp_path, copy.deepcopy(model), first).from_cache
    monkeypatch.setattr("pipetorch.partition.split.capture",
                        lambda *a: pytest.fail("captured again instead of loading"))
    again = capture(tmp_path, model, first)
    assert again.from_cache
    staged = split_stages(model, *first, STAGES, traced=again())
    reference = copy.deepcopy(model)
    got, want = staged.run(*first[0], **first[1]), reference(*first[0], **first[1])
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    got[-1].backward()
    want[-1].backward()
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(p.grad, q.grad), name
    # The loaded graph runs the model's own weights, not copies saved with it.
    assert staged.modules[0].get_parameter("model.layer1.conv.weight") is \
        model.model.layer1.conv.weight


@pytest.mark.parametrize("change", ["input shape", "model code", "weights' shape", "option"])
def test_what_the_capture_depends_on_changing_misses(tmp_path, change):
    model, first = model_and_batch()
    options = poptorch.Options()
    capture(tmp_path, copy.deepcopy(model), first, options)
    if change == "input shape":
        _, first = model_and_batch(rows=6)
    elif change == "model code":
        model.train(False)  # the mode decides dropout and BatchNorm's branches
    elif change == "weights' shape":
        layer = model.model.layer4  # the same layer without its bias
        model.model.layer4 = torch.nn.Linear(layer.in_features, layer.out_features, bias=False)
    else:
        options = poptorch.Options().deviceIterations(2)
    assert not capture(tmp_path, model, first, options).from_cache
    assert len(list(tmp_path.glob("capture-*"))) == 2


EDITED = """
import torch
import pipetorch as poptorch


class Edited(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 2)

    def forward(self, x):
        with poptorch.Block("B1", ipu_id=0):
            x = torch.relu(self.a(x))
        with poptorch.Block("B2", ipu_id=1):
            return self.b(x){tail}
"""


def edited_model(path, tail: str, *, imported: bool, monkeypatch) -> torch.nn.Module:
    """The class `Edited` of a module file written with `tail` after its output, loaded anew:
    imported (its module in sys.modules, so its file is found) or only executed."""
    path.write_text(EDITED.format(tail=tail))
    spec = importlib.util.spec_from_file_location("edited_model", path)
    module = importlib.util.module_from_spec(spec)
    if imported:
        monkeypatch.setitem(sys.modules, "edited_model", module)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    return module.Edited()


@pytest.mark.parametrize("imported", [True, False], ids=["imported", "executed"])
def test_editing_the_code_of_a_model_class_misses(tmp_path, monkeypatch, imported):
    source, folder = tmp_path / "edited_model.py", tmp_path / "cache"
    first = ((torch.randn(3, 4),), {})

    def load(tail: str) -> torch.nn.Module:
        return edited_model(source, tail, imported=imported, monkeypatch=monkeypatch)

    assert not capture(folder, load(""), first).from_cache
    assert capture(folder, load(""), first).from_cache  # the same code: a hit
    model = load(" * 2")  # the same class name, weights and blocks; other code
    edited = capture(folder, model, first)
    assert not edited.from_cache
    assert len(list(folder.glob("capture-*"))) == 2
    with torch.no_grad():
        (got,) = edited().module(*first[0])  # the captured graph returns its flat outputs
        assert torch.equal(got, model(*first[0]))


@pytest.mark.parametrize("damage", ["truncated", "flipped byte", "foreign file"])
def test_a_corrupt_entry_is_captured_again_and_rewritten(tmp_path, caplog, damage):
    model, first = model_and_batch()
    capture(tmp_path, copy.deepcopy(model), first)
    (entry,) = tmp_path.glob("capture-*")
    data = entry.read_bytes()
    if damage == "truncated":
        entry.write_bytes(data[: len(data) // 2])
    elif damage == "flipped byte":
        entry.write_bytes(data[:-10] + bytes([data[-10] ^ 0xFF]) + data[-9:])
    else:  # a pickle that would run code if it were loaded unchecked
        entry.write_bytes(b"\x80\x04\x95" + data[3:])
    with caplog.at_level(logging.WARNING, logger="pipetorch.partition.cache"):
        assert not capture(tmp_path, model, first).from_cache
    assert "unusable" in caplog.text and "capturing again" in caplog.text
    assert capture(tmp_path, model, first).from_cache  # rewritten whole


def test_the_key_names_the_versions_and_ignores_where_files_go(tmp_path):
    model, first = model_and_batch()
    a = poptorch.Options().enableExecutableCaching(str(tmp_path / "a"))
    b = poptorch.Options().enableExecutableCaching(str(tmp_path / "b"))
    assert cache.capture_key(model, *first, a.toDict()) == \
        cache.capture_key(model, *first, b.toDict())


@pytest.mark.slow
def test_a_second_wrapper_of_the_same_model_compiles_from_the_cache(tmp_path, request,
                                                                   monkeypatch):
    model, (args, kwargs) = model_and_batch(rows=2 * 3 * 2)
    twin = copy.deepcopy(model)
    results, forwards = [], []
    for net in (model, twin):
        runs = []
        net.register_forward_pre_hook(lambda *_: runs.append(1))
        if net is twin:  # nothing is measured again: the entry holds the specs and footprints
            for name in ("pipetorch.parallel.host.build.value_specs",
                         "pipetorch.planning.estimate.staged_footprints"):
                monkeypatch.setattr(name, lambda *a, name=name, **k: pytest.fail(name))
        opts = poptorch.Options().enableExecutableCaching(str(tmp_path))
        opts.setMemoryBudget("8GiB")  # the estimate measures each stage's footprint
        opts.Training.gradientAccumulation(3)
        opts.setExecutionStrategy(poptorch.PipelinedExecution(
            poptorch.Stage("B1", "B2").ipu(0), poptorch.Stage("B3", "B4").ipu(1)))
        opts.outputMode(poptorch.OutputMode.All).deviceIterations(2)
        wrapper = poptorch.trainingModel(net, opts, torch.optim.SGD(net.parameters(), lr=0.1))
        request.addfinalizer(wrapper.destroy)
        results.append(wrapper(*args, **kwargs))
        forwards.append(len(runs))  # in this process: compiling's; the steps run in workers
        graph = wrapper._compiled.graph
        assert graph.from_cache is (net is twin)
    # A miss runs forward once (the capture, which the probe's findings come from); a hit zero
    # times before its first step.
    assert forwards == [1, 0]
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
