"""Every setter refuses wrong types (TypeError) and bad values (ValueError) with a clear message."""
from __future__ import annotations

import re

import pytest
import torch

from pipetorch.enums import CommGroupType, OutputMode, ReductionType
from pipetorch.errors import ConfigError
from pipetorch.options import Options, TensorLocationSettings

# (group, setter, args, error type, text the message must contain: setter, value, accepted)
BAD_CALLS = [
    ("", "deviceIterations", ("4",), TypeError,
     "deviceIterations: device_iterations must be an int >= 1; got '4' (str)"),
    ("", "deviceIterations", (0,), ValueError,
     "deviceIterations: device_iterations must be an int >= 1; got 0 (int)"),
    ("", "deviceIterations", (True,), TypeError, "an int >= 1; got True (bool)"),
    ("", "replicationFactor", (2.0,), TypeError,
     "replicationFactor: replication_factor must be an int >= 1; got 2.0"),
    ("", "replicationFactor", (-1,), ValueError,
     "replicationFactor: replication_factor must be an int >= 1; got -1"),
    ("", "outputMode", (2,), TypeError,
     "outputMode: output_mode must be one of OutputMode.Final, OutputMode.EveryN, OutputMode.All,"
     " OutputMode.Sum, OutputMode.Default; got 2 (int)"),
    ("", "outputMode", (OutputMode.EveryN,), ValueError,
     "OutputMode.EveryN needs output_return_period, a positive int"),
    ("", "outputMode", (OutputMode.EveryN, 0), ValueError,
     "outputMode: output_return_period must be an int >= 1; got 0"),
    # outputMode(OutputMode.All, 2) warns and ignores the period, as PopTorch does (tests/compat)
    ("", "randomSeed", (1.5,), TypeError, "randomSeed: random_seed must be an int >= 0"),
    ("", "randomSeed", (-1,), ValueError,
     "randomSeed: random_seed must be an int >= 0 and <= 18446744073709551615; got -1"),
    ("", "setExecutionStrategy", ("pipelined",), TypeError,
     "setExecutionStrategy: strategy must be a PipelinedExecution, ShardedExecution"),
    ("", "enableSyntheticData", (1,), TypeError,
     "enableSyntheticData: enabled must be True or False; got 1 (int)"),
    ("", "enableExecutableCaching", (3,), TypeError,
     "enableExecutableCaching: path must be a non-empty path (str or os.PathLike) or None; got 3"),
    ("", "enableExecutableCaching", ("",), ValueError,
     "enableExecutableCaching: path must be a non-empty path"),
    ("", "enableProfiling", (["d"],), TypeError,
     "enableProfiling: profile_dir must be a non-empty path"),
    ("", "logDir", (None,), TypeError,
     "logDir: log_dir must be a non-empty path (str or os.PathLike); got None"),
    ("", "modelName", ("",), ValueError, "modelName: name must be a non-empty str; got ''"),
    ("", "modelName", (5,), TypeError, "modelName: name must be a non-empty str; got 5"),
    ("", "autoRoundNumIPUs", ("yes",), TypeError,
     "autoRoundNumIPUs: auto_round_num_ipus must be True or False; got 'yes'"),
    ("", "broadcastBuffers", (0,), TypeError,
     "broadcastBuffers: broadcast_buffers must be True or False"),
    ("", "showCompilationProgressBar", (None,), TypeError,
     "showCompilationProgressBar: show must be True or False"),
    ("", "relaxOptimizerAttributesChecks", ("x",), TypeError,
     "relaxOptimizerAttributesChecks: relax must be True or False"),
    ("", "useIpuModel", (1,), TypeError, "useIpuModel: use_model must be True or False"),
    ("", "useIpuId", (-2,), ValueError, "useIpuId: ipu_id must be an int >= 0; got -2"),
    ("", "useOfflineIpuTarget", (3,), ValueError,
     "useOfflineIpuTarget: ipu_version must be one of 1 (Mk1), 2 (Mk2), 21 (Bow); got 3"),
    ("", "connectionType", ("Always",), TypeError,
     "connectionType: connection_type must be one of ConnectionType.Always,"
     " ConnectionType.OnDemand, ConnectionType.Never; got 'Always'"),
    ("", "syncPattern", (0,), TypeError,
     "syncPattern: sync_pattern must be one of SyncPattern.Full"),
    ("", "setAvailableMemoryProportion", (0.5,), TypeError,
     'setAvailableMemoryProportion: available_memory_proportion must be a dict such as {"IPU0":'
     ' 0.5}; got 0.5'),
    ("", "setAvailableMemoryProportion", ({"GPU0": 0.5},), ValueError,
     "setAvailableMemoryProportion: every key must be \"IPU<n>\" where n is the IPU index, e.g."
     " \"IPU0\"; got 'GPU0'"),
    ("", "setAvailableMemoryProportion", ({"IPU0": 0},), ValueError,
     "setAvailableMemoryProportion: available_memory_proportion['IPU0'] must be a number in (0,"
     " 1]; got 0"),
    ("", "setAvailableMemoryProportion", ({"IPU1": 1.5},), ValueError,
     "must be a number in (0, 1]; got 1.5"),
    ("", "setAvailableMemoryProportion", ({"IPU1": "0.5"},), TypeError,
     "must be a number in (0, 1]; got '0.5' (str)"),
    ("", "anchorTensor", ("a", 3), TypeError,
     "anchorTensor: long_name must be a non-empty str; got 3"),
    ("", "anchorTensor", ("a", "b", "All"), TypeError,
     "anchorTensor: output_mode must be one of OutputMode"),
    ("", "anchorTensor", ("a", "b", OutputMode.EveryN, 0), ValueError,
     "anchorTensor: output_return_period must be an int >= 1; got 0"),
    ("", "enableStableNorm", ("on",), TypeError, "enableStableNorm: enabled must be True or False"),
    ("", "logCycleCount", (1,), TypeError, "logCycleCount: log_cycle_count must be True or False"),
    ("", "sourceLocationExcludes", ("torch",), TypeError,
     "sourceLocationExcludes: excludes must be a list of str; got 'torch'"),
    ("", "sourceLocationExcludes", ([1],), TypeError,
     "sourceLocationExcludes: every item of excludes must be a str; got 1"),
    ("", "appendToLocationExcludes", ("a", 2), TypeError,
     "appendToLocationExcludes: every item of excludes must be a str; got 2"),
    ("", "inputReplicaGrouping", (0, CommGroupType.Consecutive), ValueError,
     "inputReplicaGrouping: input_group_size must be an int >= 1; got 0"),
    ("", "inputReplicaGrouping", (2, CommGroupType.All), ValueError,
     "inputReplicaGrouping: input_group_type must be one of CommGroupType.Consecutive,"
     " CommGroupType.Orthogonal, CommGroupType.NoGrouping; got <CommGroupType.All: 0>"),
    ("", "inputReplicaGrouping", (2, "Consecutive"), TypeError,
     "inputReplicaGrouping: input_group_type must be one of"),
    ("", "inputReplicaGrouping", (2, CommGroupType.NoGrouping), ValueError,
     "input_group_size must be 1 with CommGroupType.NoGrouping; got 2"),
    ("Training", "gradientAccumulation", (0,), ValueError,
     "gradientAccumulation: gradient_accumulation must be an int >= 1; got 0"),
    ("Training", "gradientAccumulation", ("2",), TypeError,
     "gradientAccumulation: gradient_accumulation must be an int >= 1; got '2'"),
    ("Training", "accumulationAndReplicationReductionType", (ReductionType.NoReduction,),
     ValueError,
     "accumulationAndReplicationReductionType: reduction_type must be one of ReductionType.Mean,"
     " ReductionType.Sum; got <ReductionType.NoReduction: 2>"),
    ("Training", "accumulationAndReplicationReductionType", ("Mean",), TypeError,
     "reduction_type must be one of ReductionType.Mean, ReductionType.Sum"),
    ("Training", "setMeanAccumulationAndReplicationReductionStrategy", (1,), TypeError,
     "setMeanAccumulationAndReplicationReductionStrategy: mean_reduction_strategy must be one of"
     " MeanReductionStrategy.Running"),
    ("Training", "setAutomaticLossScaling", (1,), TypeError,
     "setAutomaticLossScaling: enabled must be True or False"),
    ("Training", "setConvolutionDithering", (None,), TypeError,
     "setConvolutionDithering: enabled must be True or False"),
    ("Distributed", "configureProcessId", (2, 2), ValueError,
     "configureProcessId: process_id must be < num_processes (2); got 2"),
    ("Distributed", "configureProcessId", (-1, 2), ValueError,
     "configureProcessId: process_id must be an int >= 0; got -1"),
    ("Distributed", "configureProcessId", (0, 0), ValueError,
     "configureProcessId: num_processes must be an int >= 1; got 0"),
    ("Distributed", "configureProcessId", ("0", 2), TypeError,
     "configureProcessId: process_id must be an int >= 0; got '0'"),
    ("Distributed", "setEnvVarNames", ("", "RANK"), ValueError,
     "setEnvVarNames: var_num_processes must be a non-empty str; got ''"),
    ("Distributed", "setEnvVarNames", ("SIZE", 3), TypeError,
     "setEnvVarNames: var_process_id must be a non-empty str; got 3"),
    ("TensorLocations", "setOptimizerLocation", (False,), TypeError,
     "setOptimizerLocation: location must be a poptorch.TensorLocationSettings, e.g."
     " TensorLocationSettings().useOnChipStorage(False); got False"),
    ("TensorLocations", "setWeightLocation", ({},), TypeError,
     "setWeightLocation: location must be a poptorch.TensorLocationSettings"),
    ("TensorLocations", "setActivationLocation", (None,), TypeError,
     "setActivationLocation: location must be"),
    ("TensorLocations", "setAccumulatorLocation", (1,), TypeError,
     "setAccumulatorLocation: location must be"),
    ("TensorLocations", "numIOTiles", (16,), ValueError,
     "numIOTiles must be an even number between 32 and 192. Got 16"),
    ("TensorLocations", "numIOTiles", (33,), ValueError,
     "numIOTiles must be an even number between 32 and 192. Got 33"),
    ("Precision", "setPartialsType", (torch.bfloat16,), ValueError,
     "setPartialsType: dtype must be one of torch.float32, torch.float16; got torch.bfloat16"),
    ("Precision", "setPartialsType", ("half",), TypeError,
     "setPartialsType: dtype must be one of torch.float32, torch.float16; got 'half'"),
    ("Precision", "enableStochasticRounding", (1,), TypeError,
     "enableStochasticRounding: enabled must be True or False"),
    ("Precision", "enableFloatingPointExceptions", ("no",), TypeError,
     "enableFloatingPointExceptions: enabled must be True or False"),
    ("Precision", "runningStatisticsAlwaysFloat", (None,), TypeError,
     "runningStatisticsAlwaysFloat: value must be True or False"),
    ("Precision", "halfFloatCasting", (torch.float16,), TypeError,
     "halfFloatCasting: half_float_casting must be one of HalfFloatCastingBehavior."),
    ("Jit", "traceModel", (0,), TypeError, "traceModel: trace_model must be True or False; got 0"),
    ("_Popart", "set", (3, 1), TypeError, "_Popart.set: key must be a non-empty str; got 3"),
    ("_Popart", "setPatterns", ({"P": 1},), TypeError,
     "_Popart.setPatterns: patterns['P'] must be True or False; got 1"),
    ("_Popart", "setPatterns", ([],), TypeError, "_Popart.setPatterns: patterns must be a dict"),
    ("_Popart", "setEngineOptions", ({"a": 1},), TypeError,
     "_Popart.setEngineOptions: engine_options must be a dict of str -> str"),
]


@pytest.mark.parametrize("group, setter, args, error, message", BAD_CALLS,
                         ids=[f"{g}.{s}{a!r}" for g, s, a, _, _ in BAD_CALLS])
def test_bad_value_is_refused_with_a_clear_message(group, setter, args, error, message):
    opts = Options()
    target = getattr(opts, group) if group else opts
    before = opts.toDict()
    with pytest.raises(error, match=re.escape(message)):
        getattr(target, setter)(*args)
    assert opts.toDict() == before  # a refused value changes nothing


@pytest.mark.parametrize("setter, args, message", [
    ("useOnChipStorage", ("no",), "useOnChipStorage: use must be True or False; got 'no'"),
    ("minElementsForOffChip", (-1,), "minElementsForOffChip: min_elements must be an int >= 0"),
    ("minElementsForReplicatedTensorSharding", (1.0,),
     "minElementsForReplicatedTensorSharding: min_elements must be an int >= 0; got 1.0"),
    ("useReplicatedTensorSharding", (1,), "useReplicatedTensorSharding: use must be True or False"),
    ("useIOTilesToLoad", (None,), "useIOTilesToLoad: use must be True or False"),
    ("useIOTilesToStore", ("y",), "useIOTilesToStore: use must be True or False"),
])
def test_tensor_location_settings_validate(setter, args, message):
    with pytest.raises((TypeError, ValueError), match=re.escape(message)):
        getattr(TensorLocationSettings(), setter)(*args)


def test_numpy_style_integers_are_accepted():
    import numpy as np
    assert Options().deviceIterations(np.int64(3)).device_iterations == 3


def test_unknown_attribute_lists_valid_setters_and_suggests():
    opts = Options()
    with pytest.raises(AttributeError, match=r"Options has no option 'deviceIteration'\. "
                       r"Did you mean deviceIterations.*Valid setters: .*replicationFactor"):
        opts.deviceIteration(4)
    with pytest.raises(AttributeError, match=r"Options.Training has no option 'gradAccum'.*"
                       r"Valid setters: .*gradientAccumulation"):
        opts.Training.gradAccum(2)


def test_assigning_attributes_is_refused():
    opts = Options()
    with pytest.raises(AttributeError, match=r"Cannot assign Options.device_iterations: options"
                       r" are set by calling setters, not by assignment\. "
                       r"Did you mean deviceIterations"):
        opts.device_iterations = 4
    with pytest.raises(AttributeError, match=r"Cannot assign Options.Training.foo"):
        opts.Training.foo = 1
    assert opts.device_iterations == 1


def test_inconsistent_input_grouping_is_refused_at_freeze():
    opts = Options().replicationFactor(4).inputReplicaGrouping(3, CommGroupType.Consecutive)
    with pytest.raises(ConfigError, match=r"replicationFactor \(4\) must be a multiple of the "
                       r"input group size \(3\)"):
        opts._freeze()
