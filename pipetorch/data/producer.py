"""The loader process: fetches batches into the shared ring buffer until told to stop.

It runs `source` (anything iterable; one iteration is one epoch) and obeys the user's
process through one pipe (see ring_buffer.Msg). Every blocking wait wakes up every
`stream.POLL` seconds to check that the user's process still exists, so an orphaned loader
exits by itself. An exception is sent back with its traceback before the process exits.

Epochs: the loader may run ahead of the user by one epoch when load_indefinitely is set
(it prefetches the next epoch as soon as one ends); otherwise it waits for the user's next
`iter()`. early_preload lets it fill the ring before the first `iter()`; without it only
the first batch (needed to shape the slots) is fetched up front.
"""
from __future__ import annotations

import math
import os
import pickle
import signal
import traceback
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from pipetorch.data.fetch import DirectFetch
from pipetorch.data.ring_buffer import Command, Msg, SlotLayout, SlotSizes, SlotWriter
from pipetorch import memfd
from pipetorch.parallel.comm import stream
from pipetorch.data.structure import batch_rows, flatten

__all__: list[str] = []



@dataclass(frozen=True)
class LoaderSettings:
    """What the loader process needs besides its source."""

    buffer_size: int
    rows_per_slot: int | None
    keep_partial: bool
    load_indefinitely: bool
    early_preload: bool
    parent_pid: int


class _Reset(Exception):
    """The user abandoned the epoch."""


class _Shutdown(Exception):
    """The user asked the loader to stop, or went away."""


def run_loader(source: Iterable[object] | str, conn: Connection, settings: LoaderSettings) -> None:
    """Process entry point. `source` may be a path to a pickled source (FileSystem sharing)."""
    # Ctrl-C belongs to the user's process, which then stops this one cleanly.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A forked child must not reuse the parent's OpenMP pool; copies need one thread anyway.
    torch.set_num_threads(1)
    try:
        if isinstance(source, str):
            with open(source, "rb") as f:
                source = pickle.load(f)
    except BaseException as error:  # noqa: BLE001 - reported to the user's process
        _Producer((), conn, settings).report(error)
        return
    _Producer(source, conn, settings).run()


class _Producer:
    def __init__(self, source: Iterable[object], conn: Connection,
                 settings: LoaderSettings) -> None:
        self.source = source
        self.conn = conn
        self.settings = settings
        self.epoch = 1      # the epoch being loaded, counted from 1
        self.starts = 0     # epochs the user has started (iter() calls, resets included)
        self.batches: Iterator[object] | None = None
        self.writer: SlotWriter | None = None
        self._direct_child = os.getppid() == settings.parent_pid

    def run(self) -> None:
        try:
            self._setup()
            while True:
                try:
                    self._wait_until_allowed()
                    self._fill_epoch()
                except _Reset:
                    self._restart()
        except _Shutdown:
            pass
        except BaseException as error:  # noqa: BLE001 - reported to the user's process
            self.report(error)
        finally:
            self.batches = None
            close = getattr(self.source, "close", None)
            if close is not None:
                close()

    def _new_epoch(self) -> Iterator[object]:
        epoch = getattr(self.source, "epoch", None)
        return iter(epoch(direct=True)) if epoch is not None else iter(self.source)

    def _setup(self) -> None:
        self.batches = self._new_epoch()
        first = next(self.batches, None)
        if first is None:
            raise ValueError("The dataset is empty: its first epoch produced no batch.")
        if isinstance(first, DirectFetch):
            first = first.materialize()
        leaves, tree = flatten(first, where="the first batch")
        rows = self.settings.rows_per_slot
        layout = SlotLayout.of(leaves, rows=rows)
        address, buffer = memfd.make(layout.slot_bytes * self.settings.buffer_size)
        batched = rows is not None or getattr(self.source, "batched", False)
        items = rows or (batch_rows(leaves) if batched else None)
        self._send(Msg.SETUP, layout, tree, address, items)
        while (message := self._receive())[0] != Msg.ACK:
            self._handle(message)  # only SHUTDOWN can come before the ACK
        os.close(address.fd)  # the user's process has the buffer mapped
        self.writer = SlotWriter(layout, buffer, self.settings.buffer_size,
                                 rows_per_slot=rows, wait_for_free=self._wait_for_free,
                                 publish=self._publish)
        self.writer.write(first)

    def _allowed(self, epoch: int) -> bool:
        if epoch == 1 and self.settings.early_preload:
            return True
        ahead = 1 if self.settings.load_indefinitely and self.starts >= 1 else 0
        return epoch <= self.starts + ahead

    def _wait_until_allowed(self) -> None:
        while not self._allowed(self.epoch):
            self._handle(self._receive())

    def _fill_epoch(self) -> None:
        assert self.writer is not None
        if self.batches is None:
            self.batches = self._new_epoch()
        for item in self.batches:
            self._drain_commands()
            self.writer.write(item)
        self.writer.finish_epoch(keep_partial=self.settings.keep_partial)
        self.batches = None
        self._send(Msg.EPOCH_END)
        self.epoch += 1

    def _restart(self) -> None:
        assert self.writer is not None
        self.starts += 1
        self.epoch = self.starts
        self.batches = None
        self.writer.reset()
        self._send(Msg.RESET_ACK)

    def _wait_for_free(self) -> None:
        self._handle(self._receive())

    def _publish(self, slot: int, sizes: SlotSizes) -> None:
        self._send(Msg.READY, slot, sizes)

    def _handle(self, message: Command) -> None:
        kind = message[0]
        if kind == Msg.FREE and len(message) == 2:
            assert self.writer is not None
            self.writer.free.append(message[1])
        elif kind == Msg.START:
            self.starts += 1
        elif kind == Msg.RESET:
            raise _Reset
        elif kind == Msg.SHUTDOWN:
            raise _Shutdown

    def _drain_commands(self) -> None:
        while self.conn.poll(0):
            self._handle(self._recv())

    def _recv(self) -> Command:
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            raise _Shutdown from None

    def _receive(self) -> Command:
        try:
            stream.wait(self.conn, math.inf, self._user_alive)
        except EOFError:
            raise _Shutdown from None
        return self._recv()

    def _user_alive(self) -> bool:
        parent = self.settings.parent_pid
        if self._direct_child:  # fork / spawn: orphans are re-parented when the user dies
            return os.getppid() == parent
        try:  # fork server: the user's process is not our parent
            os.kill(parent, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True

    def _send(self, kind: Msg, *payload: object) -> None:
        try:
            self.conn.send((kind, *payload))
        except (BrokenPipeError, ConnectionResetError, EOFError):
            raise _Shutdown from None

    def report(self, error: BaseException) -> None:
        """Send the exception and its traceback to the user's process."""
        text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        try:
            pickled = pickle.dumps(error)
        except Exception:  # noqa: BLE001 - some exceptions cannot be pickled; the text stays
            pickled = None
        try:
            self._send(Msg.ERROR, type(error).__name__, str(error), text, pickled)
        except _Shutdown:
            pass
