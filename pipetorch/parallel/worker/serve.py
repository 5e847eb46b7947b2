"""A logical device's worker process: joins the workers' process group, then serves the host.

It holds every stage placed on its device and runs them through one StageExecutor, on the
device's list of the schedule (`schedule.device_plans.device_plan`).
"""
from __future__ import annotations

import dataclasses
import importlib
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from pipetorch import environment
from pipetorch.optim import offload
from pipetorch.optim.peers import Peers
from pipetorch.parallel.layout import placement as places
from pipetorch.parallel.comm import arena, hops, wire
from pipetorch.parallel.worker import compiled, sharded_step, skeletons
from pipetorch.parallel.generation import lanes
from pipetorch.parallel.comm import messages as m
from pipetorch.weights import snapshot
from pipetorch.parallel.comm.rendezvous import join
from pipetorch.parallel.comm import stream
from pipetorch.parallel.comm.payloads import Call, DeviceStage, Span, StepResult
from pipetorch.parallel.worker.stage import StageExecutor
from pipetorch.parallel.worker.tied import TiedGrads, new_groups
from pipetorch.parallel.comm.shm import new_link
from pipetorch.parallel.comm import resident
from pipetorch.parallel.comm.transport import PeerLink, backend_for, link_kind
from pipetorch.schedule import device_plans
from pipetorch.schedule.actions import Action, Kind

__all__: list[str] = []

_WATCH_PERIOD = 0.25  # seconds between checks that the host process is still there
_FRAMES = 12  # the last frames of a worker's traceback that the host shows


def _die_with_host(parent: int, host: int | None) -> None:
    """Exit when the user's process is gone, even mid-transfer: when `host` (a pidfd of it,
    for a worker forked by the pool's zygote) is readable, else when `parent` is.

    (PR_SET_PDEATHSIG would fire when the *thread* that started the worker ends, which
    kills the workers of a wrapper built in a short-lived thread.)
    """
    def watch() -> None:
        if host is not None:
            select.select([host], [], [])  # readable once the user's process has exited
        else:
            while os.getppid() == parent:
                time.sleep(_WATCH_PERIOD)
        os._exit(0)

    threading.Thread(target=watch, name="pipetorch-parent-watch", daemon=True).start()


class Worker:
    """Holds the device's stages and answers commands: run, pull, push, grads, hyper, stop."""

    def __init__(self, launch: m.Launch, setup: m.Setup, conn: Connection) -> None:
        self.launch, self.setup, self.conn = launch, setup, conn
        self._inputs, self._outputs = arena.Arena(), arena.Arena()  # shared with the host
        self._stream: Iterator[snapshot.Item] = iter(())  # values sent after the reply
        # the host inputs the device's stages read, in the order the host lays them out
        self.reads = sorted({i for s in setup.stages for i in s.route.host_inputs})
        self.device = torch.device(launch.placement.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.modules = {s.route.index: s.module.to(self.device) for s in setup.stages}
        self.optimizer = setup.optimizer
        meeting = launch.rendezvous
        backend, staged = backend_for([torch.device(d) for d in setup.devices])
        wire_device = torch.device("cpu") if staged else self.device
        rank = meeting.rank(launch.replica, setup.device)
        torch.manual_seed(launch.seed + rank)  # dropout differs between workers, not runs
        compiler = compiled.compile_backend(setup.stages)
        if compiler == "inductor":
            compiled.limit_compile_threads(workers=len(setup.devices), cores=places.cpu_cores())
        store = join(meeting, rank=rank, backend=backend, timeout=launch.timeout,
                     group_timeout=compiled.watchdog_timeout(launch.timeout, backend=backend,
                                                             compiling=compiler is not None))
        # Every worker creates every device's group, in the same order (a collective call).
        groups = [dist.new_group(meeting.device_ranks(d)) if meeting.replicas > 1 else None
                  for d in range(meeting.devices)]
        tie_groups = new_groups(setup.ties, meeting)  # after those, in the same order everywhere
        self.tied = TiedGrads(setup.ties, self.modules, device=setup.device,
                              groups={d: g for (r, d), g in tie_groups.items()
                                      if r == launch.replica})
        if self.optimizer is not None and not offload.is_offloaded(self.optimizer):
            _move_state(self.optimizer, self.device)  # else it moves in for each step
        # Summed over all workers, each replica's (identical) share counts `replicas` times;
        # a weight tied across devices is stepped, so counted, on its first device only.
        self.sharding = sharded_step.build(self.optimizer, setup.sharding, meeting, groups,
                                           device=setup.device, replica=launch.replica,
                                           timeout=launch.timeout, wire_device=wire_device,
                                           backend=backend)
        peers = Peers(lambda t: _all_reduce_sum(t.to(wire_device)).to(t.device) / meeting.replicas,
                      **(self.sharding.peers() if self.sharding else {}))
        kind = link_kind([torch.device(d) for d in setup.devices],
                         one_host=launch.one_machine
                         or len(setup.devices) == meeting.world_size)
        self._plans: dict[tuple[int, bool], list] = {}
        self._generation: lanes.Generation | None = None  # generate() in the stages
        self._hop_link: PeerLink | None = None  # generation's link, made at its first model

        def link_named(suffix: str) -> PeerLink:
            """A link of its own (its rings' names): one per input signature, one for hops."""
            return new_link(kind, store=store, name=suffix, rank=rank, device=self.device,
                            wire_device=wire_device, timeout=launch.timeout,
                            offset=meeting.rank(launch.replica, 0),
                            replica_group=groups[setup.device], backend=backend)

        def executor(stages: tuple[DeviceStage, ...], specs: dict, signature: int
                     ) -> StageExecutor:
            # each input signature has its own bundle sizes: its own link
            link = link_named(f"s{signature}-" if signature else "")
            made = StageExecutor(stages, specs, link=link, device=self.device,
                                 optimizer=self.optimizer, owners=setup.owners,
                                 replica=launch.placement.replica,
                                 tied=self.tied or None, peers=peers, sharding=self.sharding)
            link.open(made.transfers.channels(self._transfers()))
            return made

        self._executor_for = executor
        self._link_named = link_named
        self.executor = executor(setup.stages, setup.specs, 0)
        # input signature -> its stages (sharing modules[s]'s weights), specs and executor
        self._signatures = {0: (setup.stages, setup.specs, self.executor)}
        if launch.start_snapshot:
            self._snapshot(0)
        if self.optimizer is not None:
            # torch.optim imports torch._dynamo on the first zero_grad/step (seconds): pay it
            # while compiling, not inside the first training call.
            importlib.import_module("torch._dynamo")

    def handle(self, message: m.Message, arrival: wire.Transfer) -> object:
        """The reply to `message` (its handler in HANDLERS); `arrival`: when it came."""
        self.arrival = arrival
        return HANDLERS[type(message)](self, message)

    def _run(self, message: m.Run) -> m.RunReply:
        call, training, commit = message.call, message.training, message.commit
        packed, arrival = message.packed, self.arrival
        key = (call.micro_batches, training)
        if key not in self._plans:
            self._plans[key] = self._plan(call.micro_batches, training)
        inputs = zip(self.reads, self._inputs.unpack(packed), strict=True)
        moved = {i: x.to(self.device, non_blocking=True) for i, x in inputs}
        call = Call(moved, call.iterations, call.micro_batches, call.wanted, call.scale,
                    call.overlap)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the copy ends the H2D span
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            resident.reset_peak_rss()
        # host to device: the inputs' bytes from their arrival on the pipe to the device
        loaded = Span("H2D", None, arrival.start, time.monotonic_ns(),
                      sum(x.nbytes for x in moved.values()))
        self.executor.run(self._plans[key], call, training=training)
        traces = self.executor.traces
        traces[0].spans.insert(0, loaded)
        # the device's peak, shown on each of its stages: the CUDA allocator's on a GPU, the
        # worker process's resident peak (all it holds: weights, state, activations) on a CPU
        peak = (int(torch.cuda.max_memory_allocated(self.device)) if self.device.type == "cuda"
                else resident.peak_rss())
        for trace in traces:
            trace.peak_memory = peak
        if training and commit is not None:
            traces[0].snapshot = self._snapshot(commit)
        outputs, packed = arena.pack_tree(self._outputs, self.executor.outputs)
        return m.RunReply(outputs, traces, packed)

    def replied(self) -> None:
        """After the reply to a call went out: the values streamed to the host, if any."""
        sends = self.sharding is None or self.sharding.rank == 0  # the others only gather
        for item in self._stream:  # one value at a time: the host copies each into place
            if sends:
                wire.send(self.conn, item)
        self._stream = iter(())

    def _plan(self, micro_batches: int, training: bool) -> list[Action]:
        count = self.setup.stages[0].route.stages
        actions = device_plans.device_plan(self.setup.schedule, count, micro_batches,
                                      self.setup.owners, training=training)[self.setup.device]
        # Just before each optimiser step, the gradients of weights tied across devices are
        # summed over those devices, then every gradient over the replicas.
        replicas = self.launch.rendezvous.replicas
        reduce = [kind for kind, wanted in ((Kind.TIED_REDUCE, bool(self.tied)),
                                            (Kind.ALL_REDUCE, replicas > 1)) if wanted]
        at = next(n for n, a in enumerate(actions) if a.kind is Kind.STEP) if training else None
        if at is None or not reduce:
            return actions
        return [*actions[:at], *(Action(k, actions[at].stage) for k in reduce), *actions[at:]]

    def _transfers(self) -> list[Action]:
        """This worker's transfers in every plan of its schedule (training and inference)."""
        actions: list[Action] = []
        for training in (True, False):
            try:
                actions += self._plan(2 * self.setup.stages[0].route.stages, training)
            except ValueError:  # a schedule without this mode
                pass
        return [a for a in actions if a.kind.is_transfer]

    def _snapshot(self, commit: int) -> tuple[float, int] | None:
        """Write the state after call `commit` (replica 0 keeps one): (seconds, bytes)."""
        if self.launch.snapshots is None:
            return None
        start, written = time.perf_counter(), 0
        part = self.sharding.rank if self.sharding is not None else 0
        for stage, module in self.modules.items():
            state = self._stage_state(module)
            if self.sharding is not None:  # each replica its slices, replica 0 the weights
                weights, states, attributes = state
                state = (weights if part == 0 else {}, states,
                         {**attributes, **self.sharding.describe(module)})
            snapshot.write(self.launch.snapshots, stage, commit, state, part)
            written += snapshot.nbytes(state)
        return time.perf_counter() - start, written

    def _pull(self, message: m.Pull) -> int:
        """The number of values that follow the reply: every stage's weights, and with
        `optimizer_state` its optimiser state too, which moves: each tensor leaves this
        worker as it is sent (the host gives it back before the next training call, `_state`),
        so it is never in memory twice. A sharded state (held in the sharding's shell) stays:
        every replica gathers the slices; the first sends."""
        optimizer_state = message.optimizer_state
        followers = self.tied.followers()  # a tied weight comes from the device stepping it
        states = {stage: self._stage_state(module, tensors=optimizer_state, skip=followers)
                  for stage, module in self.modules.items()}
        if optimizer_state and self.optimizer is not None:
            for module in self.modules.values():
                for param in module.parameters():
                    self.optimizer.state.pop(param, None)
        self._stream = _freeing(item for stage, state in states.items()
                                for item in snapshot.items(stage, state))
        if self.sharding is not None:
            self._stream = self.sharding.whole_items(self._stream, self.modules)
        return sum(snapshot.count(state) for state in states.values())

    def _stage_state(self, module: torch.nn.Module, *, tensors: bool = True,
                     skip: frozenset[int] = frozenset()) -> snapshot.StageState:
        """snapshot.stage_state, with this replica's slices of a sharded optimiser state."""
        weights, states, attributes = snapshot.stage_state(module, self.optimizer,
                                                           tensors=tensors, skip=skip)
        if self.sharding is not None and tensors:
            states.update(self.sharding.named_state(module))
        return weights, states, attributes

    def _give_state(self, message: m.GiveState) -> None:
        """The optimiser state a copy to the host moved there, back (no weights); a sharded
        one is cut to this replica's slices again."""
        self._load(message.states)

    def _load(self, states: dict[int, snapshot.StageState]) -> None:
        for stage, state in states.items():
            snapshot.load_stage_state(self.modules[stage], self.optimizer, state)
        if self.sharding is not None:
            self.sharding.take_state()

    def _grads(self, message: m.Grads) -> dict[int, dict[str, torch.Tensor]]:
        """The last optimiser step's gradients of each stage (Gradient___ anchors), on the CPU."""
        if self.sharding is not None:
            return {stage: self.sharding.whole_grads(module)
                    for stage, module in self.modules.items()}
        return {stage: {name: p.grad.detach().to("cpu", copy=True)
                        for name, p in module.named_parameters() if p.grad is not None}
                for stage, module in self.modules.items()}

    def _push(self, message: m.Push) -> m.Written:
        self._load(message.states)
        return self._snapshot(message.commit)

    def _rng(self, message: m.Rng) -> list[torch.Tensor]:
        if message.states is not None:
            places.set_rng_state(message.states, self.device)
        return places.rng_state(self.device)

    def _hyper(self, message: m.Hyper) -> None:
        assert self.optimizer is not None
        for group, values in zip(self.optimizer.param_groups, message.groups, strict=True):
            group.update(values)

    def _schedule(self, message: m.Schedule) -> None:
        """Run another schedule from the next call on (pipelineSchedule "auto" re-choosing);
        every schedule has the same transfers, so the links stay as they are."""
        self.setup = dataclasses.replace(self.setup, schedule=message.name)
        self._plans.clear()

    def _add_signature(self, message: m.AddSignature) -> None:
        """Another input signature's stages, as graphs bound to the weights held here
        (Options.inputSignatures("several"))."""
        key, stages, specs = message.key, message.stages, message.specs
        bound = tuple(dataclasses.replace(
            s, module=skeletons.bind(s.module, skeletons.tensors_of(
                self.modules[s.route.index])).to(self.device))
            for s in stages)
        self._signatures[key] = (bound, specs, self._executor_for(bound, specs, key))

    def _use(self, message: m.Use) -> None:
        """Run the stages of input signature `key` from the next call on."""
        stages, specs, self.executor = self._signatures[message.key]
        self.setup = dataclasses.replace(self.setup, stages=stages, specs=specs)
        self.reads = sorted({i for s in stages for i in s.route.host_inputs})

    def _generator(self, message: m.Generator) -> None:
        """Hold the model's code with this worker's weights bound in it, to run its stages
        eagerly for generate() (parallel.generation.lanes)."""
        devices, mine = tuple(self.setup.owners), self.setup.device
        if self._hop_link is None:  # every worker gets the model at once: they open together
            self._hop_link = self._link_named("g-")
            self._hop_link.open(hops.channels(devices, mine))
        held = {s: skeletons.tensors_of(module) for s, module in self.modules.items()}
        self._generation = lanes.Generation(message.skeleton, held, devices=devices, mine=mine,
                                            device=self.device, link=self._hop_link)

    def _decode(self, message: m.Decode) -> StepResult:
        assert self._generation is not None, "a generation step before the model's skeleton"
        return self._generation.step(message.step)

    def _decoded(self, message: m.Decoded) -> None:
        if self._generation is not None:
            self._generation.end()

    def close(self) -> None:
        """Release every signature's link."""
        for _, _, executor in self._signatures.values():
            executor.link.close()
        if self._hop_link is not None:
            self._hop_link.close()


HANDLERS: dict[type, Callable[[Worker, Any], object]] = {
    m.Run: Worker._run, m.Pull: Worker._pull, m.GiveState: Worker._give_state,
    m.Grads: Worker._grads, m.Push: Worker._push, m.Rng: Worker._rng, m.Hyper: Worker._hyper,
    m.Schedule: Worker._schedule, m.AddSignature: Worker._add_signature, m.Use: Worker._use,
    m.Generator: Worker._generator, m.Decode: Worker._decode, m.Decoded: Worker._decoded}
"""Each message's handler (Start and Stop are main()'s)."""


def _freeing(values: Iterator[snapshot.Item], every: int = 64 << 20) -> Iterator[snapshot.Item]:
    """`values`, the memory of those sent returned to the system every `every` bytes (and at
    the end): a moving state shrinks this worker as the host's copy grows."""
    sent = 0
    for value in values:
        yield value
        tensor = value[-1]
        sent += tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0
        if sent >= every:
            del value, tensor
            resident.give_back_freed()
            sent = 0
    resident.give_back_freed()


def _all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(tensor)
    return tensor


def _move_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim():
                state[key] = value.to(param.device)


def _failure(launch: m.Launch | None, executor: StageExecutor | None,
             exc: BaseException) -> wire.Failure:
    """`exc` as the host shows it: the cause of a message that could not be rebuilt here (a
    class this worker cannot import, a weights file gone), and its last frames."""
    if isinstance(exc, stream.Undeliverable) and exc.__cause__ is not None:
        exc = exc.__cause__
    action, micro = None, None
    stage = launch.placement.stages[0] if launch is not None else -1  # -1: the host names it
    if executor is not None and executor.current is not None:
        step, base = executor.current
        action, stage = step.kind.value, step.stage
        micro = base + step.micro_batch if step.micro_batch is not None else None
    frames = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__,
                                                limit=-_FRAMES))
    return wire.Failure(stage, launch.placement.device if launch is not None else "", os.getpid(),
                        action, micro, f"{type(exc).__name__}: {exc}", frames,
                        launch.placement.replica if launch is not None else 0)


def _yield_to_host() -> None:
    """Lower every thread of this worker by PIPETORCH_WORKER_NICE (threads made later take
    it on): on a machine with fewer cores than busy processes, the user's process then gets
    a core as soon as it wakes, rather than after a worker's time slice. Its work is on every
    step's path: generate()'s 16 sequences in 2 lanes ran 4-5% faster on 2 cores."""
    step = environment.get("worker_nice")
    for task in os.listdir("/proc/self/task") if step else ():
        now = os.getpriority(os.PRIO_PROCESS, int(task))
        os.setpriority(os.PRIO_PROCESS, int(task), min(19, now + step))


def main(conn: Connection, host: int | None = None) -> None:
    """Serve the host on `conn` until it says stop or goes away (`host`: a pidfd of the user's
    process when this worker was forked by the pool's zygote, see parallel/host/pool.py). An
    exception, at start-up too, goes to the host as a Failure; only "stop" then ends it."""
    _die_with_host(os.getppid(), host)
    parent = os.getppid() if host is None else None  # a zygote's death does not end a worker
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the host's to handle
    launch: m.Launch | None = None
    record = None
    worker: Worker | None = None
    try:
        try:
            _yield_to_host()
            resident.reuse_freed()
            start: m.Start = wire.receive(conn, timeout=environment.get("timeout"), parent=parent)
            launch, setup = start.launch, start.setup
            torch.set_num_threads(launch.placement.threads)
            record = places.register(launch.placement, host_pid=launch.host_pid)
            worker = Worker(launch, setup, conn)
            wire.send(conn, m.Done(os.getpid()))
        except (EOFError, TimeoutError):
            raise
        except Exception as exc:
            wire.send(conn, _failure(launch, None, exc))
        broken = worker is None
        while True:
            try:
                message, arrival = wire.receive_timed(conn, timeout=float("inf"),
                                                      parent=parent)
            except stream.Undeliverable as exc:
                if not broken:
                    wire.send(conn, _failure(launch, None, exc))
                broken = True
                continue
            if isinstance(message, m.Stop):
                wire.send(conn, m.Done(None))
                break
            if broken or worker is None:
                continue  # after a failure only "stop" (or being killed) ends the worker
            try:
                wire.send(conn, m.Done(worker.handle(message, arrival)))
                worker.replied()
            except Exception as exc:
                wire.send(conn, _failure(launch, worker.executor, exc))
                broken = True
    except (EOFError, OSError, TimeoutError):
        pass  # the host has gone: nothing left to serve
    finally:
        if record is not None:
            record.unlink(missing_ok=True)
        if worker is not None:
            worker.close()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


if __name__ == "__main__":
    # python -m pipetorch.parallel.worker.serve FD: FD is this end of a socket pair with the host.
    main(Connection(socket.socket(fileno=int(sys.argv[1])).detach()))
