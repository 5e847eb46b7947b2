"""Stages and execution strategies: how blocks are grouped and placed on devices."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from pipetorch.enums import AutoStage, Liveness
from pipetorch.errors import ConfigError
from pipetorch.partition.blocks import BlockInfo

__all__ = [
    "Stage", "Phase", "PipelinedExecution", "ShardedExecution", "SerialPhasedExecution",
    "ParallelPhasedExecution",
]


class Stage:
    """A group of consecutive blocks placed on one device: `Stage("B1", "B2").ipu(0)`."""

    def __init__(self, *block_ids: str) -> None:
        for block_id in block_ids:
            if not isinstance(block_id, (str, int)):
                raise TypeError(f"Stage takes block ids (str), got {block_id!r}")
        self.block_ids = tuple(str(b) for b in block_ids)
        self.ipu_id: int | None = None

    def ipu(self, ipu_id: int) -> "Stage":
        """Place this stage on device `ipu_id`."""
        if isinstance(ipu_id, bool) or not isinstance(ipu_id, int) or ipu_id < 0:
            raise ValueError(f"Stage.ipu expects an int >= 0, got {ipu_id!r}")
        self.ipu_id = ipu_id
        return self

    def __repr__(self) -> str:
        ids = ", ".join(repr(b) for b in self.block_ids)
        return f"Stage({ids})" + ("" if self.ipu_id is None else f".ipu({self.ipu_id})")


@dataclass(frozen=True)
class StageSpec:
    """A resolved stage: its position in the pipeline, its device and its blocks."""

    index: int
    ipu_id: int
    block_ids: tuple[str, ...]


def _as_stages(args: tuple) -> list[Stage] | AutoStage:
    if not args:
        return AutoStage.SameAsIpu
    if len(args) == 1 and isinstance(args[0], AutoStage):
        return args[0]
    if all(isinstance(a, Stage) for a in args):
        return list(args)
    if all(isinstance(a, (str, int)) and not isinstance(a, bool) for a in args):
        return [Stage(a) for a in args]
    raise TypeError(
        "An execution strategy takes Stage objects, block ids (str) or one AutoStage, not a mix; "
        f"got {[type(a).__name__ for a in args]}"
    )


class ExecutionStrategy:
    """Base of all strategies: resolves the blocks seen in forward into ordered stages."""

    pipelined = False

    def __init__(self, *args: Stage | str | AutoStage) -> None:
        self._stages = _as_stages(args)

    @property
    def stages(self) -> list[Stage] | AutoStage:
        return self._stages

    def resolve(self, blocks: list[BlockInfo], *, preamble: bool = False) -> list[StageSpec]:
        """Stages for the blocks a forward pass entered, validated against them.

        `preamble`: ops ran before the first block; PopTorch puts them on device 0.
        """
        if not blocks:
            if isinstance(self._stages, list) and self._stages:
                named = sorted({b for s in self._stages for b in s.block_ids})
                raise ConfigError(
                    f"The strategy names blocks {named} but the model's forward entered no "
                    "Block: annotate the model with poptorch.Block / BeginBlock"
                )
            return [StageSpec(0, 0, ())]
        if isinstance(self._stages, AutoStage):
            stages = _auto_stages(self._stages, blocks)
            if preamble and stages[0].ipu_id != 0:
                # e.g. BeginBlock(model.layer3[8], ipu_id=1): the layers before it run on ipu 0
                stages = [StageSpec(0, 0, ())] + [
                    StageSpec(s.index + 1, s.ipu_id, s.block_ids) for s in stages]
            return stages
        return _explicit_stages(self._stages, blocks)

    def __repr__(self) -> str:
        inner = self._stages if isinstance(self._stages, AutoStage) else ", ".join(map(repr, self._stages))
        return f"{type(self).__name__}({inner})"


def _auto_stages(mode: AutoStage, blocks: list[BlockInfo]) -> list[StageSpec]:
    if mode == AutoStage.AutoIncrement:
        return [StageSpec(i, i if b.ipu_id is None else b.ipu_id, (b.user_id,))
                for i, b in enumerate(blocks)]
    missing = [b.user_id for b in blocks if b.ipu_id is None]
    if missing:
        raise ConfigError(
            f"AutoStage.SameAsIpu places each block on its ipu_id, but blocks {missing} have no "
            "ipu_id: give them one (Block(..., ipu_id=N)) or set an explicit strategy, e.g. "
            "PipelinedExecution(Stage('B1').ipu(0), Stage('B2').ipu(1))"
        )
    stages: list[StageSpec] = []
    for block in blocks:  # consecutive blocks on the same device form one stage
        if stages and stages[-1].ipu_id == block.ipu_id:
            last = stages[-1]
            stages[-1] = StageSpec(last.index, last.ipu_id, last.block_ids + (block.user_id,))
        else:
            assert block.ipu_id is not None
            stages.append(StageSpec(len(stages), block.ipu_id, (block.user_id,)))
    return stages


def _explicit_stages(stages: list[Stage], blocks: list[BlockInfo]) -> list[StageSpec]:
    known = [b.user_id for b in blocks]
    owner: dict[str, int] = {}
    for index, stage in enumerate(stages):
        for block_id in stage.block_ids:
            if block_id not in known:
                raise ConfigError(
                    f"Unknown block {block_id!r} in {stage!r}: the model's forward entered blocks "
                    f"{known}; use one of those ids"
                )
            if block_id in owner:
                raise ConfigError(
                    f"Block {block_id!r} is in stage {owner[block_id]} and in stage {index}: "
                    "each block belongs to exactly one Stage"
                )
            owner[block_id] = index
    unassigned = [b for b in known if b not in owner]
    if unassigned:
        raise ConfigError(
            f"Blocks {unassigned} are not in any Stage of the strategy (stages: {stages}); "
            "add them to a Stage"
        )
    order = [owner[b] for b in known]
    for before, after, block in zip(order, order[1:], known[1:], strict=False):
        if after < before:
            raise ConfigError(
                f"Block {block!r} runs after a block of stage {before} but belongs to stage "
                f"{after}: stages must follow the model's order (block order {known})"
            )
    return [StageSpec(i, i if s.ipu_id is None else s.ipu_id, s.block_ids)
            for i, s in enumerate(stages)]


class PipelinedExecution(ExecutionStrategy):
    """Stages on different devices work on different micro-batches at the same time."""

    pipelined = True


class ShardedExecution(ExecutionStrategy):
    """Stages run one after another, one micro-batch at a time."""


class Phase:
    """A set of stages that run together in a phased execution."""

    def __init__(self, *args: Stage | str) -> None:
        stages = _as_stages(args)
        if isinstance(stages, AutoStage) or not stages:
            raise TypeError("Phase takes Stage objects or block ids, e.g. Phase('B1', 'B2')")
        self.stages = stages

    def ipus(self, *ipus: int) -> "Phase":
        """Place the phase's stages on these devices, in order."""
        if len(ipus) != len(self.stages):
            raise ValueError(f"Phase has {len(self.stages)} stages but got {len(ipus)} ipus {ipus}")
        for stage, ipu in zip(self.stages, ipus, strict=True):
            stage.ipu(ipu)
        return self


class _PhasedExecution(ShardedExecution):
    """Phases run one after another; here each phase's stages run as a sharded pipeline."""

    def __init__(self, *phases: Phase | Stage | str) -> None:
        flat: list[Stage] = []
        for phase in phases:
            flat.extend(phase.stages if isinstance(phase, Phase) else Phase(phase).stages)
        super().__init__(*flat)
        self.phases = phases
        self.tensors_liveness = Liveness.AlwaysLive
        self.separate_backward_phase = False

    def setTensorsLiveness(self, liveness: Liveness) -> "_PhasedExecution":
        """Where tensors live between phases (no-op here: memory is not phased)."""
        self.tensors_liveness = Liveness(liveness)
        return self

    def useSeparateBackwardPhase(self, use: bool = True) -> "_PhasedExecution":
        """Run backward in phases of its own (no-op here)."""
        self.separate_backward_phase = bool(use)
        return self


class SerialPhasedExecution(_PhasedExecution):
    """PopTorch's serial phased execution, run here as sharded execution of its stages."""


class ParallelPhasedExecution(_PhasedExecution):
    """PopTorch's parallel phased execution, run here as sharded execution of its stages."""


def stage_of_blocks(stages: Iterable[StageSpec]) -> dict[str, int]:
    """Block id -> stage index."""
    return {b: s.index for s in stages for b in s.block_ids}
