"""Which point of training each copy of a model's weights and optimiser state holds.

A point counts the changes to the workers' weights since they started: each training call and
each upload (copyWeightsToDevice) makes one. The copies, and the point each holds:

    workers      the latest point, always
    snapshots    the point the workers last wrote to their files (what a failure restores)
    host copy    the point it was last brought to (a read after calls brings it to the latest)
    optimiser    its state is on the workers, or on the host once read (it moves, never both)

Every copy the user reads, saves or uploads holds every tensor from one point: the latest
(docs/precision.md).
"""
from __future__ import annotations

from dataclasses import dataclass

__all__: list[str] = []


@dataclass
class Points:
    """One set of workers' points (reset when new workers start from the host copy)."""

    workers: int = 0
    saved: int | None = None  # None: no snapshot written since the workers started
    host: int = 0
    state_on_host: bool = False  # replica 0's optimiser state moved to the host when read

    def started(self, *, saved: bool) -> None:
        """New workers from the host copy (and its optimiser state); `saved`: they wrote it."""
        self.workers, self.saved, self.host, self.state_on_host = 0, 0 if saved else None, 0, False

    def changed(self, *, saved: bool, uploaded: bool = False) -> None:
        """A training call (or an upload: the host copy is that point) changed the weights;
        `saved`: the workers wrote a snapshot of the new point."""
        self.workers += 1
        self.saved = self.workers if saved else self.saved
        self.host = self.workers if uploaded else self.host

    def pulled(self, *, optimizer_state: bool) -> None:
        """The host copy (and with `optimizer_state` the optimiser's state) came from the
        workers."""
        self.host = self.workers
        self.state_on_host |= optimizer_state

    def behind(self) -> int | None:
        """How many points the snapshots lack; None without one."""
        return None if self.saved is None else self.workers - self.saved

    def host_current(self, *, optimizer_state: bool) -> bool:
        """Whether the host holds the latest weights (and the optimiser's state) already."""
        return self.host == self.workers and (self.state_on_host or not optimizer_state)
