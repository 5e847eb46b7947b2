"""compile_model: capture, partition, plan; the engine starts from the plan, and the model is
copied or moved at most once on the way."""
import pytest
import torch
import torch.nn as nn

import pipetorch as poptorch
from helpers.models import ReluStages
from pipetorch.parallel.host.engine import ProcessEngine
from pipetorch.parallel.host.local import LocalEngine

G = 3


def compile_counting_moves(monkeypatch, request, strategy):
    """A ReluStages training wrapper after its first call, and how often a ReluStages was
    moved (`nn.Module.to`, which a private copy's `weights.device_copy` calls too)."""
    moves = []
    to = nn.Module.to

    def counted(self, *args, **kwargs):
        if isinstance(self, ReluStages):
            moves.append(args)
        return to(self, *args, **kwargs)

    torch.manual_seed(0)
    net = ReluStages()
    opts = poptorch.Options().showCompilationProgressBar(False)
    opts.Training.gradientAccumulation(G)
    opts.setExecutionStrategy(strategy)
    wrapper = poptorch.trainingModel(net, opts, torch.optim.SGD(net.parameters(), lr=0.1))
    request.addfinalizer(wrapper.destroy)
    with monkeypatch.context() as patch:
        patch.setattr(nn.Module, "to", counted)
        wrapper(torch.randn(G * 2, 6))
    return net, wrapper, len(moves)


@pytest.mark.slow
def test_a_split_model_is_its_own_host_copy_and_its_engine_starts_from_the_plan(
        monkeypatch, request):
    # compile_model moved the model twice on this path (to the CPU before the capture, then to
    # the host device), both no-ops that read as if the host copy were another model
    strategy = poptorch.PipelinedExecution(poptorch.Stage("A").ipu(0), poptorch.Stage("B").ipu(1))
    net, wrapper, moves = compile_counting_moves(monkeypatch, request, strategy)
    compiled, engine = wrapper._compiled, wrapper._compiled.engine
    plan = compiled.plan
    assert moves == 0 and isinstance(engine, ProcessEngine) and engine.model is net
    assert engine.plan is plan and plan.graphs is not None and plan.graphs.staged is engine.staged
    assert plan.placements == tuple(engine.placements) and plan.owners == engine.owners == (0, 1)
    assert plan.schedule == engine.schedule == "pipelined" and plan.devices == 2
    assert [s.block_ids for s in plan.stages] == [("A",), ("B",)]


def test_one_device_gets_one_private_copy(monkeypatch, request):
    strategy = poptorch.PipelinedExecution(poptorch.Stage("A", "B").ipu(0))
    net, wrapper, moves = compile_counting_moves(monkeypatch, request, strategy)
    plan, engine = wrapper._compiled.plan, wrapper._compiled.engine
    assert moves == 1 and isinstance(engine, LocalEngine) and engine.model is not net
    assert plan.local and plan.placements == () and plan.graphs is None and plan.devices == 1


@pytest.mark.slow
def test_blocks_entered_only_in_forward_move_the_copy_to_the_host_once(monkeypatch, request):
    # No BeginBlock declares the second device: the copy is made for one device, and moved to
    # the CPU for the workers once forward has shown both blocks.
    strategy = poptorch.PipelinedExecution(poptorch.AutoStage.AutoIncrement)
    net, wrapper, moves = compile_counting_moves(monkeypatch, request, strategy)
    plan, engine = wrapper._compiled.plan, wrapper._compiled.engine
    assert moves == 2 and isinstance(engine, ProcessEngine) and engine.model is not net
    assert not plan.local and plan.owners == (0, 1)
    assert all(p.device == torch.device("cpu") for p in engine.model.parameters())
