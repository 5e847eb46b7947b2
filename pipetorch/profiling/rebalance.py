"""Re-balancing advice from a recorded run: the bottleneck stage, by how much, and the move."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipetorch.profiling.summary import Summary

__all__: list[str] = []

# Stages within this share of each other count as balanced.
BALANCED = 0.10


@dataclass(frozen=True)
class Move:
    """Move `block` from stage `source` to stage `target`; the slowest stage drops to
    `predicted_ms` (from `bottleneck_ms`)."""

    block: str
    source: int
    target: int
    bottleneck_ms: float
    predicted_ms: float

    @property
    def gain(self) -> float:
        return self.bottleneck_ms / self.predicted_ms if self.predicted_ms else 1.0


def stage_compute(summary: Summary) -> list[float]:
    """Measured forward+backward ms of each stage in the run, from its trace spans."""
    return [d["compute_ms"] for d in summary.get("timing", {}).get("per_device", [])]


def propose(blocks: list[list[str]], compute_ms: list[float]) -> Move | None:
    """The one-block move toward balance that most lowers the slowest stage, or None.

    A stage's blocks are taken to cost alike (the trace times stages, not blocks); a block
    moves only across the cut it sits at, to keep stages contiguous.
    """
    worst = max(compute_ms)
    best: Move | None = None
    for s, names in enumerate(blocks):
        if len(names) < 2:
            continue
        share = compute_ms[s] / len(names)
        for target, block in ((s - 1, names[0]), (s + 1, names[-1])):
            if not 0 <= target < len(blocks):
                continue
            after = list(compute_ms)
            after[s] -= share
            after[target] += share
            if max(after) < worst and (best is None or max(after) < best.predicted_ms):
                best = Move(block, s, target, worst, max(after))
    return best


def advice(summary: Summary) -> str | None:
    """Text naming the bottleneck stage and the proposed move, or None without stage spans."""
    compute = stage_compute(summary)
    stages = summary.get("stages", [])
    if len(compute) < 2 or len(compute) != len(stages):
        return None
    slow = max(range(len(compute)), key=compute.__getitem__)
    fast = min(compute)
    ratio = compute[slow] / fast if fast else float("inf")
    head = (f"Balance: stage {slow} is the bottleneck, {compute[slow]:.1f} ms of compute, "
            f"{ratio:.2f}x the fastest stage ({fast:.1f} ms)")
    if ratio <= 1 + BALANCED:
        return head + "; the stages are balanced within 10%."
    move = propose([list(s["blocks"]) for s in stages], compute)
    if move is None:
        return (head + f". No whole block can move: split stage {slow}'s blocks "
                "(more BeginBlocks) or run "
                "pipetorch.balance(model, *micro_batch, devices=N, options=opts).")
    return (head + f". Move block {move.block!r} from stage {move.source} to stage "
            f"{move.target} (ipu_id={stages[move.target]['ipu']}): predicted slowest stage "
            f"{move.predicted_ms:.1f} ms, {move.gain:.2f}x faster; or run "
            "pipetorch.balance(model, *micro_batch, devices=N, options=opts).")
