"""The rules a set of stages must follow: batching that feeds every stage, and the devices they need."""
from __future__ import annotations

import logging

from pipetorch import environment
from pipetorch.errors import ConfigError
from pipetorch.partition.strategies import StageSpec

__all__: list[str] = []

logger = logging.getLogger(__name__)


def min_gradient_accumulation(stages: int) -> int:
    """The fewest micro-batches a step of pipelined training over `stages` stages runs:
    each stage runs a forward and, later, a backward, so 2*stages-1 are in flight before
    the first one finishes."""
    return 2 * stages - 1


def check_batching(stages: list[StageSpec], *, pipelined: bool, training: bool,
                   gradient_accumulation: int, device_iterations: int) -> None:
    """Pipelines need enough micro-batches in flight to fill every stage."""
    n = len(stages)
    if not pipelined or n < 2:
        return
    if training and gradient_accumulation < min_gradient_accumulation(n):
        raise ConfigError(  # PopTorch's two sentences first, then the values and the fix
            "poptorch.Options().Training.gradientAccumulation must be greater than or equal to "
            f"the number of pipeline stages ({min_gradient_accumulation(n)}) when using poptorch.PipelinedExecution. "
            f"Please note that a model with {n} pipeline stages in PopTorch will have an "
            f"additional {n - 1} stages when training. gradientAccumulation "
            f"({gradient_accumulation}) must be >= 2*stages-1 ({min_gradient_accumulation(n)}) for pipelined "
            f"training with {n} stages: each stage runs a forward and, later, a backward, so the "
            "pipeline holds 2*stages-1 micro-batches before the first one finishes; raise "
            "opts.Training.gradientAccumulation or use ShardedExecution"
        )
    if not training and device_iterations < n:
        raise ConfigError(
            "poptorch.Options().deviceIterations must be greater than or equal to the number "
            f"of pipeline stages ({n}) when using poptorch.PipelinedExecution for inference: "
            f"deviceIterations ({device_iterations}) must be >= the number of stages ({n}) for "
            "pipelined inference, so that every stage has a micro-batch to work on; raise "
            "opts.deviceIterations or use ShardedExecution"
        )


def device_count(stages: list[StageSpec], *, replication_factor: int,
                 auto_round: bool) -> int:
    """Number of logical devices the run needs: devices per replica x replicas."""
    ipus = sorted({s.ipu_id for s in stages})
    needed = (max(ipus) + 1) * replication_factor
    limit = environment.get("max_devices")  # logical devices are processes: a typo's guard
    if needed & (needed - 1):
        if not auto_round:
            raise ConfigError(
                f"The model needs {needed} devices (ipus {ipus} x replicationFactor "
                f"{replication_factor}), which is not a power of two: use a power of two or "
                "call opts.autoRoundNumIPUs(True)"
            )
        rounded = 1 << (needed - 1).bit_length()
        logger.info("Rounding %d devices up to %d (autoRoundNumIPUs)", needed, rounded)
        needed = rounded
    if needed > limit:
        raise ConfigError(
            f"The model needs {needed} devices but at most {limit} are available; use fewer "
            "stages or replicas, or raise the limit with PIPETORCH_MAX_DEVICES"
        )
    return needed
