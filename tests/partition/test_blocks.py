"""Blocks, stages and strategies: what they record and every validation error."""
import pytest
import torch
import torch.nn as nn

import pipetorch as poptorch
from pipetorch.errors import ConfigError
from pipetorch.partition import blocks, stage_rules
from pipetorch.partition.blocks import BlockInfo
from pipetorch.partition.strategies import StageSpec


def run_recorded(fn):
    with blocks.recording() as rec:
        fn()
    return rec.ordered()


def test_block_scopes_are_recorded_in_order():
    def forward():
        with poptorch.Block("B1"):
            pass
        with poptorch.Block("B2", ipu_id=1):
            pass
        with poptorch.Block("B1"):  # same id again: still one block
            pass
    assert run_recorded(forward) == [BlockInfo("B1", None, 0), BlockInfo("B2", 1, 1)]


def test_auto_ids_and_block_start():
    def forward():
        poptorch.Block.useAutoId()
        with poptorch.Block(ipu_id=0):
            pass
        with poptorch.Block(ipu_id=1):
            pass
        poptorch.Block.start("tail", ipu_id=2)
    assert [(b.user_id, b.ipu_id) for b in run_recorded(forward)] == [("0", 0), ("1", 1), ("tail", 2)]


def test_begin_block_hook_and_remove_blocks():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    assert poptorch.BeginBlock(model[1], "second", ipu_id=1) is model[1]
    with blocks.recording() as rec:
        model(torch.ones(1, 2))
    assert rec.ordered() == [BlockInfo("second", 1, 0)]
    assert blocks.begin_blocks(model) == {"1": ("second", 1)}
    poptorch.removeBlocks(model)
    with blocks.recording() as rec:
        model(torch.ones(1, 2))
    assert rec.ordered() == []


def test_begin_block_twice_is_an_error():
    layer = poptorch.BeginBlock(nn.Linear(2, 2), "B1", ipu_id=0)
    with pytest.raises(ValueError, match="already begins block 'B1'.*removeBlocks"):
        poptorch.BeginBlock(layer, "B2", ipu_id=1)


def test_block_function_decorator():
    @poptorch.BlockFunction("fn", ipu_id=3)
    def f(x):
        return x + 1
    with blocks.recording() as rec:
        assert f(1) == 2
    assert rec.ordered() == [BlockInfo("fn", 3, 0)]


def test_block_outside_capture_does_nothing():
    with poptorch.Block("B1"):
        x = torch.ones(1) + 1
    assert x.item() == 2


B = [BlockInfo("B1", 0, 0), BlockInfo("B2", 0, 1), BlockInfo("B3", 1, 2), BlockInfo("B4", 1, 3)]


def test_same_as_ipu_groups_consecutive_blocks():
    stages = poptorch.PipelinedExecution().resolve(B)
    assert stages == [StageSpec(0, 0, ("B1", "B2")), StageSpec(1, 1, ("B3", "B4"))]


def test_auto_increment_gives_a_stage_per_block():
    stages = poptorch.ShardedExecution(poptorch.AutoStage.AutoIncrement).resolve(B)
    assert [s.block_ids for s in stages] == [("B1",), ("B2",), ("B3",), ("B4",)]


def test_explicit_stages_and_block_id_shorthand():
    s = poptorch.PipelinedExecution(poptorch.Stage("B1", "B2").ipu(0), poptorch.Stage("B3", "B4").ipu(1))
    assert s.resolve(B) == [StageSpec(0, 0, ("B1", "B2")), StageSpec(1, 1, ("B3", "B4"))]
    assert [x.ipu_id for x in poptorch.PipelinedExecution("B1", "B2", "B3", "B4").resolve(B)] == [0, 1, 2, 3]


def test_phased_strategies_run_their_stages_sharded():
    s = poptorch.SerialPhasedExecution(poptorch.Phase("B1", "B2"), poptorch.Phase("B3", "B4"))
    assert not s.pipelined and len(s.resolve(B)) == 4
    assert isinstance(poptorch.ParallelPhasedExecution(poptorch.Phase(poptorch.Stage("B1"))),
                      poptorch.ShardedExecution)


def test_unknown_block_lists_the_known_ones():
    with pytest.raises(ConfigError, match=r"Unknown block 'B9'.*\['B1', 'B2', 'B3', 'B4'\]"):
        poptorch.PipelinedExecution(poptorch.Stage("B1", "B9")).resolve(B)


def test_block_in_two_stages():
    with pytest.raises(ConfigError, match="'B2' is in stage 0 and in stage 1"):
        poptorch.PipelinedExecution(poptorch.Stage("B1", "B2"), poptorch.Stage("B2", "B3", "B4")).resolve(B)


def test_stages_must_follow_model_order():
    with pytest.raises(ConfigError, match="stages must follow the model's order"):
        poptorch.PipelinedExecution(poptorch.Stage("B3", "B4"), poptorch.Stage("B1", "B2")).resolve(B)


def test_unassigned_block():
    with pytest.raises(ConfigError, match=r"Blocks \['B4'\] are not in any Stage"):
        poptorch.PipelinedExecution(poptorch.Stage("B1", "B2", "B3")).resolve(B)


def test_same_as_ipu_needs_ipu_ids():
    named = [BlockInfo("B1", None, 0), BlockInfo("B2", 1, 1)]
    with pytest.raises(ConfigError, match=r"blocks \['B1'\] have no ipu_id"):
        poptorch.PipelinedExecution(poptorch.AutoStage.SameAsIpu).resolve(named)


def test_mixed_strategy_arguments_are_a_type_error():
    with pytest.raises(TypeError, match="not a mix"):
        poptorch.PipelinedExecution(poptorch.Stage("B1"), "B2")


def test_pipelined_training_needs_enough_accumulation():
    stages = [StageSpec(i, i, (f"B{i}",)) for i in range(4)]
    with pytest.raises(ConfigError, match=r"gradientAccumulation \(3\) must be >= 2\*stages-1 \(7\).*4 stages"):
        stage_rules.check_batching(stages, pipelined=True, training=True, gradient_accumulation=3, device_iterations=1)
    stage_rules.check_batching(stages, pipelined=False, training=True, gradient_accumulation=3, device_iterations=1)


def test_pipelined_inference_needs_enough_iterations():
    stages = [StageSpec(i, i, (f"B{i}",)) for i in range(2)]
    with pytest.raises(ConfigError, match=r"deviceIterations \(1\) must be >= the number of stages \(2\)"):
        stage_rules.check_batching(stages, pipelined=True, training=False, gradient_accumulation=1, device_iterations=1)


def test_device_count_power_of_two_and_limit(monkeypatch):
    three = [StageSpec(i, i, (str(i),)) for i in range(3)]
    with pytest.raises(ConfigError, match=r"needs 3 devices.*autoRoundNumIPUs"):
        stage_rules.device_count(three, replication_factor=1, auto_round=False)
    assert stage_rules.device_count(three, replication_factor=1, auto_round=True) == 4
    monkeypatch.setenv("PIPETORCH_MAX_DEVICES", "4")
    with pytest.raises(ConfigError, match=r"needs 8 devices but at most 4.*PIPETORCH_MAX_DEVICES"):
        stage_rules.device_count(three[:2], replication_factor=4, auto_round=False)


def test_ops_before_a_begin_block_on_ipu_1_run_on_ipu_0():
    # Seed 002's BeginBlock(model.layer3[8], ipu_id=1): the stem and earlier layers stay on ipu 0.
    stages = poptorch.PipelinedExecution().resolve([BlockInfo("late", 1, 0)], preamble=True)
    assert stages == [StageSpec(0, 0, ()), StageSpec(1, 1, ("late",))]
    assert poptorch.PipelinedExecution().resolve([BlockInfo("B", 0, 0)], preamble=True) == [StageSpec(0, 0, ("B",))]
