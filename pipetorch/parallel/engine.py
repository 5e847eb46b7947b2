"""The host side of multi-device execution: one worker per logical device and replica.

A worker runs every stage placed on its device (ipus 0, 1, 0: the worker of device 0 runs
stages 0 and 2). A host call is one round trip: the host sends each worker the inputs its
stages read (its replica's D x G micro-batches at once), the workers run their schedules (all
device iterations) talking to each other directly, summing gradients over the replicas before
each optimiser step, and each sends back the outputs the host asked for.

    user process ---- run(inputs, scale, wanted) ---->  device 0 <-> device 1 <-> ... (p2p)
                 <--- outputs, per-stage trace spans --  every device of every replica

The engine keeps a host copy of the model and optimiser (`model`, `optimizer`): `pull` fills
them from the workers, `push` sends the host copy's weights to the workers. A weight tied
across devices has a copy on each (`parallel.tied`): `push` sends it to each, and `pull`
writes the host's one Parameter from each of them, the copies being equal.
"""
from __future__ import annotations

import collections
import copy
import dataclasses
import itertools
import logging
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections import defaultdict
from multiprocessing.connection import Connection
from typing import Any, Callable, Sequence

import cloudpickle
import torch
import torch.nn as nn

from pipetorch import environment
from pipetorch.errors import CompileError, DeviceError
from pipetorch.parallel import generation, placement as places
from pipetorch.parallel import arena, cross_process, exits, pool, resident, shm, signatures, wire
from pipetorch.weights import mapped, snapshot
from pipetorch.weights.points import Points
from pipetorch.parallel.compile_plan import CompilePlan
from pipetorch.parallel.rendezvous import next_rendezvous
from pipetorch.parallel.routes import Constant, Route, TensorSpec
from pipetorch.weights.shared import SharedWeights
from pipetorch.parallel.stage import Call, DeviceStage, Span, Trace
from pipetorch.parallel.tied import stepped_elsewhere, ties_of
from pipetorch.parallel.worker import Launch, Setup
from pipetorch.partition.split import Source, StagedModel, map_leaves
from pipetorch.schedule.devices import choose as choose_schedule, runs

# Ticks per micro-batch for "auto": forward, input gradient and weight gradient alike, and a
# whole backward 8 where the two parts take 10 (benchmarks/pipeline.py, seed CNN on CPU:
# B + W ran about 1.2x 1F1B's backward, as a convolution's two gradients share work).
_SPLIT_COSTS = dict(forward=5, backward=5, weight=5, whole=8)
from pipetorch.parallel.local import Batching, reduction_multiplier
from pipetorch.parallel.outputs import OutputCollector
from pipetorch.tracebacks import HINTS, error_kind, user_line_in

__all__: list[str] = []

logger = logging.getLogger(__name__)

_STOP_GRACE = 5.0  # seconds a worker gets to stop before it is killed


def stage_optimizer(optimizer: torch.optim.Optimizer, module: nn.Module,
                    elsewhere: Sequence[nn.Parameter] = ()) -> torch.optim.Optimizer:
    """`optimizer` restricted to `module`'s parameters but those stepped `elsewhere` (a tied
    weight's later devices), to send to their worker; groups keep their order. Parameters and
    state tensors are the optimiser's own objects (sending copies them), so the host holds no
    second copy of any stage's state."""
    own = {id(p) for p in module.parameters()} - {id(p) for p in elsewhere}
    shell = copy.copy(optimizer)  # the other stages' groups and state are never copied
    shell.param_groups = [{**g, "params": [p for p in g["params"] if id(p) in own]}
                          for g in optimizer.param_groups]
    shell.state = defaultdict(dict, {p: s for p, s in optimizer.state.items() if id(p) in own})
    shared = {id(t): t for g in shell.param_groups for t in g["params"]}
    shared.update({id(t): t for s in shell.state.values() for t in s.values()
                   if isinstance(t, torch.Tensor)})
    return copy.deepcopy(shell, shared)


class ProcessEngine:
    """Runs host calls on one worker process per logical device and replica.

    Workers are ordered replica-major, as `placements`: `peers[r * devices + d]` is device d
    of replica r; `owners[s]` is the device of stage s.
    """

    def __init__(self, model: nn.Module, plan: CompilePlan, *, batching: Batching,
                 optimizer: torch.optim.Optimizer | None, process: tuple[int, int] = (0, 1),
                 seed: int | None = None, writer: mapped.Writer | None = None,
                 sharding: int | None = None, across: bool = False) -> None:
        assert plan.graphs is not None, "stage workers run the plan's stage graphs"
        staged, routes, specs = plan.graphs.staged, plan.graphs.routes, plan.graphs.specs
        schedule, placements = plan.schedule, plan.placements
        self.plan = plan  # what compiling decided; the fields below change as the engine runs
        self.model, self.optimizer, self.batching = model, optimizer, batching
        self.writer = writer  # where copies to the host of a mapped model's weights go
        self.process_id, self.num_processes = process
        self.replicas = batching.replication_factor  # this process's replicas
        self.points = Points()  # which point of training each copy holds
        # replicated tensor sharding (parallel.sharded_step): the minimum elements of a
        # sliced weight and the replicas sharing the state out; None when off
        self.sharding = ((sharding, self.replicas) if sharding is not None and optimizer
                         is not None and self.replicas > 1 else None)
        self._shared: SharedWeights | None = None  # this launch's weights in shared memory
        self._snapshots = snapshot.SnapshotPolicy(environment.get("snapshots"))
        # randomSeed, else torch's (so torch.manual_seed repeats runs; the user's stream of
        # random numbers is left as it is)
        self.seed = seed if seed is not None else torch.initial_seed()
        self.staged, self.routes = staged, list(routes)
        # every input signature's stages (Options.inputSignatures); the workers start with
        # signature 0's, which carry the weights, and run `self.signature`'s
        self._signatures: list[tuple[StagedModel, list[Route], dict]] = [
            (staged, self.routes, specs)]
        self.signature = 0
        self.input_device = torch.device("cpu")
        self.last_trace: list[Trace] = []
        # stage -> its worker's peak: the CUDA allocator's on a GPU, resident memory on a CPU
        self.peak_memory: dict[int, int] = {}
        self.timeout = environment.get("timeout")
        self.specs, self.placements = specs, list(placements)
        # Distributed.stagesAcrossProcesses: this process runs its own devices' workers only,
        # and exchanges outputs and weights with the others (parallel.cross_process)
        self.spread = (cross_process.spread(placements, plan.owners, process=process[0],
                                            processes=process[1]) if across else None)
        if self.spread is not None:
            self.placements = cross_process.local_placements(placements, self.spread)
        self._hosts: cross_process.HostLink | None = None
        self.devices = len(self.placements) // self.replicas  # workers per replica
        self.owners = plan.owners
        self.auto = schedule == "auto"  # Training.pipelineSchedule("auto"): the simulator
        self.predicted_bubble: float | None = None  # picks, again after the first call
        self._measured = False
        if self.auto:
            schedule = self._choose(_SPLIT_COSTS)
        elif runs(schedule, self.owners, batching.gradient_accumulation) != schedule:
            logger.warning(
                "pipelineSchedule(%r) needs the stages round-robin over the devices, several "
                "each (ipus 0,1,0,1), and G a multiple of G // devices; stage devices %s, G %d: "
                "running %s", schedule, list(self.owners), batching.gradient_accumulation,
                runs(schedule, self.owners, batching.gradient_accumulation))
            schedule = runs(schedule, self.owners, batching.gradient_accumulation)
        self.schedule = schedule
        self.ties = ties_of(model, staged, self.owners)  # weights held on several devices
        self._lost: str | None = None
        self._interrupted = False  # Ctrl-C stopped the workers; the next use starts new ones
        self._folder = tempfile.mkdtemp(prefix="pipetorch-")
        self.peers: list[wire.Peer] = []
        self._segments: list[str] = []  # each launch's shared-memory name prefix
        self._finalizer = weakref.finalize(self, _shutdown, self.peers, self._folder,
                                           segments=self._segments)
        self._skeleton: generation.Skeleton | None = None  # generate()'s model, once sent
        self._launch()

    def _launch(self) -> None:
        """Start a worker per device and replica with the host copy's weights and optimiser
        state."""
        spread = self.spread
        meeting = next_rendezvous(process_id=self.process_id, num_processes=self.num_processes,
                                  devices=len(spread.ipus) if spread else self.devices,
                                  replicas=self.replicas, timeout=self.timeout,
                                  across=spread is not None)
        if spread is not None:  # every process is there before any starts workers
            self._hosts = cross_process.HostLink(meeting, spread, self.timeout)
            self._across("start-up", None)
        self._segments.append(shm.segment_prefix(os.getpid(), meeting.prefix))
        devices = tuple(p.device for p in self.placements)
        keep = self.optimizer is not None and self._snapshots.setting != "0"
        shares = self._share_weights(keep)
        # a training engine sharing its weights keeps a restore point from the start
        start_snapshot = keep and self._shared is not None
        self.points.started(saved=start_snapshot)
        self._decoding = _Decoding(len(self.placements))  # new workers owe no replies
        for placement in self.placements:
            self.peers.append(self._start(placement))
        # per worker: its inputs out, its outputs back (shared memory, see arena.py)
        self._arenas = [(arena.Arena(), arena.Arena()) for _ in self.peers]
        staged, routes, specs = self._signatures[0]
        for peer, placement, shared in zip(self.peers, self.placements, shares):
            stages = tuple(DeviceStage(staged.modules[s], routes[s], staged.io[s].inputs)
                           for s in placement.stages)
            elsewhere = [self.model.get_parameter(name) for name in
                         stepped_elsewhere(self.ties, placement.stages, self.owners)]
            optimizer = (stage_optimizer(self.optimizer, nn.ModuleList(s.module for s in stages),
                                         elsewhere) if self.optimizer else None)
            setup = Setup(stages, optimizer, specs, self.schedule, self.owners, devices,
                          self.ties, self.sharding)
            launch = Launch(placement, meeting,
                            (0 if spread else self.process_id * self.replicas)
                            + placement.replica, self.timeout,
                            os.getpid(), self._folder if keep and (
                                placement.replica == 0 or self.sharding) else None,
                            self.seed, start_snapshot)
            try:  # the stage's tensors go from their own memory, storage by storage
                self._send(peer, (launch, setup), share=shared)
            except DeviceError:
                raise
            except Exception as exc:
                self.close()
                raise CompileError(
                    f"{wire.stage_names(placement.stages).capitalize()} cannot be sent to "
                    f"{'its' if len(stages) == 1 else 'their'} worker process: pickling "
                    f"failed with {type(exc).__name__}: {exc}. Objects that cannot be pickled "
                    "(a lock, an open file, a generator) cannot cross processes: remove them "
                    "from the model, or run every stage in this process with PIPETORCH_EXECUTION=local"
                ) from exc
        self._gather("start-up")
        if self._shared is not None:
            self._shared.refresh()  # pages read to send copies
        for key in range(1, len(self._signatures)):  # a restart: every signature again
            self._send_signature(key)
        if self.signature:
            self._use(self.signature)
        if self._skeleton is not None:
            self._send_skeleton()
        logger.info("Started %d device worker(s): %s", len(self.peers),
                    ", ".join(p.describe() for p in self.peers))

    def _share_weights(self, keep: bool) -> list[frozenset[int]]:
        """Each worker's weights mapped from the host's (weights.shared): the
        parameters of the first replica's CPU workers, a weight tied across devices by its
        first device only; nothing with PIPETORCH_SHARED_WEIGHTS=0, or when training without
        snapshots (a worker killed mid-step could leave them torn with no restore point)."""
        if self._shared is not None:
            self._shared.close()
            self._shared = None
        if (environment.get("shared_weights") == "0"
                or (self.optimizer is not None and not keep)):
            return [frozenset() for _ in self.placements]
        holder: dict[int, int] = {}  # parameter -> the first worker holding it
        params: list[nn.Parameter] = []
        for n, placement in enumerate(self.placements):
            if placement.replica or torch.device(placement.device).type != "cpu":
                continue
            for stage in placement.stages:
                for param in self.staged.modules[stage].parameters():
                    if id(param) not in holder:
                        holder[id(param)] = n
                        params.append(param)
        self._shared = SharedWeights.write(params)
        if self._shared is None:
            return [frozenset() for _ in self.placements]
        # a pointer of a parameter not moved (a weights file's) is ignored: not a live region
        return [frozenset(p.untyped_storage().data_ptr() for p in params if holder[id(p)] == n)
                for n in range(len(self.placements))]

    # -- input signatures (Options.inputSignatures("several")) -------------------------------
    def add_signature(self, staged: StagedModel, routes: Sequence[Route],
                      specs: dict[Source, TensorSpec | Constant]) -> int:
        """Send every worker the stages of another input signature, as graphs bound there to
        the weights it holds (no weights cross); its number for `use`."""
        self._revive()
        self._check_alive()
        signatures.check_same_stages(self._signatures[0][0], staged)
        self._signatures.append((staged, list(routes), specs))
        self._send_signature(len(self._signatures) - 1)
        return len(self._signatures) - 1

    def _send_signature(self, key: int) -> None:
        staged, routes, specs = self._signatures[key]
        for peer, placement in zip(self.peers, self.placements):
            stages = tuple(DeviceStage(signatures.skeleton(staged.modules[s]), routes[s],
                                       staged.io[s].inputs) for s in placement.stages)
            self._send(peer, ("signature", (key, stages, specs)))
        self._gather("adding an input signature")

    def use(self, key: int) -> None:
        """Run input signature `key`'s stages from the next call on (one round trip)."""
        if key != self.signature:
            self._revive()
            self._check_alive()
            self._use(key)

    def _use(self, key: int) -> None:
        for peer in self.peers:
            self._send(peer, ("use", key))
        self._gather("a change of input signature")
        self.signature = key
        self.staged, self.routes, self.specs = self._signatures[key]

    # -- generate() in the stages (parallel.generation) --------------------------------------
    def start_generation(self, make: Callable[[], generation.Skeleton]) -> None:
        """Send every worker the model's code without weights (`make()`), bound there to its
        stages' weights (once: the workers keep it)."""
        self._revive()
        self._check_alive()
        if self._skeleton is None:
            found = make()
            try:  # before anything is written to a worker's pipe
                cloudpickle.dumps(found)
            except Exception as exc:
                raise CompileError(
                    "generate() sends the model's code (without its weights) to the stage "
                    f"workers, and pickling it failed with {type(exc).__name__}: {exc}. Objects "
                    "that cannot be pickled (a lock, an open file, a generator) cannot cross "
                    "processes: remove them from the model, or generate on one device") from exc
            self._skeleton = found
            self._send_skeleton()

    def _send_skeleton(self) -> None:
        for peer in self.peers:
            self._send(peer, ("generator", self._skeleton))
        self._gather("preparing generate()")

    def decode(self, steps: Sequence[generation.Step]) -> list[generation.StepResult]:
        """One generation step of every replica: replica r's workers run `steps[r]`'s lanes
        through its stages; the StepResults of every worker involved."""
        tickets = [self.submit(r, step) for r, step in enumerate(steps) if step.lanes]
        return [result for ticket in tickets for result in self.collect(ticket)]

    def submit(self, replica: int, step: generation.Step) -> int:
        """Send replica `replica`'s workers `step` (they run steps in the order sent, so
        steps from several threads follow one another); its ticket for `collect`."""
        self._revive()
        self._check_alive()
        decoding = self._decoding
        with decoding.sending:
            ticket = next(decoding.tickets)
            for n in range(replica * self.devices, (replica + 1) * self.devices):
                self._send(self.peers[n], ("decode", step))
                decoding.awaiting[n].append(ticket)
            return ticket

    def collect(self, ticket: int) -> list[generation.StepResult]:
        """The StepResults of a submitted step, reading the workers' replies in order (one
        thread at a time; replies to other threads' steps are kept for them)."""
        decoding = self._decoding
        with decoding.reading:
            for n, awaiting in decoding.awaiting.items():
                while ticket in awaiting:
                    head = awaiting[0]
                    decoding.replies.setdefault(head, {})[n] = self._gather(
                        "a generation step", [self.peers[n]])[0]
                    awaiting.popleft()
            replies = decoding.replies.pop(ticket)
        return [replies[n] for n in sorted(replies)]

    def end_generation(self) -> None:
        """generate() returned: the workers drop their key/value caches."""
        if self.peers and not self._lost:
            for peer in self.peers:
                self._send(peer, ("decoded", None))
            self._gather("the end of generate()")

    def release(self) -> None:
        """detachFromDevice: bring weights and optimiser state home, then stop the workers."""
        if not self.points.host_current(optimizer_state=self.optimizer is not None):
            self.pull(optimizer_state=self.optimizer is not None)
        _shutdown(self.peers, self._folder, remove=False, segments=self._segments)

    def acquire(self) -> None:
        """attachToDevice: start the workers again from the host copy."""
        self._revive()
        if not self.peers:
            self._launch()

    def _revive(self) -> None:
        """After Ctrl-C stopped a call, new workers from the host copy (which holds the state
        after the last completed call: the interrupted call is discarded)."""
        if self._interrupted:
            self._lost, self._interrupted = None, False
            self._launch()
            logger.info("Restarted the stage workers after an interrupted call")

    def _start(self, placement: places.Placement) -> wire.Peer:
        """A worker forked from the pool's warm zygote, or a fresh process with the pool off."""
        if pool.enabled():
            try:
                conn, process = pool.start_worker(self.timeout)
            except DeviceError:
                self.close()
                raise
        else:
            ours, theirs = socket.socketpair()
            try:
                process = subprocess.Popen(
                    [sys.executable, "-m", "pipetorch.parallel.worker", str(theirs.fileno())],
                    pass_fds=(theirs.fileno(),), env=pool.worker_env(), stdin=subprocess.DEVNULL)
            finally:
                theirs.close()
            conn = Connection(ours.detach())
        return wire.Peer(placement.stages, placement.device, conn, process, placement.replica,
                         self.replicas, exits.oom_kills())

    @property
    def worker_pids(self) -> list[int]:
        return [p.process.pid for p in self.peers]

    @property
    def _first_replica(self) -> list[wire.Peer]:
        """Replica 0's workers, by device: the replicas hold the same weights."""
        return self.peers[:self.devices]

    @property
    def _asked(self) -> list[wire.Peer]:
        """The workers asked for weights or gradients: replica 0's, or every one when the
        replicas share the optimiser state out (they gather its slices together)."""
        return self.peers if self.sharding is not None else self._first_replica

    # -- host calls -------------------------------------------------------------------------
    def train(self, micro_batches: list[tuple[tuple, dict]], collector: OutputCollector) -> None:
        """D optimiser steps of G micro-batches on each replica (laid out [D][G][R])."""
        b = self.batching
        assert self.optimizer is not None and len(micro_batches) == b.micro_batches
        every = dataclasses.replace(b, replication_factor=self.replicas * (
            1 if self.spread else self.num_processes))
        self._run(micro_batches, collector, training=True, iterations=b.device_iterations,
                  per_iteration=b.gradient_accumulation,
                  scale=reduction_multiplier(every))

        if self.auto and not self._measured:  # the first call measured the stages' times
            self._measured = True
            self._rechoose()

    def _choose(self, costs: dict[str, Any]) -> str:
        """The schedule the simulator finishes first with these tick costs (logged)."""
        schedule, self.predicted_bubble = choose_schedule(
            len(self.routes), self.batching.gradient_accumulation, self.owners, **costs)
        logger.info("pipelineSchedule('auto') chose %s: predicted bubble %.1f%% of a step "
                    "(ticks %s)", schedule, 100 * self.predicted_bubble, costs)
        return schedule

    def _rechoose(self) -> None:
        """Choose again from the first call's measured forward and backward times; the
        workers switch plans for the next calls (every schedule computes the same numbers)."""
        costs = measured_costs(self.last_trace)
        schedule = self._choose(costs) if costs else self.schedule
        if schedule != self.schedule:
            self.schedule = schedule
            for peer in self.peers:
                self._send(peer, ("schedule", schedule))
            self._gather("a change of schedule")

    def infer(self, micro_batches: list[tuple[tuple, dict]], collector: OutputCollector) -> None:
        """Forward of every micro-batch of the call, each replica through one plan."""
        self._run(micro_batches, collector, training=False, iterations=1,
                  per_iteration=len(micro_batches) // self.replicas, scale=1.0)

    def _run(self, micro_batches: list[tuple[tuple, dict]], collector: OutputCollector, *,
             training: bool, iterations: int, per_iteration: int, scale: float) -> None:
        """Send replica r the micro-batches r, r + R, r + 2R, ... and collect what comes back."""
        self._revive()
        if self._hosts is not None:
            self._across("the start of a call", None, check=True)
        if training:
            self._return_state()
        try:
            replies, arrivals, flat, wanted = self._exchange(
                micro_batches, collector, training=training, iterations=iterations,
                per_iteration=per_iteration, scale=scale)
        except KeyboardInterrupt:
            self._interrupt()
            raise
        self._collect(replies, arrivals, flat, wanted, collector)

    def _exchange(self, micro_batches: list[tuple[tuple, dict]], collector: OutputCollector, *,
                  training: bool, iterations: int, per_iteration: int, scale: float
                  ) -> tuple[list[Any], list[wire.Transfer], list, frozenset[int]]:
        """Send every worker its inputs and wait for all replies."""
        replicas = self.replicas
        flat = [self.staged.flatten_inputs(*args, **kwargs) for args, kwargs in micro_batches]
        steps = len(flat) // replicas  # micro-batches per replica, in order: d * G + g
        wanted = frozenset(j for j in range(steps) if collector.wants(j))
        commit = self.points.workers + 1
        save = training and self._snapshots.wanted()
        overlap = self._overlap()  # read per call: a change between calls counts
        if training and self._shared is not None:
            # a host write not uploaded is superseded by this call: the host copy reads the
            # workers' weights, all of one call (docs/precision.md), never its written pages
            self._shared.refresh()
        start = time.perf_counter()
        for n, (peer, placement) in enumerate(zip(self.peers, self.placements)):
            reads = sorted({i for s in placement.stages for i in self.routes[s].host_inputs})
            mine = flat[placement.replica::replicas]
            packed, views = self._arenas[n][0].lay_out(
                [((len(mine), *mine[0][i].shape), mine[0][i].dtype) for i in reads])
            with torch.no_grad():
                for i, view in zip(reads, views):
                    torch.stack([f[i] for f in mine], out=view)  # straight into shared memory
            call = Call({}, iterations, per_iteration, wanted, scale, overlap)
            self._send(peer, ("run", (call, training, commit if save else None, packed)))
            self._send(peer, packed, shared=self._arenas[n][0])
        arrivals: list[wire.Transfer] = []
        replies = self._gather("a training call" if training else "an inference call",
                               transfers=arrivals)
        if training:
            written = [t.snapshot for _, traces, _ in replies for t in traces if t.snapshot]
            self.points.changed(saved=bool(written))
            self._snapshots.called(time.perf_counter() - start, (
                max(s for s, _ in written), sum(b for _, b in written)) if written else None)
        return replies, arrivals, flat, wanted

    def _overlap(self) -> bool:
        """Whether replicas start their gradient buckets during the last backward
        (PIPETORCH_OVERLAP; `auto`: between GPUs)."""
        setting = environment.get("overlap")
        if setting == "auto":
            return all(torch.device(p.device).type == "cuda" for p in self.placements)
        return setting == "1"

    def _collect(self, replies: list[Any], arrivals: list[wire.Transfer], flat: list,
                 wanted: frozenset[int], collector: OutputCollector) -> None:
        """Unpack the workers' replies, keep their traces, hand the outputs to `collector`."""
        replicas = self.replicas
        outputs: dict[tuple[int, int], dict[int, list[Any]]] = {}  # (replica, stage) -> m -> ...
        traces: list[Trace] = []
        for n, (placement, (skeleton, device_traces, packed), arrival) in enumerate(
                zip(self.placements, replies, arrivals)):
            by_stage = arena.unpack_tree(self._arenas[n][1], self.peers[n].conn, skeleton, packed)
            outputs.update({(placement.replica, s): o for s, o in by_stage.items()})
            # device to host: the reply and its outputs copied out of shared memory, on the
            # device's first stage
            nbytes = arrival.nbytes + sum(arena.nbytes(p) for p in packed.places)
            device_traces[0].spans.append(Span("D2H", None, arrival.start, time.monotonic_ns(),
                                               nbytes))
            traces += device_traces
            for trace in device_traces:
                if trace.peak_memory is not None:
                    self.peak_memory[trace.stage] = max(trace.peak_memory,
                                                        self.peak_memory.get(trace.stage, 0))
        self.last_trace = sorted(traces, key=lambda t: (t.replica, t.stage))
        if self._hosts is not None:  # the other processes' stages' outputs
            for theirs in self._across("the outputs of a call", outputs).values():
                outputs.update(theirs)
        for j in sorted(wanted):
            for replica in range(replicas):
                m = j * replicas + replica

                def fetch(source: Source, m: int = m, replica: int = replica) -> Any:
                    if source.kind == "input":
                        return flat[m][source[1]]
                    stage = source[1]
                    index = self.routes[stage].host_outputs.index(source)
                    return outputs[replica, stage][j][index]

                collector.add(j, replica, map_leaves(self.staged.output, Source, fetch))

    # -- weights ----------------------------------------------------------------------------
    def pull(self, *, optimizer_state: bool = False) -> None:
        """Copy every stage's weights (and with `optimizer_state` its optimiser state) into
        the host copy, value by value, each into its place."""
        if self._interrupted:
            return  # the host copy holds the state after the last completed call
        if self._lost:
            logger.warning("The stage workers are gone (%s): the host copy keeps the weights of "
                           "the last completed call", self._lost)
            return
        try:
            for peer in self._asked:
                self._send(peer, ("pull", optimizer_state))
            counts = self._gather("copyWeightsToHost", self._asked)
            loader = snapshot.Loader(self.staged.modules, self.optimizer, writer=self.writer)
            for peer, count in zip(self._first_replica, counts):
                for _ in range(count):
                    loader.put(self._receive(peer, "copyWeightsToHost"))
            if self._hosts is not None:  # the other processes' stages, from their hosts
                self._pull_across(loader, optimizer_state and self.optimizer is not None)
            loader.finish()
            self.points.pulled(optimizer_state=optimizer_state and self.optimizer is not None)
        except DeviceError as exc:
            logger.warning("Could not copy the weights from the stage workers (%s): the host "
                           "copy keeps the weights of the last completed call",
                           str(exc).splitlines()[0])

    # -- one pipeline over several processes (parallel.cross_process) ----------------------
    def _across(self, what: str, value: Any, *, check: bool = False) -> dict[int, Any]:
        """One round of values with the other host processes (with `check`, only whether
        one failed); their failure or silence fails this engine too."""
        assert self._hosts is not None
        try:
            if check:
                self._hosts.check()
                return {}
            return self._hosts.exchange(what, value)
        except DeviceError as exc:
            self._fail(str(exc).splitlines()[0])
            raise DeviceError(f"On {self._hosts.name}: {exc}") from None

    def _pull_across(self, loader: snapshot.Loader, optimizer_state: bool) -> None:
        """Each stage's weights (and optimiser state) into the host copy from the process
        holding it: this process's stages out, the others' into `loader`."""
        optimizer = self.optimizer if optimizer_state else None
        mine = {s: snapshot.stage_state(self.staged.modules[s], optimizer)
                for peer in self._first_replica for s in peer.stages}
        for theirs in self._across("a copy of the weights to the host", mine).values():
            for stage, state in theirs.items():
                for item in snapshot.items(stage, state):
                    loader.put(item)

    def _return_state(self) -> None:
        """The optimiser state a copy to the host moved there, back to replica 0's workers
        before a training call: a worker at a time, the host's copy of each worker's share
        dropped once it has arrived (so the state is never in memory twice)."""
        if not self.points.state_on_host:
            return
        assert self.optimizer is not None
        for peer, placement in zip(self._first_replica, self.placements):
            modules = [self.staged.modules[s] for s in placement.stages]
            states = {s: ({}, *snapshot.stage_state(m, self.optimizer)[1:])
                      for s, m in zip(placement.stages, modules)}
            self._send(peer, ("state", states))
            self._gather("giving the optimiser state back", [peer])
            elsewhere = {id(self.model.get_parameter(n)) for n in
                         stepped_elsewhere(self.ties, placement.stages, self.owners)}
            for module in modules:
                for param in module.parameters():
                    if id(param) not in elsewhere:
                        self.optimizer.state.pop(param, None)
            del states
            resident.give_back_freed()
        self.points.state_on_host = False

    def _receive(self, peer: wire.Peer, what: str) -> Any:
        """One message that follows a reply from `peer` (its death or silence fails the
        engine, as in _gather)."""
        try:
            return wire.receive(peer.conn, timeout=self.timeout)
        except (EOFError, OSError, TimeoutError) as exc:
            self._fail(f"the worker running {peer.describe()} stopped during {what} ({exc})")
            raise wire.WorkerFailed(f"The worker running {peer.describe()} stopped during "
                                    f"{what}: {exc}") from None

    def pull_gradients(self) -> None:
        """Copy the gradients of the last optimiser step into the host copy's `.grad`."""
        self._revive()
        for peer in self._asked:
            self._send(peer, ("grads", None))
        replies = self._gather("getAnchoredTensor", self._asked)[:self.devices]
        found: dict[int, torch.Tensor] = {}  # a tied weight's gradient: its stepping device's
        for stages in replies:
            for stage, grads in stages.items():
                for name, param in self.staged.modules[stage].named_parameters():
                    if name in grads:
                        found[id(param)] = grads[name]
        for module in self.staged.modules:
            for param in module.parameters():
                param.grad = found.get(id(param))

    def _restore_last_call(self) -> None:
        """After a failure: the host copy takes the state the workers saved after the last
        completed call (nothing to do if none completed since the launch or the last pull)."""
        points = self.points
        if self.optimizer is None or (points.workers == 0 and self._shared is None):
            return  # with shared weights a cut call may have changed them: restore anyway
        held = {s for p in self.placements for s in p.stages}  # this process's stages
        routes = [r for r in self.routes if r.index in held]
        saved = ([snapshot.read(self._folder, r.index, points.saved) for r in routes]
                 if points.saved is not None else [])
        if points.saved == 0 and points.workers == 0 and any(s is None for s in saved):
            return  # start-up failed before its restore point: no call has run
        if points.saved is None or any(s is None for s in saved):
            logger.warning("The state after the last completed call was not saved "
                           "(PIPETORCH_SNAPSHOTS=0?): the host copy keeps the weights of the "
                           "last copy to the host")
            return
        if points.saved < points.workers:
            logger.warning(
                "The model returns to the state the workers wrote %d call(s) before the last "
                "completed one (PIPETORCH_SNAPSHOTS=auto writes once writing costs at most a "
                "tenth of the training time; =1 writes after every call)",
                points.workers - points.saved)
        for route, stage in zip(routes, saved):
            snapshot.load_stage_state(self.staged.modules[route.index], self.optimizer, stage)

    def push(self, *, optimizer_state: bool = False) -> None:
        """Send the host copy's weights (and with `optimizer_state` the host optimiser's
        state) to every stage of every replica."""
        self._revive()
        self._check_alive()
        if not optimizer_state:
            self._return_state()  # the snapshot the workers write holds their state
        commit = self.points.workers + 1
        optimizer = self.optimizer if optimizer_state else None
        for peer in self.peers:
            states = {stage: snapshot.stage_state(self.staged.modules[stage], optimizer)
                      for stage in peer.stages}
            self._send(peer, ("push", (states, commit)))
        self.points.changed(saved=any(self._gather("copyWeightsToDevice")), uploaded=True)
        self.points.state_on_host &= not optimizer_state  # then it went to every worker
        if self._shared is not None:
            self._shared.refresh()  # the file now holds what the host's own pages held

    def rng_state(self, states: list[list[torch.Tensor]] | None = None) -> list[list[torch.Tensor]]:
        """Every worker's random generators (one list per worker), set first when given."""
        self._revive()
        self._check_alive()
        if states is not None and len(states) != len(self.peers):
            raise ValueError(f"This model runs on {len(self.peers)} worker(s); rng_state got "
                             f"{len(states)} states: pass what rng_state returned")
        for n, peer in enumerate(self.peers):
            self._send(peer, ("rng", None if states is None else states[n]))
        return self._gather("rng_state")

    def set_hyperparameters(self) -> None:
        """Send the host optimiser's hyper-parameters (after setOptimizer) to every stage."""
        self._revive()
        self._check_alive()
        assert self.optimizer is not None
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        for peer in self.peers:
            self._send(peer, ("hyper", (groups, {})))
        self._gather("setOptimizer")

    # -- lifetime ---------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the workers (killing any that do not stop) and remove their files."""
        self._finalizer()
        if self._shared is not None:
            self._shared.close()  # the host's tensors keep their mappings

    def _check_alive(self) -> None:
        if self._lost:
            raise DeviceError(
                f"The stage workers were lost ({self._lost}); this wrapper cannot run again: "
                "call destroy() and build a new trainingModel/inferenceModel. The model keeps "
                "the weights of the last copy to the host")

    def _send(self, peer: wire.Peer, message: Any, *,
              shared: arena.Arena | None = None, share: frozenset[int] = frozenset()) -> None:
        """Send `message` (with `shared`, the new arena of the Packed `message` if it has
        one; `share`: the live weights the worker maps, see wire.send)."""
        try:
            if shared is not None:
                shared.send_growth(peer.conn, message)
            else:
                wire.send(peer.conn, message, shared=share)
        except OSError as exc:
            self._fail(wire.unreachable(peer, exc))
            self._check_alive()

    def _gather(self, what: str, peers: list[wire.Peer] | None = None, *,
                transfers: list[wire.Transfer] | None = None) -> list[Any]:
        self._check_alive()
        try:
            return wire.gather(self.peers if peers is None else peers, timeout=self.timeout,
                               what=what, transfers=transfers)
        except wire.WorkerFailed as exc:
            message = self._describe(exc.failure) if exc.failure else str(exc)
            if self._hosts is not None:
                first, newline, rest = message.partition("\n")
                message = (f"On {self._hosts.name}: {first} (this pipeline runs "
                           f"{self._hosts.layout.layout()}){newline}{rest}")
            self._fail(message.splitlines()[0])
            raise wire.WorkerFailed(message, exc.failure) from None
        except KeyboardInterrupt:
            self._interrupt()
            raise
        except BaseException:  # SystemExit: stop the workers before giving up
            self._fail("interrupted")
            raise

    def _interrupt(self) -> None:
        """Ctrl-C during a call: stop the workers now and discard the call. With one host
        process the next use starts new workers from the last completed call's state; with
        several, the others' workers wait for this one's, so it cannot restart alone."""
        if self._lost is not None:
            return
        if self.num_processes > 1:
            self._fail(f"interrupted by Ctrl-C; with {self.num_processes} host processes this "
                       "one cannot restart its workers alone, as the other processes' workers "
                       "exchange gradients with them")
            return
        self._restore_last_call()  # before the workers and their files go
        self._lost, self._interrupted = "interrupted by Ctrl-C", True
        _shutdown(self.peers, self._folder, grace=0.0, remove=False, segments=self._segments)

    def _fail(self, reason: str) -> None:
        if self._lost is None:
            self._restore_last_call()  # before the workers and their files go
        if self._hosts is not None:
            self._hosts.fail(reason)
        self._lost = reason
        _shutdown(self.peers, self._folder, grace=0.0, segments=self._segments)

    def _describe(self, failure: wire.Failure) -> str:
        where = "outside the schedule"
        if failure.action is not None:
            names = {"F": "the forward", "B": "the backward", "STEP": "the optimiser step"}
            what = names.get(failure.action, f"the transfer {failure.action}")
            where = f"in {what}"
            if failure.micro_batch is not None:
                micro = failure.micro_batch * self.replicas + failure.replica
                where += f" of micro-batch {micro} ({self._locate(micro)})"
        replica = f" of replica {failure.replica}" if self.replicas > 1 else ""
        return (f"Stage {failure.stage}{replica} on {failure.device} (pid {failure.pid}) failed "
                f"{where}: {failure.error}{_explained(failure, self.staged)}"
                f"\n\nWorker traceback:\n{failure.traceback}")

    def _locate(self, micro: int) -> str:
        b = self.batching
        step, replica = divmod(micro, b.replication_factor)
        iteration, accumulation = divmod(step, b.gradient_accumulation)
        return f"device iteration {iteration}, accumulation step {accumulation}, replica {replica}"


def _explained(failure: wire.Failure, staged: StagedModel) -> str:
    """The user's line of the failing operation and, for torch's common failures (dtype,
    shape, target out of range), what to check; "" when neither is known."""
    source = _model_source(failure, staged)
    line = user_line_in(source) if source else user_line_in(failure.traceback)
    kind = error_kind(failure.error)
    hint = HINTS.get(kind) if kind is not None else None
    if hint is not None and failure.micro_batch is not None:
        hint += " (the failing samples are in the micro-batch named above)"
    return (f"\n  at {line}" if line else "") + (f"\n  {hint}" if hint else "")


# A line of a stage's generated forward, as a traceback shows it: `name = torch.ops...`.
_GENERATED = re.compile(r'File "<eval_with_key>[^"]*", line \d+, in \w+\n\s+(\w+) = ')


def _model_source(failure: wire.Failure, staged: StagedModel) -> str | None:
    """Where in the user's model the failing operation was traced from: a worker's
    traceback shows only the stage's generated code, whose line names the graph node; the
    host's copy of the graph keeps that node's stack trace (the model's source lines)."""
    names = _GENERATED.findall(failure.traceback)
    if not names or not 0 <= failure.stage < len(staged.modules):
        return None
    graph = getattr(staged.modules[failure.stage], "graph", None)
    node = next((n for n in graph.nodes if n.name == names[-1]), None) if graph else None
    return node.meta.get("stack_trace") if node is not None else None


def measured_costs(traces: Sequence[Trace]) -> dict[str, tuple[int, ...]] | None:
    """Per-stage tick costs for `choose_schedule` from one call's spans (medians over the
    micro-batches), the stages' median forward being 10 ticks. A whole backward's split parts
    are priced as `_SPLIT_COSTS` prices them, a split one's whole likewise; None without
    every stage's forward and backward spans."""
    stages = max((t.stage for t in traces), default=-1) + 1

    def median(kind: str, stage: int) -> float | None:
        times = sorted(s.end - s.start for t in traces if t.stage == stage
                       for s in t.spans if s.kind == kind)
        return times[len(times) // 2] if times else None

    forward, backward, weight = ([median(k, s) for s in range(stages)] for k in "FBW")
    if not stages or any(not t for t in forward + backward):
        return None
    split = _SPLIT_COSTS["backward"] + _SPLIT_COSTS["weight"]
    whole, parts = [], []
    for b, w in zip(backward, weight):
        if w is None:  # a whole backward: its parts as _SPLIT_COSTS shares them
            whole.append(b)
            parts.append((b * split / _SPLIT_COSTS["whole"] / 2,) * 2)
        else:
            whole.append((b + w) * _SPLIT_COSTS["whole"] / split)
            parts.append((b, w))
    unit = statistics.median(forward) / 10  # type: ignore[type-var]

    def ticks(values: Sequence[float]) -> tuple[int, ...]:
        return tuple(max(1, round(v / unit)) for v in values)
    return dict(forward=ticks(forward), backward=ticks([b for b, _ in parts]),  # type: ignore
                weight=ticks([w for _, w in parts]), whole=ticks(whole))


class _Decoding:
    """Generation steps sent and not yet collected: per worker, their tickets in order."""

    def __init__(self, workers: int) -> None:
        self.tickets = itertools.count()
        self.awaiting: dict[int, collections.deque[int]] = {
            n: collections.deque() for n in range(workers)}
        self.replies: dict[int, dict[int, generation.StepResult]] = {}
        self.sending, self.reading = threading.Lock(), threading.Lock()


def _shutdown(peers: list[wire.Peer], folder: str, *, grace: float = _STOP_GRACE,
              remove: bool = True, segments: Sequence[str] = ()) -> None:
    """Ask every live worker to stop, then kill whatever is left, and remove the shared-memory
    files a worker killed during start-up may have left; idempotent."""
    live = [p for p in peers if p.process.poll() is None]
    if grace > 0 and live:
        try:
            for peer in live:
                wire.send(peer.conn, ("stop", None))
            wire.gather(live, timeout=grace, what="shutdown")
        except Exception:
            pass
    for peer in peers:
        if peer.process.poll() is None:
            peer.process.kill()
        try:
            peer.process.wait(timeout=grace + 5.0)
        except subprocess.TimeoutExpired:
            logger.error("Worker pid %d did not exit after SIGKILL", peer.process.pid)
        places.unregister(peer.process.pid)
        peer.conn.close()
    peers.clear()
    for prefix in segments:
        shm.remove_leftovers(prefix)
    if remove:
        shutil.rmtree(folder, ignore_errors=True)
