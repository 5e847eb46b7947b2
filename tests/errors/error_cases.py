"""Helpers of the tests/errors modules: what a user's mistake must leave behind (no worker
process) and the small models they make it with."""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch
import torch.nn as nn


def descendants() -> set[int]:
    """Every live process started, directly or not, by this one (stage workers are forked by
    the pool's zygote, so they are grandchildren), read from /proc."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended while we looked
        if fields[0] != "Z":
            parents[int(entry)] = int(fields[1])
    found: set[int] = set()
    frontier = {os.getpid()}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


@contextlib.contextmanager
def no_worker_started() -> Iterator[None]:
    """Asserts that the block started no process (no zygote, no stage worker)."""
    before = descendants()
    yield
    started = descendants() - before
    assert not started, f"processes {sorted(started)} were started for a mistake seen on the host"


class Regressor(nn.Module):
    """x [B, 4] float, y [B, 1] float -> (prediction, MSE loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None):
        out = self.fc(x)
        return out if y is None else (out, nn.functional.mse_loss(out, y))


class TwoStageClassifier(nn.Module):
    """A classifier over two devices: x [B, 4] float, labels [B] int64 in 0..2."""

    def __init__(self) -> None:
        super().__init__()
        import pipetorch as poptorch

        self.fc1 = poptorch.BeginBlock(nn.Linear(4, 8), "B0", ipu_id=0)
        self.fc2 = poptorch.BeginBlock(nn.Linear(8, 3), "B1", ipu_id=1)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x: torch.Tensor, labels: torch.Tensor):
        out = self.fc2(torch.relu(self.fc1(x)))
        return out, self.loss(out, labels)
