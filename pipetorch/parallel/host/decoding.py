"""The host side of generate() on a HuggingFace model split over worker processes:
HuggingFace's generation loop (sampling, stopping, padding) runs in the user's process, and
each forward it calls runs in the stages, where every worker keeps the key/value cache of its
own layers (parallel.generation.lanes). The model's code goes to the workers once, then each step
goes out with a ticket and the replies are read back in order.

Each forward's batch is cut into lanes (deviceIterations x replicationFactor of them, at
most one per sequence; one per replica where lanes would hold fewer than FEW_ROWS
sequences): lane i runs on replica i % replicationFactor, and a replica's stages run its
lanes one after another, so its devices work on different lanes at once. In greedy decoding
each lane runs its own loop; its steps wait while the replica has a step in flight per
device, and the lanes waiting with steps alike go as one batch (continuous batching).
"""
from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import threading
import time
from multiprocessing.connection import wait
from typing import Any, Callable, Hashable, Iterator, Protocol, Sequence

import cloudpickle
import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from pipetorch import environment
from pipetorch.errors import CompileError
from pipetorch.parallel.generation import kv_cache
from pipetorch.parallel.comm import messages as m
from pipetorch.parallel.comm import stream
from pipetorch.parallel.comm.payloads import LaneCall, Shapes, Skeleton, Step, StepResult
from pipetorch.parallel.generation.lanes import join, rows, skeleton, split
from pipetorch.parallel.comm.wire import WorkerFailed
from pipetorch.parallel.host.workers import WorkerSet
from pipetorch.partition.export import Tree
from pipetorch.partition.strategies import StageSpec

__all__: list[str] = []


class GenerationSession:
    """generate()'s messages to one WorkerSet: the skeleton (kept, to send new workers
    again), then steps, each with a ticket; replies are read in the order sent."""

    def __init__(self, workers: WorkerSet) -> None:
        self.workers = workers
        self.skeleton: Skeleton | None = None  # generate()'s model, once sent
        self.restart()

    def restart(self) -> None:
        """New workers: they owe no replies (and get the skeleton again, if one was sent)."""
        self.tickets = itertools.count()
        self.awaiting: dict[int, collections.deque[int]] = {
            n: collections.deque() for n in range(len(self.workers.pipeline.now.placements))}
        self.replies: dict[int, dict[int, StepResult]] = {}
        self.sending, self.reading = threading.Lock(), threading.Lock()

    def start(self, make: Callable[[], Skeleton]) -> None:
        """Send every worker the model's code without weights (`make()`), bound there to its
        stages' weights (once: the workers keep it)."""
        if self.skeleton is None:
            found = make()
            try:  # before anything is written to a worker's pipe
                cloudpickle.dumps(found)
            except Exception as exc:
                raise CompileError(
                    "generate() sends the model's code (without its weights) to the stage "
                    f"workers, and pickling it failed with {type(exc).__name__}: {exc}. Objects "
                    "that cannot be pickled (a lock, an open file, a generator) cannot cross "
                    "processes: remove them from the model, or generate on one device") from exc
            self.skeleton = found
            self.send_skeleton()

    def send_skeleton(self) -> None:
        if self.skeleton is not None:
            self.workers.broadcast(m.Generator(self.skeleton), "preparing generate()")

    def decode(self, steps: Sequence[Step]) -> list[StepResult]:
        """One generation step of every replica: replica r's workers run `steps[r]`'s lanes
        through its stages; the StepResults of every worker involved."""
        tickets = [self.submit(r, step) for r, step in enumerate(steps) if step.lanes]
        return [result for ticket in tickets for result in self.collect(ticket)]

    def submit(self, replica: int, step: Step) -> int:
        """Send replica `replica`'s workers `step` (they run steps in the order sent, so
        steps from several threads follow one another); its ticket for `collect`."""
        devices = self.workers.devices
        encoded = stream.encode(m.Decode(step))  # pickled once for all the replica's workers
        with self.sending:
            self.workers.check_alive()  # another lane's step may have failed and stopped them
            ticket = next(self.tickets)
            for n in range(replica * devices, (replica + 1) * devices):
                self.workers.send(self.workers.peers[n], encoded)
                self.awaiting[n].append(ticket)
            return ticket

    def collect(self, ticket: int) -> list[StepResult]:
        """The StepResults of a submitted step, each worker's replies read in order (one
        thread at a time; replies to other threads' steps are kept for them).

        Only the last worker's reply wakes this process: the earlier stages' replies arrive
        while the last stage computes, and reading them then would take a core from it (two
        cores, three processes); they are read after it, or when one has been waiting for
        _GLANCE seconds (a failure is reported that soon)."""
        with self.reading:
            self.workers.check_alive()
            owing = [n for n, awaiting in self.awaiting.items() if ticket in awaiting]
            deadline = time.monotonic() + self.workers.timeout
            while owing and ticket in self.awaiting[owing[-1]] and time.monotonic() < deadline:
                if wait([self.workers.peers[owing[-1]].conn], timeout=_GLANCE):
                    self._read(owing[-1])
                for n in owing[:-1]:
                    if self.awaiting[n] and self.workers.peers[n].conn.poll():
                        self._read(n)
            for n in owing:  # (after the deadline, gather's own timeout reports the silence)
                while ticket in self.awaiting[n]:
                    self._read(n)
            replies = self.replies.pop(ticket)
        return [replies[n] for n in sorted(replies)]

    def _read(self, n: int) -> None:
        """Worker `n`'s next reply, to the step it answers."""
        reply = self.workers.gather("a generation step", [self.workers.peers[n]])[0]
        assert isinstance(reply, StepResult)
        self.replies.setdefault(self.awaiting[n].popleft(), {})[n] = reply

    def end(self) -> None:
        """generate() returned: the workers drop their key/value caches."""
        if self.workers.peers and not self.workers.lost:
            self.workers.broadcast(m.Decoded(), "the end of generate()")


_GLANCE = 0.2  # seconds between looks at the earlier stages' pipes while the last computes

_sessions = itertools.count(1)  # one per generate() call: the workers' caches belong to it

# Rows a lane needs to run apart from the others. A stage reads all its weights for each
# lane's step, and a step of a few rows takes as long as those reads: two lanes of two rows
# cost about twice one lane of four. Below FEW_ROWS rows a lane, a replica's rows run as one
# lane (on 2 CPU workers, GPT-2 8 x 512 decoding 4 sequences: 0.64x plain HF as 2 lanes,
# 0.77x as one; 16 sequences: 0.87x as 2 lanes of 8, 0.83x as one).
FEW_ROWS = 4

# generate() arguments asking for what only the whole model sees at once
_WHOLE_MODEL = ("output_attentions", "output_hidden_states")


class Decoder(Protocol):
    """What generate() asks of a process engine (its GenerationSession's calls, each but the
    last after starting new workers where Ctrl-C stopped the last ones)."""

    def start_generation(self, make: Callable[[], Skeleton]) -> None: ...

    def decode(self, steps: Sequence[Step]) -> list[StepResult]: ...

    def end_generation(self) -> None: ...


def generate(model: nn.Module, decoder: Decoder, stages: list[StageSpec], *, replicas: int,
             devices: int, lanes: int, args: tuple, kwargs: dict) -> Any:
    """`model.generate(*args, **kwargs)` with every forward it calls run in `decoder`'s
    stages (`devices` per replica, on each of `replicas`)."""
    _check_supported(model, kwargs)
    stage_of_block = {block: spec.index for spec in stages for block in spec.block_ids}
    decoder.start_generation(lambda: skeleton(model, stage_of_block))
    if rows((args, kwargs)) < FEW_ROWS * lanes:
        lanes = min(lanes, replicas)
    steps = _Steps(decoder, next(_sessions), lanes=lanes, replicas=replicas, devices=devices)
    try:
        with _routed(model, steps):
            if _lanes_apart(model, lanes, args, kwargs):
                return _generate_apart(model, steps, args, kwargs)
            return hf_method(model, "generate")(*args, **kwargs)
    finally:
        decoder.end_generation()


def hf_method(model: nn.Module, name: str) -> Callable[..., Any]:
    """`model`'s method `name`: HuggingFace's (GenerationMixin's), which nn.Module's types
    do not know."""
    return getattr(model, name)


def _check_supported(model: nn.Module, kwargs: dict) -> None:
    """Refuse what needs every layer in one place, or reorders the cache on the host."""
    def setting(name: str) -> Any:
        return _setting(model, kwargs, name)

    for name in _WHOLE_MODEL:
        if setting(name):
            raise ValueError(
                f"generate({name}=True) is not supported through the stages: each stage sees "
                "only its own layers. Generate without it, or on one device")
    searches = {"num_beams": (setting("num_beams") or 1) > 1,
                "assistant_model": kwargs.get("assistant_model") is not None,
                "prompt_lookup_num_tokens": setting("prompt_lookup_num_tokens") is not None,
                "penalty_alpha": (setting("penalty_alpha") or 0) > 0}
    for name, asked in searches.items():
        if asked:
            raise ValueError(
                f"generate({name}=...) rearranges or trims the key/value cache between steps, "
                "which the stages keep apart: greedy decoding and sampling run through the "
                "stages; run this search on one device (poptorch.removeBlocks)")


def _lanes_apart(model: nn.Module, lanes: int, args: tuple, kwargs: dict) -> bool:
    """Whether each lane can run its own generation loop: greedy decoding of a tensor, whose
    rows do not depend on one another (sampling draws for the whole batch at once, so it
    keeps one loop to draw HuggingFace's numbers)."""
    apart = not _setting(model, kwargs, "do_sample") and not _setting(
        model, kwargs, "return_dict_in_generate") and kwargs.get("streamer") is None
    return apart and lanes > 1 and rows((args, kwargs)) > 1


def _setting(model: nn.Module, kwargs: dict, name: str) -> Any:
    """A generation setting: generate()'s argument, else the model's generation_config."""
    return kwargs.get(name, getattr(getattr(model, "generation_config", None), name, None))


def _generate_apart(model: nn.Module, steps: "_Steps", args: tuple, kwargs: dict) -> Any:
    """Greedy generation with each lane's loop in its own thread: a lane's next step goes to
    stage 0 as soon as its token is known, while the other lanes are in later stages."""
    calls = _lanes((args, kwargs), steps.lanes)
    found: dict[int, Any] = {}
    failed: list[BaseException] = []

    def run(lane: int, call: tuple[tuple, dict]) -> None:
        _current.lane = lane
        try:
            found[lane] = hf_method(model, "generate")(*call[0], **call[1])
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            failed.append(exc)
        finally:
            steps.gate.leave(lane)

    steps.gate.lanes.update(range(len(calls)))
    threads = [threading.Thread(target=run, args=(lane, call), name=f"pipetorch-lane-{lane}",
                                daemon=True) for lane, call in enumerate(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failed:  # the failing worker's own error, not another lane's finding the workers gone
        raise next((exc for exc in failed if isinstance(exc, WorkerFailed)), failed[0])
    return _padded([found[lane] for lane in range(len(calls))], _pad_token(model, kwargs))


def _pad_token(model: nn.Module, kwargs: dict) -> int:
    """What HuggingFace writes after a sequence's end: pad_token_id, else the end token."""
    pad = _setting(model, kwargs, "pad_token_id")
    if pad is None:
        pad = _setting(model, kwargs, "eos_token_id")
    if isinstance(pad, (list, tuple)):
        pad = pad[0]
    return 0 if pad is None else int(pad)


def _padded(parts: list[torch.Tensor], pad: int) -> torch.Tensor:
    """The lanes' sequences as one batch: a lane whose sequences all ended early is padded
    to the longest, as HuggingFace pads a sequence that ended before the others."""
    longest = max(part.shape[1] for part in parts)
    return torch.cat([torch.nn.functional.pad(part, (0, longest - part.shape[1]), value=pad)
                      for part in parts])


class _Current(threading.local):
    lane: int | None = None  # the lane whose generation loop runs in this thread


_current = _Current()


class _Failed:
    """What a lane's thread raises when the step another thread sent for it failed."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class _Gate:
    """Greedy lanes' steps waiting for their replica's stages: a step goes while the replica
    has fewer steps in flight than devices, with the waiting lanes whose steps are alike (the
    same shapes but for their rows), up to an even share of the replica's lanes per step."""

    def __init__(self, replicas: int, devices: int) -> None:
        self.replicas, self.devices = replicas, devices
        self.lanes: set[int] = set()  # lanes whose loops still run
        self.waiting: dict[int, tuple[Hashable, Any]] = {}  # lane -> (its step's kind, call)
        self.flying: set[int] = set()  # lanes whose step is in flight
        self.sending = collections.Counter[int]()  # replica -> its steps in flight
        self.last: dict[int, Hashable] = {}  # lane -> the kind of its last step sent
        self.partners: dict[int, set[int]] = {}  # lane -> the other lanes of its last batch
        self.results: dict[int, Any] = {}  # outputs for lanes another thread sent
        self.changed = threading.Condition()

    def run(self, lane: int, alike: Hashable | None, call: LaneCall,
            send: Callable[[dict[int, LaneCall]], dict[int, Tree]]) -> Tree:
        """`lane`'s output for `call`: sent by this thread with the lanes joining it, or by
        the thread of a lane it joined. `alike`: None where it runs alone."""
        timeout = environment.get("timeout")
        with self.changed:
            self.waiting[lane] = (alike, call)
            while (group := self._group(lane)) is None:
                if lane in self.results:
                    out = self.results.pop(lane)
                    if isinstance(out, _Failed):
                        raise out.error
                    return out
                if not self.changed.wait(timeout):
                    raise WorkerFailed(f"Lane {lane}'s generation step waited {timeout:.0f}s "
                                       "for the stages; raise PIPETORCH_TIMEOUT if legitimate")
            self.last.update((n, alike) for n in group)
            self.partners.update((n, set(group) - {n}) for n in group)
            calls = {n: self.waiting.pop(n)[1] for n in group}
            self.flying.update(group)
            self.sending[lane % self.replicas] += 1
        outputs: dict[int, Any] = {}
        try:
            outputs = send(calls)
        except BaseException as exc:
            outputs = {n: _Failed(exc) for n in calls}
            raise
        finally:
            with self.changed:
                self.sending[lane % self.replicas] -= 1
                for n in calls:
                    self.flying.discard(n)
                    if n != lane:
                        self.results[n] = outputs[n]
                self.changed.notify_all()
        return outputs[lane]

    def leave(self, lane: int) -> None:
        """`lane`'s loop ended: the others stop waiting for its steps."""
        with self.changed:
            self.lanes.discard(lane)
            self.changed.notify_all()

    def _group(self, lane: int) -> list[int] | None:
        """The lanes to send with `lane`'s step now (None: not yet, or not by this thread)."""
        replica = lane % self.replicas
        if lane not in self.waiting or self.sending[replica] >= self.devices:
            return None
        alike = self.waiting[lane][0]
        if alike is None:
            return [lane]
        mine = [n for n in self.lanes if n % self.replicas == replica]
        share = -(-len(mine) // self.devices)
        partners = self.partners.get(lane, set())
        # lanes in their own loop's code that may join it soon: those of its last batch, or
        # (before its first) those alike at their last step; while one may, it waits for them
        coming = [n for n in mine if n not in self.waiting and n not in self.flying and (
            n in partners if partners else self.last.get(n) == self.last.get(lane))]
        group = [lane, *sorted(n for n in self.waiting if n != lane and n % self.replicas ==
                               replica and self.waiting[n][0] == alike and (
                                   n in partners or not (partners and coming)))][:share]
        return group if len(group) >= share or not coming else None


class _Steps:
    """Runs one forward call of the generation loop in the stages: all lanes of the batch,
    or (in a lane's own thread) that lane."""

    def __init__(self, decoder: Decoder, session: int, *, lanes: int, replicas: int,
                 devices: int) -> None:
        self.decoder, self.session, self.lanes = decoder, session, lanes
        self.replicas = replicas
        self.shapes: dict[int, Shapes] = {}  # lane -> its cache's layers, all workers
        self.cached: set[int] = set()  # lanes whose workers hold their cache
        self.gate = _Gate(replicas, devices)

    def __call__(self, path: str, args: tuple, kwargs: dict) -> Any:
        host_cache = kv_cache.find((args, kwargs))
        call = kv_cache.strip((args, kwargs))
        lane = _current.lane
        if lane is not None:
            lengths = sorted((key, shape[1:]) for key, (shape, _) in self.shapes.get(
                lane, {}).items())  # the lane's cache in the workers, but for its rows
            alike = (path, _signature(call), tuple(lengths)) if kv_cache.joinable(
                [] if host_cache is None else [host_cache]) else None
            out = self.gate.run(lane, alike, call, lambda calls: self._run(
                calls, path, host_cache, batched=len(calls) > 1))
            return kv_cache.fill(out, host_cache)
        calls = _lanes(call, self.lanes)
        outputs = self._run(dict(enumerate(calls)), path, host_cache)
        return kv_cache.fill(join([outputs[lane] for lane in range(len(calls))], least_dim=1), host_cache)

    def _run(self, calls: dict[int, LaneCall], path: str, host_cache: kv_cache.Cache | None, *,
             batched: bool = False) -> dict[int, Tree]:
        """Each lane's call on its replica (lane % replicas); their outputs by lane."""
        replicas = self.replicas
        # a lane's workers copy the (empty) host cache once, at its first step with one
        fresh = host_cache is not None and not self.cached.issuperset(calls)
        if host_cache is not None:
            self.cached.update(calls)
        steps = [Step(self.session, path, mine, {i: self.shapes.get(i, {}) for i in mine},
                      template=host_cache if fresh else None, batched=batched)
                 for mine in ({lane: c for lane, c in calls.items() if lane % replicas == r}
                              for r in range(replicas))]
        outputs: dict[int, Any] = {}
        for result in self.decoder.decode(steps):
            outputs.update(result.outputs)
            for lane, shapes in result.shapes.items():
                self.shapes.setdefault(lane, {}).update(shapes)
        return outputs


def _signature(call: LaneCall) -> Hashable:
    """What lanes' calls must share to run as one batch: all but their rows."""
    leaves, spec = pytree.tree_flatten(call, is_leaf=kv_cache.is_cache_or_slot)
    return str(spec), tuple(
        (tuple(v.shape[1:]), v.dtype) if isinstance(v, torch.Tensor) and v.dim() >= 2
        else tuple(v.tolist()) if isinstance(v, torch.Tensor) else repr(v) for v in leaves)



def _lanes(call: LaneCall, lanes: int) -> list[LaneCall]:
    """The call's arguments for each lane: the batch's rows in `lanes` groups (at most one per
    row), every tensor of the batch cut there (a 1-d tensor, such as cache_position, is the
    same for every row)."""
    batch = rows(call)
    if min(batch, lanes) == 1:
        return [call]
    parts = torch.arange(batch).tensor_split(min(batch, lanes))
    return split(call, [len(part) for part in parts])


@contextlib.contextmanager
def _routed(model: nn.Module, steps: _Steps) -> Iterator[None]:
    """While generate() runs: the model's forward, and its encoder's for an encoder-decoder
    model (HuggingFace calls the encoder once, itself), go to the stages."""
    targets = {"": model}
    encoder = (hf_method(model, "get_encoder")()
               if getattr(model.config, "is_encoder_decoder", False) else None)
    if encoder is not None:
        targets.update((name, m) for name, m in model.named_modules() if m is encoder)
    own = {path: module.__dict__.get("forward") for path, module in targets.items()}
    for path, module in targets.items():
        module.forward = _forward(module.forward, path, steps)
    try:
        yield
    finally:
        for path, module in targets.items():
            if (forward := own[path]) is None:
                del module.forward
            else:
                module.forward = forward


def _forward(original: Callable[..., object], path: str, steps: _Steps) -> Callable[..., Any]:
    # generate() reads forward's signature to decide what it passes (position_ids): keep it
    @functools.wraps(original)
    def in_stages(*args: object, **kwargs: object) -> Any:
        return steps(path, args, kwargs)

    return in_stages
