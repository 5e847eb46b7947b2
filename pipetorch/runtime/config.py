"""What compiling reads from the user's Options and the environment, resolved once at the
start of a compilation into frozen values: the layers below get their part, never Options;
and the wrapper's own frozen copy of the Options it reads them from."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipetorch import environment
from pipetorch.enums import HalfFloatCastingBehavior
from pipetorch.options import popart_names
from pipetorch.parallel.host.outputs import resolve_mode
from pipetorch.runtime.checks import check_inference_accumulation, check_return_periods
from pipetorch.schedule.plans import Batching
from pipetorch.planning import memory

if TYPE_CHECKING:
    from pipetorch.options import Options
    from pipetorch.partition.strategies import ExecutionStrategy

__all__: list[str] = []


@dataclass(frozen=True)
class RunConfig:
    """One compilation's settings (Options names in brackets)."""

    batching: Batching         # deviceIterations, gradientAccumulation, replicationFactor, ...
    strategy: ExecutionStrategy  # setExecutionStrategy
    schedule: str              # Training.pipelineSchedule
    recomputation: bool        # Training.recomputation (every stage's activations)
    offload: bool              # TensorLocations.setOptimizerLocation(useOnChipStorage(False))
    sharding: int | None       # ...(useReplicatedTensorSharding(True)): the minimum elements
    #                            of a weight whose state is sharded over replicas; None: off
    auto_loss_scaling: bool    # Training.setAutomaticLossScaling
    process: tuple[int, int]   # Distributed: this host process's id, and how many there are
    seed: int | None           # randomSeed
    auto_round: bool           # autoRoundNumIPUs
    broadcast_buffers: bool    # broadcastBuffers
    synthetic: bool            # enableSyntheticData
    progress_bar: bool         # showCompilationProgressBar
    balance_devices: int | None  # autoBalance (a pipetorch extension)
    memory_budget: int | dict[int, int] | None  # setMemoryBudget (a pipetorch extension)
    cache_dir: str | None      # enableExecutableCaching / POPTORCH_CACHE_DIR
    settings: dict[str, Any]   # every option, which the executable cache's key holds
    half_float_casting: HalfFloatCastingBehavior | None  # Precision.halfFloatCasting; None:
    #                            unset (partition.casting then casts only 16-bit models)
    compile_backend: str | None  # Jit.compileStages, else $PIPETORCH_COMPILE
    execution: str             # $PIPETORCH_EXECUTION
    across: bool = False       # Distributed.stagesAcrossProcesses: one pipeline, all processes


def run_config(options: Options) -> RunConfig:
    """`options` (and the PIPETORCH_* variables) as one compilation reads them."""
    training = options.Training
    chosen = options.Jit.compile_stages
    return RunConfig(
        batching=Batching(options.device_iterations, training.gradient_accumulation,
                          options.replication_factor,
                          training.accumulation_and_replication_reduction_type),
        strategy=options.execution_strategy, schedule=training.pipeline_schedule,
        recomputation=memory.recomputing(options), offload=memory.offloaded(options),
        sharding=memory.sharded_above(options),
        auto_loss_scaling=bool(training.auto_loss_scaling),
        process=(options.Distributed.process_id, options.Distributed.num_processes),
        seed=options.random_seed, auto_round=options.auto_round_num_ipus,
        broadcast_buffers=options.broadcast_buffers, synthetic=options.enable_synthetic_data,
        progress_bar=options.show_compilation_progress_bar,
        balance_devices=options.auto_balance_devices, memory_budget=options.memory_budget,
        cache_dir=options.executable_cache_dir, settings=options.toDict(),
        half_float_casting=(options.Precision.half_float_casting
                            if options.Precision._casting_chosen else None),
        compile_backend=chosen if chosen is not None else environment.get("compile"),
        execution=environment.get("execution"),
        across=options.Distributed.stages_across_processes)


def own_options(options: Options | None, *, training: bool) -> tuple[Options, Options]:
    """A wrapper's options: the user's (frozen, as in PopTorch) and the wrapper's own frozen
    copy, its output mode resolved, checked."""
    from pipetorch.options import Options

    options = Options() if options is None else options
    if not isinstance(options, Options):
        raise TypeError(f"options must be a pipetorch.Options, got {type(options).__name__}")
    popart_names.check(options._Popart.options)  # PopTorch checks them at compile
    options._freeze(by=f"poptorch.{'trainingModel' if training else 'inferenceModel'}")
    own = options.clone()
    mode = resolve_mode(own.output_mode, training=training)
    own.outputMode(mode, **({"output_return_period": own.output_return_period}
                            if mode.name == "EveryN" else {}))
    own._freeze()
    if not training:
        check_inference_accumulation(own)
    check_return_periods(own)
    return options, own
