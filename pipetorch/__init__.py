"""pipetorch: PopTorch's programming model on CPUs and GPUs (`import pipetorch as poptorch`)."""
from __future__ import annotations

import importlib
from typing import Any

from pipetorch import environment as _environment
from pipetorch.enums import (
    AutoStage, CommGroupType, ConnectionType, DataLoaderMode, HalfFloatCastingBehavior, Liveness,
    MeanReductionStrategy, OutputMode, OverlapMode, ReductionType, SharingStrategy, SyncPattern,
)
from pipetorch.errors import Error
from pipetorch.version import __version__ as __version__

# Public name -> module that defines it. Modules load on first use, so `import pipetorch`
# stays cheap in worker processes that only need the runtime.
_LAZY = {
    "Options": "pipetorch.options",
    "TensorLocationSettings": "pipetorch.options",
    "Block": "pipetorch.partition.blocks",
    "BeginBlock": "pipetorch.partition.blocks",
    "BlockFunction": "pipetorch.partition.blocks",
    "removeBlocks": "pipetorch.partition.blocks",
    "balance": "pipetorch.planning.balancing",
    "plan": "pipetorch.planning.plan",
    "Stage": "pipetorch.partition.strategies",
    "Phase": "pipetorch.partition.strategies",
    "PipelinedExecution": "pipetorch.partition.strategies",
    "ShardedExecution": "pipetorch.partition.strategies",
    "SerialPhasedExecution": "pipetorch.partition.strategies",
    "ParallelPhasedExecution": "pipetorch.partition.strategies",
    "identity_loss": "pipetorch.ops",
    "recomputationCheckpoint": "pipetorch.ops",
    "ipu_print_tensor": "pipetorch.ops",
    "set_available_memory": "pipetorch.ops",
    "nop": "pipetorch.ops",
    "for_loop": "pipetorch.ops",
    "cond": "pipetorch.ops",
    "isRunningOnIpu": "pipetorch.ops",
    "trainingModel": "pipetorch.runtime.executor",
    "inferenceModel": "pipetorch.runtime.executor",
    "PoplarExecutor": "pipetorch.runtime.executor",
    "DataLoader": "pipetorch.data",
    "AsynchronousDataAccessor": "pipetorch.data",
    # -- issue 17 groups 3-5 (optimisers, executor, losses): saved executables ------------
    "load": "pipetorch.runtime.executor",
    # models larger than the host's memory (a pipetorch extension)
    "empty_weights": "pipetorch.weights.files",
    "map_weights": "pipetorch.weights.files",
    # -------------------------------------------------------------------------------------
}
# --- issue 17, groups 1/2/6 (wt-compat): logging, extension points, printing, extra ops ---
_LAZY.update({
    "setLogLevel": "pipetorch.log_level",
    "logger": "pipetorch.log_level",
    "ICustomArgParser": "pipetorch.extensions",
    "registerCustomArgParser": "pipetorch.extensions",
    "registerPreCompileHook": "pipetorch.extensions",
    "registerPostCompileHook": "pipetorch.extensions",
    "accessAttributes": "pipetorch.extensions",
    "module_repr": "pipetorch.printing",
    "createPoptorchError": "pipetorch.errors",
    "ConfigFileError": "pipetorch.errors",
    "RecoverableError": "pipetorch.errors",
    "UnrecoverableError": "pipetorch.errors",
    "MatMulSerializationMode": "pipetorch.enums",
    "ipuHardwareIsAvailable": "pipetorch.runtime.counters",
    "ipuHardwareVersion": "pipetorch.runtime.counters",
    **{op: "pipetorch.tensor_ops" for op in (
        "dynamic_slice", "dynamic_update", "serializedMatMul", "set_overlap_for_input",
        "set_overlap_for_output", "ctc_beam_search_decoder", "custom_op")},
})
# --- end of the issue 17 block ---
_SUBMODULES = ("optim", "data", "ops", "enums", "errors", "profiling", "options",
               "poptorch_core")

__all__ = [
    *_LAZY, *_SUBMODULES, "Error", "AutoStage", "CommGroupType", "ConnectionType",
    "DataLoaderMode", "HalfFloatCastingBehavior", "Liveness", "MeanReductionStrategy",
    "OutputMode", "OverlapMode", "ReductionType", "SharingStrategy", "SyncPattern",
]
__all__.sort()


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"pipetorch.{name}")
    else:
        raise AttributeError(f"module 'pipetorch' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__


if __import__("os").environ.get("POPTORCH_LOG_LEVEL"):  # PopTorch reads it on import
    importlib.import_module("pipetorch.log_level")
if "torch" in __import__("sys").modules:  # the script imported torch first: cheap now
    importlib.import_module("pipetorch.torch_compat").restore()

if _environment.get("worker_pool") == "early":  # the workers' zygote, see parallel/pool
    from pipetorch.parallel.host import pool as _pool

    _pool.prestart()
