"""The user's end of an asynchronous loader's pipe: messages sent and received, every wait
bounded by the loader process's liveness, and its failures raised as LoaderError.

A loader that fails sends its error and exits. A send to it may then fail (broken pipe)
while its last batches and its error still wait, unread, in the pipe: only `_receive`
declares the process dead, and only once it has read everything the process sent, so the
error reaches the user whatever the user's pace. The accessor that owns the pipe records the
failure and stops the loader.
"""
from __future__ import annotations

import logging
import multiprocessing
import pickle
import signal
from collections import deque
from multiprocessing.connection import Connection, wait
from typing import Any

from pipetorch.data.ring_buffer import Msg
from pipetorch.errors import LoaderError
from pipetorch.parallel.comm import stream

__all__: list[str] = []

logger = logging.getLogger("pipetorch.data.accessor")

_WARN_AFTER_S = 60.0


class LoaderPipe:
    """The pipe to one loader process: `receive` returns its next message, or raises its
    failure (an error it sent, its death) as a LoaderError."""

    def __init__(self, conn: Connection, process: multiprocessing.process.BaseProcess) -> None:
        self.conn, self.process = conn, process
        self.pending: deque[tuple[Any, ...]] = deque()  # read ahead, not yet received

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def send(self, kind: Msg, *payload: int) -> None:
        try:
            self.conn.send((kind, *payload))
        except OSError:
            # The loader has exited: the next receive reads what it sent, then its death.
            logger.debug("loader process %s has exited; %s not sent", self.pid, kind.name)

    def has_message(self) -> bool:
        """Whether a message waits to be received (without waiting)."""
        return bool(self.pending) or self.conn.poll(0)

    def receive(self) -> tuple[Any, ...]:
        if self.pending:
            return self._checked(self.pending.popleft())
        process = self.process
        waited = 0.0
        while True:
            if self.conn.poll(0):
                try:
                    return self._checked(self.conn.recv())
                except (EOFError, OSError):
                    raise self._died() from None
            if not process.is_alive():
                if self.conn.poll(0):
                    continue  # read what it sent before exiting
                raise self._died()
            wait([self.conn, process.sentinel], timeout=stream.POLL)
            waited += stream.POLL
            if waited >= _WARN_AFTER_S:
                logger.warning("still waiting for a batch from loader process %d after %.0f s",
                               process.pid, waited)
                waited = 0.0

    def stop(self) -> None:
        """Ask the loader to stop, and make sure it has (terminated, killed) before returning."""
        process = self.process
        try:
            self.conn.send((Msg.SHUTDOWN,))
        except (OSError, ValueError):
            pass  # already gone
        process.join(2.0)
        if process.is_alive():
            process.terminate()
            process.join(1.0)
        if process.is_alive():
            process.kill()
            process.join()
        self.conn.close()

    def _died(self) -> LoaderError:
        process = self.process
        if process.exitcode is None:
            process.join(timeout=2.0)  # its pipe can close before its exit status is ready
        code = process.exitcode
        how = f"exit code {code}"
        if code is not None and code < 0:
            how = f"killed by signal {signal.Signals(-code).name}"
        return LoaderError(
            f"An error occurred in the data fetcher: the data loader process (pid "
            f"{self.pid}) died unexpectedly ({how}). Its dataset may have crashed the "
            "interpreter or been killed for memory; run with mode=DataLoaderMode.Sync to see "
            "the failure in this process.")

    @staticmethod
    def _checked(message: tuple[Any, ...]) -> tuple[Any, ...]:
        """`message`, unless it is the loader's exception: raised then, with its traceback."""
        if message[0] != Msg.ERROR:
            return message
        name, text_of_message, text, pickled = message[1:]
        # PopTorch's words first ("An error occurred in the data fetcher"), then what it was
        error = LoaderError(f"An error occurred in the data fetcher: the data loader process "
                            f"raised {name}: {text_of_message}\n\n"
                            f"Traceback in the loader process:\n{text}")
        original = None
        if pickled is not None:
            try:
                original = pickle.loads(pickled)
            except Exception:  # noqa: BLE001 - the traceback text is kept either way
                original = None
        error.__cause__ = original
        raise error
