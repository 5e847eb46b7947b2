"""The small option groups: Options.Training, .Precision, .Jit and ._Popart."""
from __future__ import annotations

from typing import Any

import torch

from pipetorch.enums import HalfFloatCastingBehavior, MeanReductionStrategy, ReductionType
from pipetorch.options import _validate as check
from pipetorch.options._group import OptionGroup, readback
from pipetorch.options import popart_names

__all__ = ["_TrainingOptions", "_PrecisionOptions", "_JitOptions", "_PopartOptions"]


#: The PopART option PopTorch's Training.setAutomaticLossScaling sets.
AUTO_LOSS_SCALING_KEY = "automaticLossScalingSettings.enabled"


class _TrainingOptions(OptionGroup):
    """Options of training models: `opts.Training.gradientAccumulation(4)`."""

    _LABEL = "Options.Training"
    _strategy_chosen = False
    _DEFAULTS = {
        "gradient_accumulation": 1,
        "accumulation_and_replication_reduction_type": ReductionType.Mean,
        "mean_accumulation_and_replication_reduction_strategy": MeanReductionStrategy.Post,
        "auto_loss_scaling": False,
        "convolution_dithering": False,
        "recomputation": False,
        "pipeline_schedule": "1f1b",
    }

    gradient_accumulation = readback(
        "gradient_accumulation", "Micro-batches per replica whose gradients make one step (G).")
    accumulation_and_replication_reduction_type = readback(
        "accumulation_and_replication_reduction_type",
        "How gradients are reduced over accumulation steps and replicas (Mean or Sum).")
    mean_accumulation_and_replication_reduction_strategy = readback(
        "mean_accumulation_and_replication_reduction_strategy",
        "When the mean is taken (numerically equal here).")
    @property
    def meanAccumulationAndReplicationReductionStrategy(self) -> MeanReductionStrategy:
        """The strategy in use (PopTorch's attribute). A wrapped training model with float16
        accumulators (`accum_type=torch.float16`, no combined accumulators) uses Running,
        even over a strategy set by the user; anything else keeps the one set, or Post, as
        PopTorch decides at compile (setOptimizer cannot change it afterwards)."""
        return self._values["mean_accumulation_and_replication_reduction_strategy"]

    auto_loss_scaling = readback("auto_loss_scaling", "Whether automatic loss scaling is on.")
    convolution_dithering = readback(
        "convolution_dithering", "Whether convolution dithering was requested (no-op here).")
    pipeline_schedule = readback(
        "pipeline_schedule", "The training schedule of pipelined execution: 1f1b, zero_bubble, "
        "interleaved, interleaved_zero_bubble or auto.")
    recomputation = readback(
        "recomputation", "Whether every stage's activations are recomputed in backward.")

    def gradientAccumulation(self, gradient_accumulation: int) -> _TrainingOptions:
        """Number of micro-batches to accumulate before each optimiser step (default 1).

        Each micro-batch is one `batch_size` batch of the DataLoader; one step therefore sees
        `gradient_accumulation` x replicas micro-batches. Pipelined training with S stages
        needs at least 2*S-1.
        """
        self._set(gradient_accumulation=check.integer(
            "gradientAccumulation", "gradient_accumulation", gradient_accumulation, minimum=1))
        return self

    def accumulationAndReplicationReductionType(
            self, reduction_type: ReductionType) -> _TrainingOptions:
        """Reduce gradients over accumulation steps and replicas by `Mean` (default) or `Sum`."""
        self._set(accumulation_and_replication_reduction_type=check.enum_member(
            "accumulationAndReplicationReductionType", "reduction_type", reduction_type,
            ReductionType, allowed=(ReductionType.Mean, ReductionType.Sum)))
        return self

    def setMeanAccumulationAndReplicationReductionStrategy(
            self, mean_reduction_strategy: MeanReductionStrategy) -> _TrainingOptions:
        """When to divide by the number of micro-batches for a Mean reduction.

        `Running`, `Post` (default) or `PostAndLoss`; all give the same numbers here because
        gradients are accumulated in the parameter dtype.
        """
        self._set(mean_accumulation_and_replication_reduction_strategy=check.enum_member(
            "setMeanAccumulationAndReplicationReductionStrategy", "mean_reduction_strategy",
            mean_reduction_strategy, MeanReductionStrategy))
        self._strategy_chosen = True  # else a training wrapper picks it, as PopTorch does
        return self

    def setAutomaticLossScaling(self, enabled: bool) -> _TrainingOptions:
        """Adjust the optimiser's loss scaling automatically when gradients overflow.

        As in PopTorch, it reads back as the PopART option
        `opts._Popart.options["automaticLossScalingSettings.enabled"]`, and setting that
        option with `opts._Popart.set` calls this."""
        self._set(auto_loss_scaling=check.boolean("setAutomaticLossScaling", "enabled", enabled))
        popart = getattr(self, "_popart", None)
        if popart is not None:
            popart._values["options"][AUTO_LOSS_SCALING_KEY] = enabled
        return self

    def setConvolutionDithering(self, enabled: bool) -> _TrainingOptions:
        """Spread convolutions over different tiles (no-op here)."""
        self._set(convolution_dithering=check.boolean(
            "setConvolutionDithering", "enabled", enabled))
        return self

    def setRecomputation(self, enabled: bool) -> _TrainingOptions:
        """Recompute each stage's activations in backward instead of keeping them (default off).

        A pipetorch extension: every stage's forward runs under activation checkpointing, so
        a stage keeps only its inputs for each micro-batch in flight and reruns its forward
        (same dropout masks) before its backward. Results are identical; memory drops, compute
        grows by about one forward. PopTorch's spelling
        `opts._Popart.set("autoRecomputation", 3)` (RecomputationType.Pipeline) sets it too.
        """
        self._set(recomputation=check.boolean("setRecomputation", "enabled", enabled))
        return self

    def pipelineSchedule(self, schedule: str) -> _TrainingOptions:
        """How PipelinedExecution trains: "1f1b" (default), "zero_bubble", "interleaved",
        "interleaved_zero_bubble" or "auto".

        A pipetorch extension (PopTorch's pipeline is fixed). "zero_bubble" is ZB-H1: each
        stage's backward sends its input's gradient upstream first and computes its weights'
        gradients later, in what would be idle time (the trace shows those as W spans); a
        stage then holds up to S micro-batches' activations, 1F1B's first stage's most.
        "interleaved" is interleaved 1F1B (Narayanan et al. 2021) for stages placed
        round-robin over the devices, several each (four blocks on ipus 0,1,0,1): a device
        takes rounds of (devices) micro-batches through each of its stages in turn, cutting
        1F1B's ramp by the stages per device; "interleaved_zero_bubble" also splits the
        backwards. Other placements, or G not a multiple of G // devices, run 1F1B (ZB-H1).
        "auto" simulates each that applies on the stages' devices and takes the shortest, the
        simpler on a tie, first with balanced stages whose split backward costs 1.2x a whole
        one (measured on a CNN on CPU), then again from the first call's measured forward and
        backward times; the report prints the choice and its predicted bubble. Every schedule
        trains to the same numbers. Inference and sharded execution are unaffected, and a
        stage that recomputes its activations or runs compiled keeps its backward whole.
        """
        name = check.text("pipelineSchedule", "schedule", schedule)
        if name not in _SCHEDULES:
            raise check.value_error("pipelineSchedule", "schedule", name,
                                    "one of " + ", ".join(repr(s) for s in _SCHEDULES))
        self._set(pipeline_schedule=name)
        return self


_SCHEDULES = ("1f1b", "zero_bubble", "interleaved", "interleaved_zero_bubble", "auto")


class _PrecisionOptions(OptionGroup):
    """Options of numerical precision: `opts.Precision.setPartialsType(torch.half)`."""

    _LABEL = "Options.Precision"
    _casting_chosen = False
    _DEFAULTS = {
        "half_float_casting": HalfFloatCastingBehavior.Default,
        "partials_type": torch.float32,
        "stochastic_rounding": False,
        "floating_point_exceptions": False,
        "running_statistics_always_float": True,
    }

    partials_type = readback(
        "partials_type", "dtype of matmul/convolution partial results (no-op here).")
    stochastic_rounding = readback(
        "stochastic_rounding", "Whether stochastic rounding was requested (no-op here).")
    floating_point_exceptions = readback(
        "floating_point_exceptions", "Whether FP exceptions were requested (no-op here).")
    half_float_casting = readback(
        "half_float_casting", "Which dtype an op mixing float16 and float32 operands casts to.")
    running_statistics_always_float = readback(
        "running_statistics_always_float",
        "Whether BatchNorm running statistics are kept in float32 (no-op here).")

    def setPartialsType(self, dtype: torch.dtype) -> _PrecisionOptions:
        """dtype of the partial results of matmuls and convolutions (no-op here).

        Must be `torch.float` (default) or `torch.half`.
        """
        self._set(partials_type=check.dtype(
            "setPartialsType", "dtype", dtype, (torch.float32, torch.float16)))
        return self

    def enableStochasticRounding(self, enabled: bool) -> _PrecisionOptions:
        """Round float16 results stochastically on the IPU (no-op here)."""
        self._set(stochastic_rounding=check.boolean(
            "enableStochasticRounding", "enabled", enabled))
        return self

    def enableFloatingPointExceptions(self, enabled: bool) -> _PrecisionOptions:
        """Raise on IPU floating point exceptions (no-op here)."""
        self._set(floating_point_exceptions=check.boolean(
            "enableFloatingPointExceptions", "enabled", enabled))
        return self

    def halfFloatCasting(self, half_float_casting: HalfFloatCastingBehavior
                         ) -> _PrecisionOptions:
        """How an op in forward whose operands mix float16 (or bfloat16) and float32 casts them.

        `Default` and `HalfUpcastToFloat` cast every operand to float32 (PyTorch's rule,
        also for the ops PyTorch refuses, such as a float32 input to a float16 `nn.Linear`);
        `FloatDowncastToHalf` casts every operand to the 16-bit dtype. In-place ops keep
        the output's dtype. The casts run only for models with a 16-bit parameter, buffer or
        input, or once this option is set.
        """
        self._set(half_float_casting=check.enum_member(
            "halfFloatCasting", "half_float_casting", half_float_casting,
            HalfFloatCastingBehavior))
        self._casting_chosen = True
        return self

    def runningStatisticsAlwaysFloat(self, value: bool) -> _PrecisionOptions:
        """Keep BatchNorm running mean/variance in float32 for half models (no-op here)."""
        self._set(running_statistics_always_float=check.boolean(
            "runningStatisticsAlwaysFloat", "value", value))
        return self


class _JitOptions(OptionGroup):
    """Options of model capture: `opts.Jit.traceModel(False)`."""

    _LABEL = "Options.Jit"
    _DEFAULTS = {"trace_model": True, "compile_stages": None}

    trace_model = readback("trace_model", "Whether the model is captured by tracing.")
    compile_stages = readback(
        "compile_stages", "The torch.compile backend stages run through, or None (eager).")

    def traceModel(self, trace_model: bool) -> _JitOptions:
        """Capture the model with torch.jit tracing (True, default) or the dispatcher (False).

        Both capture the same graph here (no-op here).
        """
        self._set(trace_model=check.boolean("traceModel", "trace_model", trace_model))
        return self

    def compileStages(self, enabled: bool = True, *, backend: str = "inductor") -> _JitOptions:
        """Run each stage's forward and backward through `torch.compile(backend=...)`
        (pipetorch extension; PIPETORCH_COMPILE=1 or =BACKEND does the same)."""
        enabled = check.boolean("compileStages", "enabled", enabled)
        if not isinstance(backend, str) or not backend:
            raise TypeError(f"compileStages: backend must be a torch.compile backend name such "
                            f"as 'inductor' or 'aot_eager', got {backend!r}")
        self._set(compile_stages=backend if enabled else None)
        return self


# popart.RecomputationType: None, Standard, NormOnly, Pipeline, RecomputeAll.
_RECOMPUTATION_TYPES = ("None", "Standard", "NormOnly", "Pipeline", "RecomputeAll")


class _PopartOptions(OptionGroup):
    """Raw PopART session options, any key (no-op here): `opts._Popart.set("key", 3)`."""

    _LABEL = "Options._Popart"
    _DEFAULTS = {"options": {}}

    options = readback("options", "Every PopART option set so far, by key.")

    def __init__(self, *, training: _TrainingOptions | None = None) -> None:
        super().__init__()
        self._training = training  # where "autoRecomputation" and ALS take effect
        if training is not None:
            training._popart = self

    def set(self, key: str, value: popart_names.PopartValue) -> _PopartOptions:
        """Set PopART session option `key` to `value` (no-op here, but two keys).

        `value` must be a bool, int, float, str, or a list/set/dict of those, and `key` one of
        PopART's session options (`popart_names`): as PopTorch, both are checked when a model
        compiles (or by `poptorch_core._validateOptions`), not here. The keys acted on are
        "autoRecomputation" (an int of popart.RecomputationType): any type but None (0) turns
        on Training.setRecomputation, None turns it off; and automatic loss scaling's.
        """
        key = check.text("_Popart.set", "key", key)
        self._check_not_frozen()
        if key == "autoRecomputation":
            self._set_recomputation(value)
        if key == AUTO_LOSS_SCALING_KEY and self._training is not None:
            self._training.setAutomaticLossScaling(
                check.boolean("setAutomaticLossScaling", "enabled", value))
        self._values["options"][key] = value
        return self

    def toDict(self) -> dict[str, Any]:
        out = super().toDict()
        # A value PopTorch cannot pass to PopART stays itself (not its repr), so that
        # poptorch_core._validateOptions(opts.toDict()) names its type as PopTorch does.
        out["options"].update({k: v for k, v in self._values["options"].items()
                               if not popart_names.passable(v)})
        return out

    def _set_recomputation(self, value: popart_names.PopartValue) -> None:
        kinds = ", ".join(f"{i} ({name})" for i, name in enumerate(_RECOMPUTATION_TYPES))
        if isinstance(value, bool) or not isinstance(value, int) \
                or not 0 <= value < len(_RECOMPUTATION_TYPES):
            raise ValueError(
                f"_Popart.set: autoRecomputation must be an int of popart.RecomputationType, "
                f"one of {kinds}, not {value!r}; e.g. "
                "opts._Popart.set(\"autoRecomputation\", 3), or use "
                "opts.Training.setRecomputation(True)")
        if self._training is not None:
            self._training.setRecomputation(value != 0)

    def setPatterns(self, patterns: dict[str, bool], level: int = 2) -> _PopartOptions:
        """Enable/disable PopART graph patterns by name, from `level`'s defaults (no-op here)."""
        if not isinstance(patterns, dict):
            raise check.type_error("_Popart.setPatterns", "patterns", patterns,
                                   "a dict of pattern name (str) -> bool")
        for name, enabled in patterns.items():
            check.text("_Popart.setPatterns", "a pattern name", name)
            check.boolean("_Popart.setPatterns", f"patterns[{name!r}]", enabled)
        level = check.integer("_Popart.setPatterns", "level", level, minimum=0)
        return self.set("patterns_level", level).set("patterns", dict(patterns))

    def setEngineOptions(self, engine_options: dict[str, str]) -> _PopartOptions:
        """Poplar engine options, str -> str; use enableProfiling for reports (no-op here)."""
        if not isinstance(engine_options, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in engine_options.items()):
            raise check.type_error("_Popart.setEngineOptions", "engine_options",
                                   engine_options, "a dict of str -> str")
        return self.set("engineOptions", dict(engine_options))
