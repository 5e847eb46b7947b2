"""Rounds between the host processes of one pipeline (Distributed.stagesAcrossProcesses).

The processes run one script, so they meet in rounds: the start-up, the start of each call
(its inputs' digests), a call's outputs, a copy of the weights to the host, an upload, a
change of optimiser. Each round is one all-gather over a gloo group of the hosts of a header,
what this process is doing (`Kind`, a call's number), the size of what it sends and a digest
of its inputs, followed by the values when every process's fit in 16 KB; a second
all-gather carries larger values.
torchrun's store sees nothing of this while rounds meet.

Rounds of different kinds meet when a script has one process do what the others do not:
- a copy of the weights to the host on one process only (rank-0 logging, `torch.save` on
  rank 0) meets the others at their next call or read: they send it their stages' weights
  (`serve`) and go on with their own round, so the read is served without their script;
- any other pair cannot be served: every process raises at once, naming what each was doing.
A process that waits over a second in a round says what it is waiting for in the store, and
reads what the others say: one waiting in another model's round (or whose model is
destroyed) is named within seconds. A process that ends is named through its connection
(`peers.Liveness`), with its host, its stages and how it ended.
"""
from __future__ import annotations

import dataclasses
import datetime
import enum
import json
import time
import zlib
from typing import Callable, Sequence, cast

import torch
import torch.distributed as dist

from pipetorch.errors import DeviceError, InputMismatchError
from pipetorch.parallel.comm import stream
from pipetorch.parallel.comm.rendezvous import Rendezvous
from pipetorch.parallel.host import peers
from pipetorch.parallel.host.cross_process import Spread

__all__: list[str] = []

_SLOW = 1.0   # seconds in a round before a process says in the store what it waits for
_LOOK = 0.2   # seconds between looks at the store and the connections after that
# the longest pause between looks at a round's all-gather before that: a round mostly waits
# while the workers are idle (before a call, after its replies), so a look costs them little,
# and a call of width 512 over 2 processes spent 2.4 ms in its outputs' round at 1 ms
_NAP = 0.0002


class Kind(enum.IntEnum):
    """What a host process is doing in a round."""

    START_UP = 1
    CALL = 2        # starting a call; its number and its inputs' digest in the header
    OUTPUTS = 3     # a call's outputs, to every process
    READ = 4        # a copy of the weights to the host
    MAPPING = 5     # after writing a mapped model's files
    UPLOAD = 6      # the host copy's weights to the workers
    OPTIMIZER = 7   # setOptimizer's hyper-parameters to the workers
    SERVE = 8       # (in a read's second all-gather) the weights a peer read


# bytes of a round's first all-gather: the header (5 int64), then the values when every
# process's fit (a call's outputs, mostly): one all-gather of the round's two saved, 0.7 ms of
# a call of width 512 over 2 processes, where 16 KB cost no more than 40 bytes on gloo
_HEAD, _OPENING = 40, 16 << 10
_SERVABLE = 1  # flags: a read the others can serve (weights only, no files to write)
_NAMES = {Kind.START_UP: "the start-up", Kind.CALL: "call {n}",
          Kind.OUTPUTS: "the outputs of call {n}",
          Kind.READ: "a copy of the weights to the host (copyWeightsToHost, state_dict, a save)",
          Kind.MAPPING: "mapping the saved weights", Kind.UPLOAD: "an upload of the weights "
          "(copyWeightsToDevice, load_state_dict)", Kind.OPTIMIZER: "setOptimizer"}


def digest(tensors: Sequence[torch.Tensor]) -> int:
    """A 31-bit checksum of tensors' values, dtypes and shapes."""
    value = 0
    for tensor in tensors:
        data = tensor.detach().cpu().contiguous()
        value = zlib.crc32(f"{data.dtype}{tuple(data.shape)}".encode(), value)
        value = zlib.crc32(data.view(-1).view(torch.uint8).numpy().data, value)
    return value & 0x7FFFFFFF


class HostLink:
    """The rounds of one model's host processes; `serve` gives this process's stages'
    weights for a peer's read."""

    def __init__(self, meeting: Rendezvous, layout: Spread, timeout: float) -> None:
        self.layout, self.timeout = layout, timeout
        self.name = f"process {layout.process} of {layout.processes}"
        self.serve: Callable[[], object] | None = None
        self._id = meeting.prefix  # this model's launch: its keys and its rounds
        self._wait_for = datetime.timedelta(seconds=timeout)
        client = dist.TCPStore(meeting.address, meeting.port, is_master=False,
                               timeout=self._wait_for)
        self._store = dist.PrefixStore(self._id + "hosts/", client)
        self._doing = dist.PrefixStore("pipetorch/doing/", client)  # what each waits for
        self._liveness = peers.Liveness(layout.process, meeting.address)
        self._who: dict[int, peers.Identity] = {}
        self._group: dist.ProcessGroup | None = None
        self._failed = False
        self._calls = 0

    # -- rounds ----------------------------------------------------------------------------
    def start(self) -> None:
        """Meet every process (waiting for each up to the timeout), join their gloo group and
        connect to each."""
        me = self.layout.process
        self._store.set(f"who/{me}", json.dumps(dataclasses.asdict(self._liveness.me)))
        deadline = time.monotonic() + self.timeout
        while not self._store.check([f"who/{q}" for q in range(self.layout.processes)]):
            self.check()
            if time.monotonic() > deadline:
                raise self._silent("the start-up", [q for q in self._others()
                                                    if not self._store.check([f"who/{q}"])])
            time.sleep(0.01)
        self._who = {q: peers.Identity.parse(self._store.get(f"who/{q}").decode())
                     for q in range(self.layout.processes)}
        try:
            # a gloo backend serves collectives as a group does; torch's stubs give it none
            self._group = dist.ProcessGroupGloo(  # type: ignore[assignment]  # a backend, used as a group
                dist.PrefixStore("group/", self._store), me, self.layout.processes,
                self._wait_for)
            self._liveness.connect([self._who[q] for q in self._others()], self.timeout)
        except (RuntimeError, OSError, dist.DistError) as exc:
            self.check()
            raise self._broken("the start-up", exc) from None
        self._round(Kind.START_UP, None)

    def broadcast(self, tensors: Sequence[torch.Tensor]) -> None:
        """Process 0's values of `tensors` in every process's, in place, one at a time."""
        assert self._group is not None
        options = dist.BroadcastOptions()
        options.rootRank = 0
        with torch.no_grad():
            for tensor in tensors:
                sent = tensor if tensor.is_contiguous() else tensor.contiguous()
                try:
                    self._group.broadcast([sent], options).wait(self._wait_for)
                except RuntimeError as exc:
                    raise self._broken("sharing process 0's initial weights", exc) from None
                if sent is not tensor:
                    tensor.copy_(sent)

    def call(self, inputs: Sequence[tuple[str, Sequence[torch.Tensor]]]) -> None:
        """The start of a call: the same inputs (by name, each micro-batch's tensors) on every
        process, else InputMismatchError on every process, naming them; a peer's read is
        served first."""
        self._calls += 1
        sums = [(name, digest(tensors)) for name, tensors in inputs]
        total = zlib.crc32(repr([s for _, s in sums]).encode()) & 0x7FFFFFFF
        theirs = self._round(Kind.CALL, sums, check=total)
        if theirs:
            raise self._mismatch(sums, cast(dict[int, list[tuple[str, int]]], theirs))

    def exchange(self, kind: Kind, value: object, *, servable: bool = False
                 ) -> dict[int, object]:
        """Send `value` to every other process; theirs, by process."""
        return self._round(kind, value, flags=_SERVABLE if servable else 0)

    def mark(self, kind: Kind) -> None:
        """A round without values (an upload, setOptimizer): every process does it, or all
        raise."""
        self._round(kind, None)

    def check(self) -> None:
        """Raise if another process has failed and said so."""
        for q in self._others():
            message = self._heard(self._store, f"failed/{q}")
            if message:
                raise DeviceError(f"{self._named(q).capitalize()} failed: {message}")

    def fail(self, message: str) -> None:
        """Tell the other processes this one failed (once)."""
        if not self._failed:
            self._failed = True
            self._say(self._store, f"failed/{self.layout.process}", message)

    def close(self) -> None:
        """This model is destroyed here: a peer still waiting in one of its rounds is told."""
        self._say(self._store, f"destroyed/{self.layout.process}", "destroyed")
        self._liveness.close()

    # -- the round -------------------------------------------------------------------------
    def _round(self, kind: Kind, value: object, *, check: int = 0, flags: int = 0
               ) -> dict[int, object]:
        """One round: each process's opening (its header, and its values when every one fits),
        then the values in a second all-gather where some did not fit. With `check` (a call's
        digest), the values are read only when the digests differ."""
        data = stream.dumps(value) if value is not None else b""
        what = self._describe(kind, self._calls)
        while True:
            head = torch.tensor([kind, len(data), check, self._calls, flags]).view(torch.uint8)
            fits = len(data) <= _OPENING - _HEAD
            opening = _padded(head.numpy().tobytes() + (data if fits else b""), _OPENING)
            openings = self._all_gather_list(opening, what)
            heads = [o[:_HEAD].view(torch.int64).tolist() for o in openings]
            kinds = {h[0] for h in heads}
            if kinds == {kind}:
                if kind == Kind.CALL and len({h[2] for h in heads}) == 1:
                    return {}
                sizes = [h[1] for h in heads]
                if max(sizes) > _OPENING - _HEAD:
                    return self._values(data, sizes, what)
                return self._unpickled(openings, sizes, at=_HEAD)
            readers = [q for q, h in enumerate(heads) if h[0] == Kind.READ]
            if not (kinds <= {Kind.READ, Kind.CALL} and all(heads[q][4] & _SERVABLE
                                                             for q in readers)):
                raise self._out_of_step(heads)
            if kind == Kind.READ:  # the others serve this read
                return self._values(data, None, what)
            assert self.serve is not None, "a process of a pipeline serves reads"
            self._values(stream.dumps(self.serve()), None, f"serving a read of process "
                         f"{readers[0]}")  # then this process's own round again

    def _values(self, data: bytes, sizes: list[int] | None, what: str) -> dict[int, object]:
        """Every other process's bytes of this round, unpickled (`sizes`: each one's, when the
        headers carried them)."""
        if sizes is None:
            sizes = [int(s) for s in self._all_gather(torch.tensor([len(data)]), what)]
        return self._unpickled(self._all_gather_list(_padded(data, max(sizes)), what), sizes)

    def _unpickled(self, parts: list[torch.Tensor], sizes: list[int], *, at: int = 0
                   ) -> dict[int, object]:
        """The other processes' values: `sizes[q]` bytes of `parts[q]` from byte `at`."""
        return {q: stream.loads(parts[q][at:at + sizes[q]].numpy().tobytes())
                for q in self._others() if sizes[q]}

    def _all_gather(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        return torch.stack(self._all_gather_list(tensor, what))

    def _all_gather_list(self, tensor: torch.Tensor, what: str) -> list[torch.Tensor]:
        """Every process's `tensor` (all the same shape), in process order; a process that
        fails, ends, waits elsewhere or stays silent raises here."""
        assert self._group is not None
        out = [torch.empty_like(tensor) for _ in range(self.layout.processes)]
        work = self._group.allgather([out], [tensor])
        start, pause, said = time.monotonic(), 0.00005, False
        while not work.is_completed():
            waited = time.monotonic() - start
            if waited > _SLOW:
                if not said:
                    said = True
                    self._say(self._doing, str(self.layout.process), f"{self._id}|{what}")
                self._look(what, waited)
            time.sleep(pause)  # a round's lag is the slower process's work: wake soon after
            pause = min(2 * pause, _NAP if waited < _SLOW else _LOOK)
        try:
            work.wait()
        except RuntimeError as exc:  # a process ended: its notice, else its connection
            raise self._broken(what, exc) from None
        finally:
            if said:
                self._say(self._doing, str(self.layout.process), "")
        return out

    def _look(self, what: str, waited: float) -> None:
        """While a round waits: a failed, ended or elsewhere-waiting process raises; silence
        raises after the timeout."""
        self.check()
        if self._liveness.gone():
            raise self._broken(what, None)
        for q in self._others():
            link, _, theirs = self._heard(self._doing, str(q)).partition("|")
            if link and link != self._id:
                raise DeviceError(
                    f"This process is waiting in {what} of one model while "
                    f"{self._named(q)} waits in {theirs} of another model: every process "
                    "of a pipeline must run the same calls and reads of each model, in one "
                    "order")
            if self._heard(self._store, f"destroyed/{q}"):
                raise DeviceError(
                    f"This process is waiting in {what}, but {self._named(q)} has destroyed "
                    "this model (destroy(), or its end): read or call a pipeline's model on "
                    "every process before any destroys it")
        if waited > self.timeout:
            raise self._silent(what, [q for q in self._others()
                                      if not self._heard(self._doing, str(q))]
                               or self._others())

    # -- errors ----------------------------------------------------------------------------
    def _out_of_step(self, heads: list[list[int]]) -> DeviceError:
        doing = "; ".join(f"process {q} ({self._where(q)}) is at "
                          f"{self._describe(Kind(h[0]), h[3])}" for q, h in enumerate(heads))
        unserved = any(h[0] == Kind.READ and not h[4] & _SERVABLE for h in heads)
        return DeviceError(
            f"The processes of this pipeline are out of step: {doing}. Every process runs the "
            "same calls, uploads and setOptimizer of a model in one order (a copy of the "
            "weights to the host on one process only is served at the others' next call"
            + ("; but not one of the optimiser state or of a mapped model's files, which "
               "every process must read together)" if unserved else ")"))

    def _mismatch(self, sums: list[tuple[str, int]], theirs: dict[int, list[tuple[str, int]]]
                  ) -> InputMismatchError:
        differ = {name for values in theirs.values() for (name, s), (_, mine) in
                  zip(values, sums, strict=True) if s != mine}
        return InputMismatchError(
            f"Call {self._calls}'s inputs {sorted(differ)} differ between the processes of this "
            f"pipeline (this is {self.name}): every process must feed the same inputs, as "
            "stage 0 reads one process's and the last stage another's. Likely causes: a "
            "DataLoader that is not poptorch.DataLoader or shuffles from a per-rank seed, a "
            "rank-dependent transform, or tensors made on each process from its own random "
            "numbers. Nothing was trained")

    def _broken(self, what: str, exc: Exception | None) -> DeviceError:
        """The error for a round that broke: a process's notice, else the one that ended."""
        deadline = time.monotonic() + 2.0
        while True:
            try:
                self.check()
            except DeviceError as notice:
                return notice
            gone = self._liveness.gone(wait=0.2)
            if gone or time.monotonic() > deadline:
                break
        detail = f" ({str(exc).splitlines()[0]})" if exc is not None else ""
        return DeviceError(self.departed(gone, what) if gone else
                           f"The link to {self._named_all(self._others())} broke during "
                           f"{what}{detail}")

    def departed(self, gone: list[int] | None = None, what: str = "this call") -> str:
        """'process 1 of 2 (pid N on H, running stage(s) [1]) was killed by SIGKILL during
        ...' for the processes that ended (those found now when `gone` is None); "" if none."""
        gone = self._liveness.gone(wait=1.0) if gone is None else gone
        return "; ".join(f"{self._named(q).capitalize()} {peers.ending(self._who[q])} during "
                         f"{what}" for q in gone if q in self._who)

    def _silent(self, what: str, missing: list[int]) -> DeviceError:
        return DeviceError(
            f"{self._named_all(missing).capitalize()} sent nothing for {what} within "
            f"{self.timeout:.0f}s (PIPETORCH_TIMEOUT): it stopped answering, never joined, or "
            "did not reach this point of the script; every process of one pipeline must run "
            "the same calls and reads")

    def _describe(self, kind: Kind, number: int) -> str:
        return _NAMES.get(kind, kind.name.lower()).format(n=number)

    def _where(self, q: int) -> str:
        who = self._who.get(q)
        return (f"{who}, " if who else "") + f"running stage(s) {self.layout.stages_of(q)}"

    def _named(self, q: int) -> str:
        return f"process {q} of {self.layout.processes} ({self._where(q)})"

    def _named_all(self, processes: list[int]) -> str:
        return " and ".join(self._named(q) for q in processes)

    def _others(self) -> list[int]:
        return [q for q in range(self.layout.processes) if q != self.layout.process]

    @staticmethod
    def _say(store: dist.Store, key: str, message: str) -> None:
        try:
            store.set(key, message)
        except Exception:  # the store's process is gone: the others see that themselves
            pass

    @staticmethod
    def _heard(store: dist.Store, key: str) -> str:
        """The value at `key`, "" when unset or the store is gone (process 0 ended: the
        connections then name it)."""
        try:
            return store.get(key).decode() if store.check([key]) else ""
        except Exception:
            return ""


def _padded(data: bytes, size: int) -> torch.Tensor:
    """`data` at the start of `size` bytes of zeros: what an all-gather of equal shapes sends."""
    padded = torch.zeros(size, dtype=torch.uint8)
    if data:
        padded[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return padded
