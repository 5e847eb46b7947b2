"""Every Options setter chains and reads back; defaults match the options contract."""
from __future__ import annotations

import pytest
import torch

import pipetorch as poptorch
from pipetorch.enums import (
    AutoStage, CommGroupType, ConnectionType, HalfFloatCastingBehavior, MeanReductionStrategy,
    OutputMode, ReductionType, SyncPattern,
)
from pipetorch.options import Options, TensorLocationSettings
from pipetorch.partition.strategies import PipelinedExecution, ShardedExecution

OFF_CHIP = TensorLocationSettings().useOnChipStorage(False)

# (group, setter, args, read-back attribute, expected value)
SETTERS = [
    ("", "deviceIterations", (4,), "device_iterations", 4),
    ("", "replicationFactor", (2,), "replication_factor", 2),
    ("", "outputMode", (OutputMode.All,), "output_mode", OutputMode.All),
    ("", "outputMode", (OutputMode.EveryN, 3), "output_return_period", 3),
    ("", "randomSeed", (7,), "random_seed", 7),
    ("", "enableSyntheticData", (True,), "enable_synthetic_data", True),
    ("", "enableExecutableCaching", ("/tmp/cache",), "executable_cache_dir", "/tmp/cache"),
    ("", "enableProfiling", ("reports",), "profiling_dir", "reports"),
    ("", "enableProfiling", (), "profiling_dir", "./"),
    ("", "logDir", ("logs",), "log_dir", "logs"),
    ("", "modelName", ("net",), "model_name", "net"),
    ("", "autoRoundNumIPUs", (True,), "auto_round_num_ipus", True),
    ("", "autoRoundNumIPUs", (), "auto_round_num_ipus", True),
    ("", "broadcastBuffers", (False,), "broadcast_buffers", False),
    ("", "showCompilationProgressBar", (False,), "show_compilation_progress_bar", False),
    ("", "relaxOptimizerAttributesChecks", (), "relax_optimizer_attributes_checks", True),
    ("", "useIpuModel", (True,), "use_ipu_model", True),
    ("", "useIpuId", (3,), "ipu_id", 3),
    ("", "useOfflineIpuTarget", (21,), "ipu_version", 21),
    ("", "useOfflineIpuTarget", (), "connection_type", ConnectionType.Never),
    ("", "connectionType", (ConnectionType.OnDemand,), "connection_type", ConnectionType.OnDemand),
    ("", "syncPattern", (SyncPattern.SinglePipeline,), "sync_pattern", SyncPattern.SinglePipeline),
    ("", "setAvailableMemoryProportion", ({"IPU0": 0.5, "IPU12": 1},),
     "available_memory_proportion", {"IPU0": 0.5, "IPU12": 1.0}),
    ("", "anchorTensor", ("g", "Gradient___x", OutputMode.EveryN, 2), "anchored_tensors",
     {"g": {"long_name": "Gradient___x", "output_mode": OutputMode.EveryN,
            "output_return_period": 2}}),
    ("", "enableStableNorm", (True,), "stable_norm", True),
    ("", "logCycleCount", (True,), "log_cycle_count", True),
    ("", "disableModuleNamescope", (), "module_namescope_enabled", False),
    ("", "sourceLocationExcludes", (["torch/nn"],), "source_location_excludes", ["torch/nn"]),
    ("", "appendToLocationExcludes", ("a", "b"), "source_location_excludes", ["a", "b"]),
    ("", "inputReplicaGrouping", (1, CommGroupType.Orthogonal), "input_group_type",
     CommGroupType.Orthogonal),
    ("Training", "gradientAccumulation", (5,), "gradient_accumulation", 5),
    ("Training", "accumulationAndReplicationReductionType", (ReductionType.Sum,),
     "accumulation_and_replication_reduction_type", ReductionType.Sum),
    ("Training", "setMeanAccumulationAndReplicationReductionStrategy",
     (MeanReductionStrategy.Running,), "mean_accumulation_and_replication_reduction_strategy",
     MeanReductionStrategy.Running),
    ("Training", "setAutomaticLossScaling", (True,), "auto_loss_scaling", True),
    ("Training", "setConvolutionDithering", (True,), "convolution_dithering", True),
    ("Distributed", "configureProcessId", (1, 4), "process_id", 1),
    ("Distributed", "configureProcessId", (1, 4), "numProcesses", 4),
    ("Distributed", "disable", (), "num_processes", 1),
    ("TensorLocations", "setOptimizerLocation", (OFF_CHIP,), "optimizer_location", OFF_CHIP),
    ("TensorLocations", "setWeightLocation", (OFF_CHIP,), "weight_location", OFF_CHIP),
    ("TensorLocations", "setActivationLocation", (OFF_CHIP,), "activation_location", OFF_CHIP),
    ("TensorLocations", "setAccumulatorLocation", (OFF_CHIP,), "accumulator_location", OFF_CHIP),
    ("TensorLocations", "numIOTiles", (64,), "num_io_tiles", 64),
    ("Precision", "setPartialsType", (torch.half,), "partials_type", torch.float16),
    ("Precision", "enableStochasticRounding", (True,), "stochastic_rounding", True),
    ("Precision", "enableFloatingPointExceptions", (True,), "floating_point_exceptions", True),
    ("Precision", "runningStatisticsAlwaysFloat", (False,), "running_statistics_always_float",
     False),
    ("Precision", "halfFloatCasting", (HalfFloatCastingBehavior.FloatDowncastToHalf,),
     "half_float_casting", HalfFloatCastingBehavior.FloatDowncastToHalf),
    ("Jit", "traceModel", (False,), "trace_model", False),
    ("_Popart", "set", ("autoRecomputation", 3), "options", {"autoRecomputation": 3}),
    ("_Popart", "setPatterns", ({"OpToIdentity": True}, 1), "options",
     {"patterns_level": 1, "patterns": {"OpToIdentity": True}}),
    ("_Popart", "setEngineOptions", ({"debug.x": "true"},), "options",
     {"engineOptions": {"debug.x": "true"}}),
]


@pytest.mark.parametrize("group, setter, args, attribute, expected", SETTERS,
                         ids=[f"{g}.{s}->{a}" for g, s, _, a, _ in SETTERS])
def test_setter_chains_and_reads_back(group, setter, args, attribute, expected):
    opts = Options()
    target = getattr(opts, group) if group else opts
    assert getattr(target, setter)(*args) is target
    assert getattr(target, attribute) == expected


def test_chain_of_core_setters():
    opts = poptorch.Options().deviceIterations(10).replicationFactor(2).randomSeed(0)
    assert (opts.device_iterations, opts.replication_factor, opts.random_seed) == (10, 2, 0)


def test_every_setter_has_a_docstring_and_ipu_knobs_say_no_op():
    groups = [Options(), TensorLocationSettings()]
    groups += [getattr(groups[0], name) for name in Options._SUBGROUPS]
    for group in groups:
        for name in group._setter_names():
            if name in Options._SUBGROUPS:
                continue
            assert getattr(type(group), name).__doc__, f"{type(group).__name__}.{name}"
    for name in ("useIpuModel", "syncPattern", "connectionType", "enableStableNorm",
                 "setAvailableMemoryProportion", "logCycleCount"):
        assert "(no-op here)" in getattr(Options, name).__doc__


def test_contract_defaults():
    opts = Options()
    assert (opts.device_iterations, opts.replication_factor) == (1, 1)
    assert (opts.output_mode, opts.output_return_period) == (OutputMode.Default, 1)
    assert opts.defaultOutputMode()
    assert opts.random_seed is None
    assert isinstance(opts.execution_strategy, PipelinedExecution)
    assert opts.execution_strategy.stages == AutoStage.SameAsIpu
    assert opts.enable_synthetic_data is False
    assert opts.executable_cache_dir is None and opts.profiling_dir is None
    assert opts.log_dir is None and opts.model_name is None
    assert opts.auto_round_num_ipus is False
    assert opts.broadcast_buffers is True and opts.show_compilation_progress_bar is True
    assert opts.available_memory_proportion == {}
    assert opts.input_replica_grouping == (1, CommGroupType.Consecutive)
    training = opts.Training
    assert training.gradient_accumulation == 1
    assert training.accumulation_and_replication_reduction_type == ReductionType.Mean
    assert training.mean_accumulation_and_replication_reduction_strategy == \
        MeanReductionStrategy.Post
    assert training.auto_loss_scaling is False
    assert (opts.Distributed.process_id, opts.Distributed.num_processes) == (0, 1)
    for kind in ("optimizer", "weight", "activation", "accumulator"):
        assert getattr(opts.TensorLocations, f"{kind}_location") is None
    assert TensorLocationSettings().use_on_chip_storage is None
    assert opts.Precision.partials_type == torch.float32
    assert opts.Precision.stochastic_rounding is False
    assert opts.Precision.floating_point_exceptions is False
    assert opts.Precision.half_float_casting == HalfFloatCastingBehavior.Default
    assert opts.Jit.trace_model is True
    assert opts._is_frozen is False


def test_input_replica_grouping_counts_distinct_input_streams():
    opts = Options().replicationFactor(8)
    assert opts.input_replica_grouping == (8, CommGroupType.Consecutive)
    opts.inputReplicaGrouping(2, CommGroupType.Orthogonal)
    assert (opts.input_group_size, opts.input_group_count) == (2, 4)
    assert opts.input_replica_grouping == (4, CommGroupType.Orthogonal)


def test_set_execution_strategy_reads_back_the_same_object():
    strategy = ShardedExecution("A", "B")
    opts = Options().setExecutionStrategy(strategy)
    assert opts.execution_strategy is strategy


def test_random_seed_seeds_torch():
    Options().randomSeed(123)
    first = torch.rand(3)
    torch.manual_seed(123)
    assert torch.equal(first, torch.rand(3))


def test_execution_caching_can_be_turned_off_again():
    opts = Options().enableExecutableCaching("/tmp/c").enableExecutableCaching(None)
    assert opts.executable_cache_dir is None


def test_tensor_location_settings_chain_and_read_back():
    settings = (TensorLocationSettings().useOnChipStorage(False).minElementsForOffChip(10)
                .minElementsForReplicatedTensorSharding(20).useReplicatedTensorSharding()
                .useIOTilesToLoad(False).useIOTilesToStore())
    assert settings.toDict() == {
        "use_on_chip_storage": False, "min_elements_for_off_chip": 10,
        "min_elements_for_replicated_tensor_sharding": 20,
        "use_replicated_tensor_sharding": True, "use_io_tiles_to_load": False,
        "use_io_tiles_to_store": True}
    assert settings.useOnChipStorage(None).use_on_chip_storage is None


def test_location_is_a_snapshot_of_the_settings_given():
    settings = TensorLocationSettings().useOnChipStorage(False)
    opts = Options()
    opts.TensorLocations.setOptimizerLocation(settings)
    settings.useOnChipStorage(True)
    assert opts.TensorLocations.optimizer_location.use_on_chip_storage is False


def test_read_back_containers_are_copies():
    opts = Options().setAvailableMemoryProportion({"IPU0": 0.5})
    opts.available_memory_proportion["IPU0"] = 5.0
    assert opts.available_memory_proportion == {"IPU0": 0.5}
