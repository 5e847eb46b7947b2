"""The user's end of an asynchronous loader's pipe: messages sent and received, every wait
bounded by the loader process's liveness, and its failures raised as LoaderError.

A loader that fails sends its error and exits. A send to it may then fail (broken pipe)
while its last batches and its error still wait, unread, in the pipe: only `_receive`
declares the process dead, and only once it has read everything the process sent, so the
error reaches the user whatever the user's pace.
"""
from __future__ import annotations

import logging
import multiprocessing
import pickle
import signal
from collections import deque
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

from pipetorch.data.ring_buffer import Msg
from pipetorch.errors import LoaderError
from pipetorch.parallel.comm import stream

__all__: list[str] = []

logger = logging.getLogger("pipetorch.data.accessor")

_WARN_AFTER_S = 60.0


class LoaderPipe:
    """AsynchronousDataAccessor's messages (its attributes, below)."""

    _conn: Connection
    _process: multiprocessing.process.BaseProcess | None
    _pending: deque[tuple[Any, ...]]
    _failure: LoaderError | None
    terminate: Callable[[], None]  # stops the loader process

    def _send(self, kind: Msg, *payload: int) -> None:
        try:
            self._conn.send((kind, *payload))
        except OSError:
            # The loader has exited: the next _receive reads what it sent, then its death.
            logger.debug("loader process %s has exited; %s not sent", self._pid(), kind.name)

    def _receive(self) -> tuple[Any, ...]:
        if self._pending:
            return self._pending.popleft()
        process = self._process
        assert process is not None  # a terminated loader is not read (_check_usable)
        waited = 0.0
        while True:
            if self._conn.poll(0):
                try:
                    return self._conn.recv()
                except (EOFError, OSError):
                    self._died()
            if not process.is_alive():
                if self._conn.poll(0):
                    continue  # read what it sent before exiting
                self._died()
            wait([self._conn, process.sentinel], timeout=stream.POLL)
            waited += stream.POLL
            if waited >= _WARN_AFTER_S:
                logger.warning("still waiting for a batch from loader process %d after %.0f s",
                               process.pid, waited)
                waited = 0.0

    def _died(self) -> None:
        process = self._process
        if process is not None and process.exitcode is None:
            process.join(timeout=2.0)  # its pipe can close before its exit status is ready
        code = process.exitcode if process is not None else None
        how = f"exit code {code}"
        if code is not None and code < 0:
            how = f"killed by signal {signal.Signals(-code).name}"
        self._fail_with(LoaderError(
            f"An error occurred in the data fetcher: the data loader process (pid "
            f"{self._pid()}) died unexpectedly ({how}). Its dataset may have crashed the "
            "interpreter or been killed for memory; run with mode=DataLoaderMode.Sync to see "
            "the failure in this process."))

    def _pid(self) -> int | str:
        pid = self._process.pid if self._process is not None else None
        return pid if pid is not None else "?"

    def _fail(self, payload: tuple[str, str, str, bytes | None]) -> None:
        name, message, text, pickled = payload
        # PopTorch's words first ("An error occurred in the data fetcher"), then what it was
        error = LoaderError(f"An error occurred in the data fetcher: the data loader process "
                            f"raised {name}: {message}\n\n"
                            f"Traceback in the loader process:\n{text}")
        original = None
        if pickled is not None:
            try:
                original = pickle.loads(pickled)
            except Exception:  # noqa: BLE001 - the traceback text is kept either way
                original = None
        error.__cause__ = original
        self._fail_with(error)

    def _fail_with(self, error: LoaderError) -> None:
        self._failure = error
        self.terminate()
        raise error
