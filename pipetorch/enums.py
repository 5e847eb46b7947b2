"""PopTorch's enumerations, with PopTorch's names and integer values."""
from __future__ import annotations

import enum

__all__ = [
    "OutputMode", "DataLoaderMode", "ReductionType", "MeanReductionStrategy", "AutoStage",
    "ConnectionType", "SyncPattern", "CommGroupType", "SharingStrategy", "Liveness",
    "OverlapMode", "HalfFloatCastingBehavior",
]


class OutputMode(enum.IntEnum):
    """Which micro-batches' outputs a host call returns."""

    Final = 0
    EveryN = 1
    All = 2
    Sum = 3
    Default = 4  # All for inference, Final for training


class DataLoaderMode(enum.IntEnum):
    """How a DataLoader produces its batches."""

    Sync = 0
    Async = 1
    AsyncRebatched = 2


class ReductionType(enum.IntEnum):
    """How gradients (and losses) are reduced over accumulation steps and replicas."""

    Sum = 0
    Mean = 1
    NoReduction = 2


class MeanReductionStrategy(enum.IntEnum):
    """When the mean over accumulation steps is taken (numerically equal here)."""

    Running = 0
    Post = 1
    PostAndLoss = 2


class AutoStage(enum.IntEnum):
    """How blocks become pipeline stages when no explicit Stage is given."""

    SameAsIpu = 0
    AutoIncrement = 1


class ConnectionType(enum.IntEnum):
    """When to attach to the device (no-op here: devices are always available)."""

    Always = 0
    OnDemand = 1
    Never = 2


class SyncPattern(enum.IntEnum):
    """IPU host-sync pattern (no-op here)."""

    Full = 0
    SinglePipeline = 1
    ReplicaAndLadder = 2


class CommGroupType(enum.IntEnum):
    """How replicas are grouped for input sharing and collectives."""

    All = 0
    Consecutive = 1
    Orthogonal = 2
    NoGrouping = 3


class SharingStrategy(enum.IntEnum):
    """How an asynchronous loader shares its batches with the user's process."""

    SharedMemory = 0
    FileSystem = 1
    Fork = 2
    ForkServer = 3


class Liveness(enum.IntEnum):
    """Tensor liveness hint of phased execution (no-op here)."""

    AlwaysLive = 0
    OffChipAfterFwd = 1
    OffChipAfterFwdNoOverlap = 2
    OffChipAfterEachPhase = 3


class OverlapMode(enum.IntEnum):
    """IO-tile overlap of host transfers (no-op here)."""

    NoOverlap = 0
    OverlapAccumulationLoop = 1
    OverlapDeviceIterationLoop = 2


class HalfFloatCastingBehavior(enum.IntEnum):
    """Which dtype an op mixing float16 and float32 operands casts them to."""

    FloatDowncastToHalf = 0  # every operand to the 16-bit dtype
    HalfUpcastToFloat = 1  # PyTorch's rule: every operand to float32
    Default = 2  # HalfUpcastToFloat, as PopTorch 3.x's dispatcher


class MatMulSerializationMode(enum.Enum):
    """Which dimension `serializedMatMul` splits (A[m,n] @ B[n,p])."""

    InputChannels = "input_channels"  # m
    ReducingDim = "reducing_dim"  # n
    OutputChannels = "output_channels"  # p
    Disabled = "none"
