"""AsynchronousDataAccessor: a separate process loads batches into a shared-memory ring.

Yielded tensors are views of a ring-buffer slot, not copies: the slot is handed back to
the loader process (and overwritten) at the next `next()`, so `.clone()` anything you keep
longer than one step. A `non_blocking` copy to a GPU is still reading the slot after it
returns: record a CUDA event after it and pass it to `release_after(event)`, and the slot is
handed back only once the event has completed:

    images, labels = next(loader)
    on_gpu = images.to("cuda", non_blocking=True)
    copied = torch.cuda.Event(); copied.record()
    loader.release_after(copied)   # the next next() recycles the slot once the copy is done

Errors cross the process boundary: an exception in the dataset is raised here as
`pipetorch.errors.LoaderError` carrying the loader's traceback, and a loader process that
dies (killed, crashed) is noticed within `stream.POLL` seconds instead of being waited on
forever.

Start method (`sharing_strategy`): PopTorch spawns a fresh interpreter (its default is
FileSystem); pipetorch defaults to `SharingStrategy.Fork` where the OS has fork(), which
starts the loader in milliseconds and shares the dataset without pickling it. fork() copies
only the calling thread: the loader therefore sets one intra-op thread (a forked child must
not reuse the parent's OpenMP pool) and runs only the dataset and tensor copies. If the
dataset itself relies on threads or locks of the parent (a database client, say), choose
`SharedMemory` or `FileSystem`: they spawn a fresh interpreter (the dataset must pickle;
FileSystem goes through a temporary file, which suits very large datasets). `ForkServer`
forks from a clean server process.
"""
from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import pickle
import tempfile
import weakref
from collections import deque
from collections.abc import Iterable
from typing import Any, Protocol, TypedDict

import torch
import torch.multiprocessing  # noqa: F401 - registers tensor pickling through shared memory

from pipetorch.data.fetch import LoaderStats
from pipetorch.data.loader_pipe import LoaderPipe
from pipetorch.data.producer import LoaderSettings, run_loader
from pipetorch.data.ring_buffer import Msg, SlotSizes, pin, unpin
from pipetorch.data.sampling import length_of, rebatched_length
from pipetorch.data.structure import unflatten
from pipetorch.enums import SharingStrategy
from pipetorch.errors import LoaderError
from pipetorch import memfd

__all__ = ["AsynchronousDataAccessor"]

logger = logging.getLogger(__name__)

_LIVE: weakref.WeakSet[AsynchronousDataAccessor] = weakref.WeakSet()
_START_METHODS = {SharingStrategy.Fork: "fork", SharingStrategy.ForkServer: "forkserver",
                  SharingStrategy.SharedMemory: "spawn", SharingStrategy.FileSystem: "spawn"}


class CompletionEvent(Protocol):
    """What `release_after` waits for: a torch.cuda.Event, or anything with these two."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class AsyncOptions(TypedDict, total=False):
    """A DataLoader's `async_options`: the AsynchronousDataAccessor arguments it may set."""

    buffer_size: int
    miss_sleep_time_in_ms: float
    load_indefinitely: bool
    early_preload: bool
    sharing_strategy: SharingStrategy | None


def _default_strategy() -> SharingStrategy:
    if "fork" in multiprocessing.get_all_start_methods():
        return SharingStrategy.Fork
    return SharingStrategy.FileSystem


@atexit.register
def _terminate_all() -> None:
    # Registered after multiprocessing's own exit hook, so it runs first: that hook joins
    # every non-daemon child and would wait forever for a loader still running.
    for accessor in list(_LIVE):
        accessor.terminate()


def _check_options(buffer_size: int, miss_sleep_time_in_ms: float, load_indefinitely: bool,
                   early_preload: bool, rebatched_size: int | None) -> None:
    if isinstance(buffer_size, bool) or not isinstance(buffer_size, int) or buffer_size < 1:
        raise ValueError(f"buffer_size must be an int >= 1 (ring-buffer slots), got "
                         f"{buffer_size!r}.")
    if isinstance(miss_sleep_time_in_ms, bool) or not isinstance(
            miss_sleep_time_in_ms, (int, float)) or miss_sleep_time_in_ms < 0:
        raise ValueError(f"miss_sleep_time_in_ms must be a number >= 0, got "
                         f"{miss_sleep_time_in_ms!r}.")
    for name, value in (("load_indefinitely", load_indefinitely),
                        ("early_preload", early_preload)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}.")
    if rebatched_size is not None and (isinstance(rebatched_size, bool) or not isinstance(
            rebatched_size, int) or rebatched_size < 1):
        raise ValueError(f"rebatched_size must be None or an int >= 1, got {rebatched_size!r}.")


def _strategy(value: SharingStrategy | int) -> SharingStrategy:
    try:
        return SharingStrategy(value)
    except ValueError:
        valid = ", ".join(f"SharingStrategy.{s.name}" for s in SharingStrategy)
        raise ValueError(f"sharing_strategy must be one of {valid}; got {value!r}.") from None


class AsynchronousDataAccessor:
    """Iterates `dataset` (any iterable; one pass is one epoch) in a separate process.

    miss_sleep_time_in_ms is accepted for PopTorch compatibility: waits here are woken by
    the pipe as soon as a slot is ready or freed, so there is no polling sleep to tune.
    With rebatched_size, batches are cut and joined to exactly that many items; the last
    partial batch is dropped unless `dataset.rebatched_drop_last` is False.
    """

    def __init__(self, dataset: Iterable[object], *, buffer_size: int = 3,
                 miss_sleep_time_in_ms: float = 0.1, load_indefinitely: bool = True,
                 early_preload: bool = False, sharing_strategy: SharingStrategy | None = None,
                 rebatched_size: int | None = None) -> None:
        self._pipe: LoaderPipe | None = None  # None once terminated (or if __init__ fails)
        if getattr(dataset, "_accessor", None) is not None:
            raise ValueError(
                "The DataLoader already uses an AsynchronousDataAccessor internally. Either "
                "use the existing one or set mode=poptorch.DataLoaderMode.Sync in the "
                "DataLoader.")
        _check_options(buffer_size, miss_sleep_time_in_ms, load_indefinitely, early_preload,
                       rebatched_size)
        strategy = _strategy(sharing_strategy if sharing_strategy is not None
                             else _default_strategy())
        self._dataset = dataset
        self.rebatched_size = rebatched_size
        self.buffer_size = buffer_size
        self.sharing_strategy = strategy
        self.stats = LoaderStats()
        self._keep_partial = not getattr(dataset, "rebatched_drop_last", True)
        self._owner_pid = os.getpid()
        self._views: list[list[torch.Tensor]] | None = None
        self._buffer: torch.Tensor | None = None
        self._held: int | None = None
        self._held_event: CompletionEvent | None = None  # release_after's, for the held slot
        self._releases: deque[tuple[int, CompletionEvent]] = deque()  # slots awaiting events
        self._consumed, self._ended, self._announced = 0, False, False
        self._failure: LoaderError | None = None
        self._temp_file: str | None = None
        settings = LoaderSettings(buffer_size, rebatched_size, self._keep_partial,
                                  load_indefinitely, early_preload, os.getpid())
        self._start(strategy, settings)
        _LIVE.add(self)
        self._wait_started()

    def _wait_started(self) -> None:
        """Wait for the loader's first batch (it shapes the ring), as PopTorch's constructor does.

        A dataset that fails on its first batch is therefore reported here, with PopTorch's
        words ("worker thread failed to start"), rather than at the first `next()`.
        """
        pid = self.pid
        try:
            self._connect()
        except LoaderError as error:
            started = LoaderError(f"The AsynchronousDataAccessor worker thread failed to start "
                                  f"(pipetorch's worker is loader process {pid}): {error}")
            started.__cause__ = error.__cause__
            self._failure = started
            raise started from error.__cause__

    # -- process lifetime -------------------------------------------------------------

    def _start(self, strategy: SharingStrategy, settings: LoaderSettings) -> None:
        context = multiprocessing.get_context(_START_METHODS[strategy])
        payload: Iterable[object] | str = self._dataset
        if strategy == SharingStrategy.FileSystem:
            payload = self._temp_file = self._pickle_to_file()
        conn, child_conn = context.Pipe(duplex=True)
        process = context.Process(  # type: ignore[attr-defined]  # typeshed's BaseContext lacks it
            target=run_loader, args=(payload, child_conn, settings), name="pipetorch-loader",
            daemon=False)
        try:
            process.start()
        except (pickle.PicklingError, TypeError, AttributeError) as error:
            conn.close()
            self._release_buffer()  # the FileSystem temporary file
            raise TypeError(
                f"The dataset could not be sent to the loader process ({error}). "
                f"sharing_strategy={strategy.name} pickles it: make it picklable or use "
                "SharingStrategy.Fork.") from error
        finally:
            child_conn.close()
        self._pipe = LoaderPipe(conn, process)
        # PopTorch's words: scripts (and its tests) read the worker's pid from this line
        logger.debug("AsynchronousDataAccessor worker process: %d (loader process started, %s)",
                     process.pid, strategy.name)

    def _pickle_to_file(self) -> str:
        handle, path = tempfile.mkstemp(prefix="pipetorch-dataset-", suffix=".pkl")
        try:
            with os.fdopen(handle, "wb") as f:
                pickle.dump(self._dataset, f, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as error:
            os.unlink(path)
            raise TypeError(
                f"The dataset could not be pickled for sharing_strategy=FileSystem ({error}): "
                "make it picklable or use SharingStrategy.Fork.") from error
        return path

    def terminate(self) -> None:
        """Stop the loader process and release the ring buffer (safe to call twice)."""
        pipe = self._pipe
        if pipe is None or os.getpid() != self._owner_pid:
            return
        self._pipe = None
        _LIVE.discard(self)
        pipe.stop()
        self._release_buffer()

    def _release_buffer(self) -> None:
        self._wait_releases()  # a copy may still read the buffer
        if getattr(self, "_pinned", False) and self._buffer is not None:
            unpin(self._buffer)
            self._pinned = False
        self._views = None
        self._buffer = None
        if self._temp_file is not None:
            if os.path.exists(self._temp_file):
                os.unlink(self._temp_file)
            self._temp_file = None

    def __del__(self) -> None:
        try:
            self.terminate()
        except Exception:  # noqa: BLE001 - interpreter shutdown may have torn modules down
            pass

    # -- iteration --------------------------------------------------------------------

    def _send(self, kind: Msg, *payload: int) -> None:
        if self._pipe is not None:  # a terminated loader is told nothing
            self._pipe.send(kind, *payload)

    def _receive(self) -> tuple[Any, ...]:
        """The loader's next message; its failure is recorded and stops it (and is raised)."""
        assert self._pipe is not None  # a terminated loader is not read (_check_usable)
        try:
            return self._pipe.receive()
        except LoaderError as error:
            self._failure = error
            self.terminate()
            raise

    def _check_usable(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self._pipe is None:
            raise LoaderError("This asynchronous loader was terminated; create a new one "
                              "(a DataLoader restarts its loader by itself).")

    def _connect(self) -> None:
        if self._views is not None:
            return
        _, layout, tree, address, items = self._receive()
        buffer = memfd.attach(address)
        self._layout, self._tree, self._buffer = layout, tree, buffer
        self._items_per_slot = items
        self._pinned = pin(buffer)
        self._views = [layout.views(buffer, s) for s in range(self.buffer_size)]
        self._send(Msg.ACK)
        if self._temp_file is not None:
            os.unlink(self._temp_file)
            self._temp_file = None

    def __iter__(self) -> AsynchronousDataAccessor:
        self._check_usable()
        self._connect()
        if self._ended:
            self._ended, self._consumed, self._announced = False, 0, False
        elif self._consumed:
            self._reset()
        self._announce()
        return self

    def _announce(self) -> None:
        if not self._announced:
            self._send(Msg.START)
            self._announced = True

    def _reset(self) -> None:
        self._wait_releases()  # the loader refills every slot after a reset
        self._held = None  # every slot is free again after a reset
        self._send(Msg.RESET)
        while self._receive()[0] != Msg.RESET_ACK:
            pass
        self._consumed, self._ended, self._announced = 0, False, True

    def __next__(self) -> Any:
        self._check_usable()
        self._connect()
        if self._ended:
            raise StopIteration
        self._announce()
        self._give_back()
        message = self._receive()
        kind = message[0]
        if kind == Msg.READY:
            return self._take(message[1], message[2])
        if kind == Msg.EPOCH_END:
            self._ended = True
            raise StopIteration
        raise AssertionError(f"unexpected message from the loader process: {message!r}")

    def release_after(self, event: CompletionEvent) -> None:
        """Keep the batch last handed out in its slot until `event` has completed.

        `event` is anything with `query()` (True once done) and `synchronize()`, as
        torch.cuda.Event: record it after a `non_blocking` copy from the batch. Without it
        the slot goes back to the loader process at the next `next()`, while the copy may
        still be reading it.
        """
        if self._held is None:
            raise ValueError("release_after(event) applies to the batch last returned by "
                             "next(); no batch is held now: call it after next(), before the "
                             "following next()")
        self._held_event = event

    def _give_back(self) -> None:
        """Hand the held slot back (or queue it behind its event), then every slot whose event
        has completed; when nothing is ready to read, wait for the oldest event, as the loader
        may be waiting for that slot."""
        if self._held is not None:
            if self._held_event is None:
                self._send(Msg.FREE, self._held)
            else:
                self._releases.append((self._held, self._held_event))
            self._held, self._held_event = None, None
        while self._releases and self._releases[0][1].query():
            self._send(Msg.FREE, self._releases.popleft()[0])
        while self._releases and self._pipe is not None and not self._pipe.has_message():
            slot, event = self._releases.popleft()
            event.synchronize()
            self._send(Msg.FREE, slot)

    def _wait_releases(self) -> None:
        """Wait for every event of a slot not yet handed back (before a reset or unpinning)."""
        if self._held_event is not None:
            self._held_event.synchronize()
            self._held_event = None
        while self._releases:
            self._releases.popleft()[1].synchronize()

    def _take(self, slot: int, sizes: SlotSizes) -> Any:
        assert self._views is not None
        self._held = slot
        self._consumed += 1
        views = self._views[slot]
        items = self._items_per_slot
        if sizes is not None:
            views = [v if n is None else v[:n] for v, n in zip(views, sizes, strict=True)]
            items = next((n for n in sizes if n is not None), None) if items else None
        self.stats.record(views, items=items or 1)
        return unflatten(views, self._tree)

    @property
    def bytes_per_item(self) -> float | None:
        """Bytes per sample of the batches handed out so far (None before the first)."""
        return self.stats.bytes_per_item

    @property
    def pid(self) -> int | None:
        """Process id of the loader process (None once terminated)."""
        return self._pipe.pid if self._pipe is not None else None

    def __len__(self) -> int:
        length = length_of(self._dataset)
        if self.rebatched_size is None:
            return length
        per_batch = (getattr(self._dataset, "combinedBatchSize", None)
                     or getattr(self._dataset, "batch_size", None) or 1)
        return rebatched_length(length * per_batch, self.rebatched_size,
                                drop_last=not self._keep_partial)
