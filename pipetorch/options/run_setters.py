"""Options setters that change what runs: batching, outputs, seed, strategy, caching."""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import torch

from pipetorch.enums import AutoStage, CommGroupType, OutputMode
from pipetorch.errors import ConfigError
from pipetorch.options import _validate as check
from pipetorch.options._group import OptionGroup, readback

if TYPE_CHECKING:
    from typing_extensions import Self
    from pipetorch.partition.strategies import ExecutionStrategy

__all__ = ["RunSetters"]

logger = logging.getLogger(__name__)

_SEED_LIMIT = 2**64  # torch.manual_seed accepts seeds below this


class RunSetters(OptionGroup):
    """The part of `Options` that decides batching, outputs and execution."""

    _OWN_DEFAULTS: dict[str, Any] = {
        "device_iterations": 1,
        "replication_factor": 1,
        "output_mode": OutputMode.Default,
        "output_return_period": 1,
        "random_seed": None,
        "execution_strategy": None,  # PipelinedExecution(AutoStage.SameAsIpu), made on first read
        "auto_balance_devices": None,  # pipetorch extension: autoBalance(devices)
        "enable_synthetic_data": False,
        "executable_cache_dir": None,
        "auto_round_num_ipus": False,
        "broadcast_buffers": True,
        "input_group_size": 1,
        "input_group_type": CommGroupType.Consecutive,
        "updatable_named_buffers": [],
        "check_non_finite": False,  # pipetorch extension: checkNonFinite()
        "input_signatures": "one",  # pipetorch extension: inputSignatures("several")
    }

    device_iterations = readback("device_iterations", "Iterations per host call (D).")
    replication_factor = readback("replication_factor", "Number of model replicas (R).")
    output_mode = readback("output_mode", "Which micro-batches' outputs a call returns.")
    output_return_period = readback("output_return_period", "N of OutputMode.EveryN (else 1).")
    random_seed = readback("random_seed", "The seed given to randomSeed, or None.")
    auto_balance_devices = readback(
        "auto_balance_devices", "Devices autoBalance splits the model over, or None.")
    enable_synthetic_data = readback(
        "enable_synthetic_data", "Whether inputs are replaced by device-generated data.")
    executable_cache_dir = readback(
        "executable_cache_dir", "Directory caching prepared executables, or None.")
    auto_round_num_ipus = readback(
        "auto_round_num_ipus", "Round the device count up to a power of two.")
    broadcast_buffers = readback(
        "broadcast_buffers", "Broadcast buffers from replica 0 to all replicas each call.")
    input_group_size = readback(
        "input_group_size", "Replicas per input group: replicas in a group get the same data.")
    input_group_type = readback(
        "input_group_type", "How replicas are arranged into input groups.")
    updatable_named_buffers = readback(
        "updatable_named_buffers", "Buffers copyNamedBuffersToDevice() sends to the device.")
    check_non_finite = readback(
        "check_non_finite", "Whether calls check inputs, outputs and weights for NaN/Inf.")
    input_signatures = readback(
        "input_signatures", "How many input signatures a wrapper runs: 'one' or 'several'.")

    @property
    def execution_strategy(self) -> ExecutionStrategy:
        """The execution strategy; PipelinedExecution(AutoStage.SameAsIpu) unless set."""
        if self._values["execution_strategy"] is None:
            # Imported here so that importing options never imports the partitioner.
            from pipetorch.partition.strategies import PipelinedExecution
            self._values["execution_strategy"] = PipelinedExecution(AutoStage.SameAsIpu)
        return self._values["execution_strategy"]

    @property
    def _execution_strategy(self) -> ExecutionStrategy:
        """PopTorch's name of `execution_strategy` (scripts and its tests read it back)."""
        return self.execution_strategy

    @property
    def input_group_count(self) -> int:
        """Number of distinct input streams: replication_factor // input_group_size."""
        size, replicas = self._values["input_group_size"], self._values["replication_factor"]
        if replicas % size:
            raise ConfigError(
                f"replicationFactor ({replicas}) must be a multiple of the input group size "
                f"({size}) set by inputReplicaGrouping; change one of them")
        return replicas // size

    @property
    def input_replica_grouping(self) -> tuple[int, CommGroupType]:
        """(number of distinct input streams, arrangement); (R, Consecutive) by default. With
        input_group_size k, Consecutive gives replicas {0..k-1} stream 0, {k..2k-1} stream 1,
        ...; Orthogonal gives replica r stream r % input_group_count."""
        return self.input_group_count, self._values["input_group_type"]

    def deviceIterations(self, device_iterations: int) -> Self:
        """Iterations the device runs per host call, each on a new batch (default 1)."""
        self._set(device_iterations=check.integer(
            "deviceIterations", "device_iterations", device_iterations, minimum=1))
        return self

    def replicationFactor(self, replication_factor: int) -> Self:
        """Number of model replicas, each on its own device(s), for data parallelism."""
        self._set(replication_factor=check.integer(
            "replicationFactor", "replication_factor", replication_factor, minimum=1))
        return self

    def outputMode(self, output_mode: OutputMode,
                   output_return_period: int | None = None) -> Self:
        """Which outputs a call returns: All, Final, Sum, EveryN (with a period) or Default.

        Default means All for inference and Final for training. `output_return_period` is
        required with EveryN (every N-th iteration); with any other mode it is ignored, with a
        warning, as PopTorch does.
        """
        mode = check.enum_member("outputMode", "output_mode", output_mode, OutputMode)
        if mode == OutputMode.EveryN:
            if output_return_period is None:
                raise ValueError("outputMode: OutputMode.EveryN needs output_return_period, "
                                 "a positive int (return every N-th iteration); got None")
            period = check.integer("outputMode", "output_return_period",
                                   output_return_period, minimum=1)
        else:
            if output_return_period is not None:  # PopTorch warns and goes on
                logger.warning("outputMode: output_return_period (%r) is ignored with %r; it "
                               "is only used with OutputMode.EveryN", output_return_period, mode)
            period = 1
        self._set(output_mode=mode, output_return_period=period)
        return self

    def defaultOutputMode(self) -> bool:
        """True while outputMode is OutputMode.Default."""
        return self._values["output_mode"] == OutputMode.Default

    def randomSeed(self, random_seed: int) -> Self:
        """Seed the device's random numbers; also calls `torch.manual_seed(random_seed)`."""
        seed = check.integer("randomSeed", "random_seed", random_seed, minimum=0,
                             maximum=_SEED_LIMIT - 1)
        self._check_not_frozen()
        torch.manual_seed(seed)
        self._set(random_seed=seed)
        return self

    def setExecutionStrategy(self, strategy: ExecutionStrategy) -> Self:
        """How blocks become stages: PipelinedExecution (default), ShardedExecution, phased."""
        from pipetorch.partition.strategies import ExecutionStrategy
        if not isinstance(strategy, ExecutionStrategy):  # a user's script passes anything
            raise check.type_error(
                "setExecutionStrategy", "strategy", strategy,
                "a PipelinedExecution, ShardedExecution, SerialPhasedExecution or "
                "ParallelPhasedExecution")
        self._set(execution_strategy=strategy)
        return self

    def autoBalance(self, devices: int | None) -> Self:
        """pipetorch extension: before compiling, split the model over `devices` stages by
        measured time and memory (pipetorch.balance), replacing its BeginBlock annotations; a
        model with Block scopes runs its blocks grouped into the balanced stages instead of the
        strategy's own grouping (the strategy's kind, pipelined or sharded, is kept)."""
        if devices is not None and (isinstance(devices, bool) or not isinstance(devices, int)
                                    or devices < 1):
            raise ValueError(f"autoBalance(devices={devices!r}): devices must be an int >= 1 "
                             "(or None to switch balancing off)")
        self._set(auto_balance_devices=devices)
        return self

    def enableSyntheticData(self, enabled: bool) -> Self:
        """Replace host inputs by data generated on the device, to measure compute alone."""
        self._set(enable_synthetic_data=check.boolean("enableSyntheticData", "enabled", enabled))
        return self

    def enableExecutableCaching(self, path: str | os.PathLike | None) -> Self:
        """Cache prepared executables in directory `path`; None turns caching off.

        The directory is created when first needed: `path` must be a writable directory or
        a path that can be created as one (checked here, not at the first call)."""
        self._set(executable_cache_dir=check.output_directory(
            "enableExecutableCaching", "path", path, holds="the executable cache"))
        return self

    def autoRoundNumIPUs(self, auto_round_num_ipus: bool = True) -> Self:
        """Round the number of devices up to a power of two instead of raising an error."""
        self._set(auto_round_num_ipus=check.boolean(
            "autoRoundNumIPUs", "auto_round_num_ipus", auto_round_num_ipus))
        return self

    def broadcastBuffers(self, broadcast_buffers: bool = True) -> Self:
        """Broadcast buffers to all replicas (True, default) or keep them per replica."""
        self._set(broadcast_buffers=check.boolean(
            "broadcastBuffers", "broadcast_buffers", broadcast_buffers))
        return self

    def inputReplicaGrouping(self, input_group_size: int,
                             input_group_type: CommGroupType) -> Self:
        """Give groups of `input_group_size` replicas the same input data.

        `input_group_type` arranges replicas into groups: Consecutive or Orthogonal
        (NoGrouping only with size 1; All is refused). replicationFactor must be a multiple
        of the size; each call then takes D x G x (R / size) micro-batches.
        """
        size = check.integer("inputReplicaGrouping", "input_group_size", input_group_size,
                             minimum=1)
        kind = check.enum_member(
            "inputReplicaGrouping", "input_group_type", input_group_type, CommGroupType,
            allowed=(CommGroupType.Consecutive, CommGroupType.Orthogonal,
                     CommGroupType.NoGrouping))
        if kind == CommGroupType.NoGrouping and size != 1:
            raise check.value_error("inputReplicaGrouping", "input_group_size", size,
                                    "1 with CommGroupType.NoGrouping")
        self._set(input_group_size=size, input_group_type=kind)
        return self

    def updatableNamedBuffers(self, buffers: list[str]) -> Self:
        """Buffers (by name in the model) that `copyNamedBuffersToDevice()` may update."""
        if isinstance(buffers, str) or not all(isinstance(b, str) for b in buffers):
            raise check.type_error("updatableNamedBuffers", "buffers", buffers,
                                   "a list of buffer names (str)")
        self._set(updatable_named_buffers=list(buffers))
        return self

    def checkNonFinite(self, enabled: bool = True) -> Self:
        """pipetorch extension: check every call for NaN and Inf (off by default; it costs a
        scan of the inputs and outputs, every micro-batch's outputs are brought back, and a
        training call copies the weights to the host to check them).

        Non-finite inputs are refused before anything runs, naming the argument and sample; a
        call whose loss or outputs are non-finite raises `pipetorch.errors.NonFiniteError`
        naming the first such micro-batch (after the call: its optimiser steps ran); weights
        that became non-finite are warned about once per wrapper. The nearest PopTorch option,
        Precision.enableFloatingPointExceptions, stays a no-op here.
        """
        self._set(check_non_finite=check.boolean("checkNonFinite", "enabled", enabled))
        return self

    def inputSignatures(self, signatures: str) -> Self:
        """pipetorch extension: how many input signatures (shapes, dtypes, structure of a
        call's arguments) one wrapper runs.

        "one" (the default, PopTorch's behaviour): a call whose inputs differ from the first
        call's raises InputMismatchError. "several": each new signature (a sequence length
        16, then 24) is captured and split once more, on its first call, and the wrapper
        keeps every signature's stage graphs; all of them run on the same workers with the
        same weights and optimiser state, so training calls of any signature update one
        model, as plain PyTorch does. The first call of each new signature logs a warning
        with what adding it cost.
        """
        if not isinstance(signatures, str):
            raise check.type_error("inputSignatures", "signatures", signatures,
                                   "'one' or 'several'")
        if signatures not in ("one", "several"):
            raise check.value_error("inputSignatures", "signatures", signatures,
                                    "'one' (PopTorch's single signature) or 'several'")
        self._set(input_signatures=signatures)
        return self
