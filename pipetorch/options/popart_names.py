"""The names of PopART's session options (data) and the check PopTorch makes of
`opts._Popart.set(name, value)` when a model compiles.

The names are the fields of `struct SessionOptions` and of the settings structs nested in it,
read from graphcore/popart `willow/include/popart/sessionoptions.hpp` (commit 03934fe0ed9e),
plus `enableExplicitIR` (a SessionOptions method PopTorch accepts as an option),
`saveInitializersToFile` (PopTorch's own) and pipetorch's `patterns` / `patterns_level`
(what `_Popart.setPatterns` stores). pipetorch runs none of PopART: it keeps the values,
acts on "autoRecomputation" and the automatic loss scaling one, and refuses a name PopART
would refuse, or a value of a type PopTorch cannot pass to PopART.
"""
from __future__ import annotations

import difflib
from typing import AbstractSet, Mapping, Sequence, TypeAlias, Union

from pipetorch.errors import ConfigError

__all__ = ["SESSION_OPTIONS", "check", "passable"]

_TOP = """
logDir dotChecks firstDotOp finalDotOp dotOpNames exportPoplarComputationGraph
exportPoplarVertexGraph separateCallOpPdfs enableOutlining enableOutliningCopyCostPruning
outlineThreshold outlineSequenceBreakCost subgraphCopyingStrategy autoRecomputation
mergeVarUpdate mergeVarUpdateMemThreshold looseThresholdAtPeak rearrangeAnchorsOnHost
rearrangeStreamsOnHost enablePrefetchDatastreams defaultBufferingDepth
defaultPrefetchBufferingDepth bufferingDepthMap prefetchBufferingDepthMap
enableNonStableSoftmax enableReplicatedGraphs enableGradientAccumulation
accumulationAndReplicationReductionType meanAccumulationAndReplicationReductionStrategy
replicatedGraphCount accumulationFactor virtualGraphMode enablePipelining syntheticDataMode
instrumentWithHardwareCycleCounter hardwareInstrumentations
disableGradAccumulationTensorStreams disableOptimizerStateTensorStreams compileEngine
constantWeights enableEngineCaching cachePath enableFloatingPointChecks
enableStochasticRounding _enableRngStateManagement explicitRecomputation numIOTiles
aliasZeroCopy delayVarUpdates scheduleNonWeightUpdateGradientConsumersEarly
enableFullyConnectedPass enableSerializedMatmuls partialsTypeMatMuls enableStableNorm
engineOptions convolutionOptions lstmOptions matmulOptions reportOptions gclOptions
customCodelets customCodeletCompileFlags timeLimitScheduler swapLimitScheduler
serializedPoprithmsShiftGraphsDir kahnTieBreaker transitiveClosureOptimizationThreshold
decomposeGradSum enableDistributedReplicatedGraphs globalReplicationFactor
globalReplicaOffset groupHostSync strictOpVersions opxAliasChecking opxModifyChecking
useHostCopyOps enableLoadAndOffloadRNGState tensorLocationSettingsOverride
enableSupportedDataTypeCasting enableExplicitMainLoops groupNormStridedChannelGrouping
compilationProgressTotal enableMergeExchange ensureFp32LossScaleTensor
enableInplaceAmbiguityChecking createImplicitPipeliningFwdOnlyProgram
"""
_NESTED = {
    "automaticLossScalingSettings": "enabled binEdgeLocation thresholdUpperCountProportion "
                                    "toTrackTensors updatePeriod gradientTensorTrackingMethod",
    "replicatedCollectivesSettings": "prepareScheduleForMergingCollectives "
                                     "mergeAllReduceCollectives",
    "batchSerializationSettings": "factor concatOnVirtualGraphChange "
                                  "concatOnExecutionPhaseChange concatOnPipelineStageChange "
                                  "transformContext method batchSchedule",
    "executionPhaseSettings": "phases stages weightIOSchedule activationIOSchedule "
                              "optimizerStateIOSchedule accumulatorIOSchedule schedule",
    "accumulateOuterFragmentSettings": "schedule excludedVirtualGraphs",
    "autodiffSettings": "stitchStrategy",
    "developerSettings": "timePartitionLoggerThresholdPercentage",
    **{f"{kind}TensorLocationSettings": "location minElementsForOffChip "
                                       "minElementsForReplicatedTensorSharding"
       for kind in ("activation", "weight", "optimizerState", "accumulator")},
}
_EXTRA = "enableExplicitIR saveInitializersToFile patterns patterns_level"

#: Every name `opts._Popart.set` accepts.
SESSION_OPTIONS = frozenset(
    _TOP.split() + _EXTRA.split()
    + [f"{struct}.{field}" for struct, fields in _NESTED.items() for field in fields.split()])

_SCALARS = (bool, int, float, str)
_Scalar: TypeAlias = Union[bool, int, float, str]
#: What `opts._Popart.set` takes as a value: a bool, int, float or str, or a list (tuple), set
#: or dict of those (PopTorch refuses any other when the model compiles: `check`).
PopartValue: TypeAlias = Union[_Scalar, Sequence[_Scalar], AbstractSet[_Scalar],
                               Mapping[str, _Scalar]]
# PopTorch's words for the kind of value (its parser keeps one table per kind)
_KINDS = ((bool, "bool"), (int, "uint64"), (float, "double"), (str, "string"),
          ((list, tuple, set, frozenset), "container"), (dict, "map"))


def _kind(value: object) -> str | None:
    """PopTorch's kind of `value`, or None for a type it cannot pass to PopART."""
    if isinstance(value, dict):
        fits = all(isinstance(k, str) and isinstance(v, _SCALARS) for k, v in value.items())
        return "map" if fits else None
    if isinstance(value, (list, tuple, set, frozenset)):
        return "container" if all(isinstance(v, _SCALARS) for v in value) else None
    return next((kind for types, kind in _KINDS if isinstance(value, types)), None)


def passable(value: object) -> bool:
    """Whether PopTorch can pass `value` to PopART as an option's value."""
    return _kind(value) is not None


def check(options: Mapping[str, object]) -> None:
    """Raise ConfigError (a poptorch.Error) for the first name PopART does not have or value
    PopTorch cannot pass, in PopTorch's words followed by the fix."""
    for name, value in options.items():
        kind = _kind(value)
        if kind is None:
            raise ConfigError(
                f"Unknown value type {type(value).__name__} for option {name}: "
                "opts._Popart.set takes a bool, int, float or str, or a list, set or dict of "
                f"those; got {value!r}")
        if name not in SESSION_OPTIONS:
            close = difflib.get_close_matches(name, sorted(SESSION_OPTIONS), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ConfigError(
                f"Unknown {kind} option {name}: it is not one of PopART's session options "
                f"(pipetorch.options.popart_names.SESSION_OPTIONS){hint}")
