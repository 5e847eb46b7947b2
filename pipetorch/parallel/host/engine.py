"""The host side of multi-device execution: one worker per logical device and replica.

A worker runs every stage placed on its device (ipus 0, 1, 0: the worker of device 0 runs
stages 0 and 2). A host call is one round trip: the host sends each worker the inputs its
stages read (its replica's D x G micro-batches at once), the workers run their schedules (all
device iterations) talking to each other directly, summing gradients over the replicas before
each optimiser step, and each sends back the outputs the host asked for.

    user process ---- Run(call, packed) ------------->  device 0 <-> device 1 <-> ... (p2p)
                 <--- outputs, per-stage trace spans --  every device of every replica

ProcessEngine is a facade over parts split along the messages (parallel.comm.messages): the
WorkerSet owns the processes and pipes; Calls, WeightSync, Signatures, GenerationSession and
ScheduleChoice send it messages; what they run is one frozen Pipeline (parallel.host.pipeline)
that each reads from a shared `Current`, never from the engine. The engine keeps a host copy of
the model and optimiser (`model`, `optimizer`): `pull` fills them from the workers, `push`
sends the host copy's weights to the workers. A weight tied across devices has a copy on each
(`parallel.worker.tied`).
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Callable, Sequence, cast

import torch
import torch.nn as nn

from pipetorch import environment
from pipetorch.errors import CompileError, DeviceError
from pipetorch.parallel.host import cross_process, host_link, peers, preload
from pipetorch.parallel.comm import wire
from pipetorch.parallel.comm import messages as m
from pipetorch.parallel.host.calls import Calls
from pipetorch.parallel.host.engines import MicroBatches
from pipetorch.parallel.layout.compile_plan import CompilePlan
from pipetorch.parallel.host import decoding
from pipetorch.schedule.plans import Batching
from pipetorch.parallel.host.outputs import Collector
from pipetorch.parallel.comm.rendezvous import Rendezvous, next_rendezvous
from pipetorch.parallel.layout.routes import Route
from pipetorch.parallel.host.pipeline import Current, Pipeline
from pipetorch.parallel.host.schedule_choice import ScheduleChoice
from pipetorch.parallel.host.signatures import Signatures
from pipetorch.parallel.comm.payloads import DeviceStage, Skeleton, Step, StepResult, Trace
from pipetorch.parallel.layout.ties import stepped_elsewhere, ties_of
from pipetorch.parallel.host.weight_sync import WeightSync, stage_optimizer
from pipetorch.parallel.host.workers import WorkerSet
from pipetorch.parallel.layout.placement import Placement
from pipetorch.partition.split import StagedModel
from pipetorch.partition.strategies import StageSpec
from pipetorch.weights import saving
from pipetorch.weights.points import Points

__all__: list[str] = []

logger = logging.getLogger(__name__)


class ProcessEngine:
    """Runs host calls on one worker process per logical device and replica (`workers`);
    `owners[s]` is the device of stage s."""

    def __init__(self, model: nn.Module, plan: CompilePlan, *, batching: Batching,
                 optimizer: torch.optim.Optimizer | None, process: tuple[int, int] = (0, 1),
                 seed: int | None = None, writer: saving.Writer | None = None,
                 sharding: int | None = None, across: bool = False) -> None:
        assert plan.graphs is not None, "stage workers run the plan's stage graphs"
        self.plan = plan  # what compiling decided; the fields below change as the engine runs
        self.model, self.optimizer, self.batching = model, optimizer, batching
        self.writer = writer  # where copies to the host of a mapped model's weights go
        self.process_id, self.num_processes = process
        replicas = batching.replication_factor  # this process's replicas
        # replicated tensor sharding (parallel.worker.sharded_step): the minimum elements of a
        # sliced weight and the replicas sharing the state out; None when off
        self.sharding = ((sharding, replicas) if sharding is not None and optimizer
                         is not None and replicas > 1 else None)
        # randomSeed, else torch's (so torch.manual_seed repeats runs; the user's stream of
        # random numbers is left as it is)
        self.seed = seed if seed is not None else torch.initial_seed()
        self.input_device = torch.device("cpu")
        self.in_process = False
        self.last_trace: list[Trace] = []
        self.timeout = environment.get("timeout")
        staged, placements, owners = plan.graphs.staged, list(plan.placements), plan.owners
        # Distributed.stagesAcrossProcesses: this process runs its own devices' workers only,
        # and exchanges outputs and weights with the others (parallel.host.cross_process)
        spread = (cross_process.spread(placements, owners, process=self.process_id,
                                       processes=self.num_processes) if across else None)
        if spread is not None:
            placements = cross_process.local_placements(placements, spread)
        if writer is not None:  # each process writes the files of its own stages
            writer.place(staged.modules, {s for p in placements for s in p.stages})
        self.choice = ScheduleChoice(plan.schedule, stages=len(plan.graphs.routes),
                                     owners=owners, accumulation=batching.gradient_accumulation)
        # the input signature in use (Options.inputSignatures), where its stages run
        self.pipeline = Current(Pipeline(
            staged, plan.graphs.routes, plan.graphs.specs, tuple(placements), owners,
            ties_of(model, staged, owners), replicas, spread))
        self.workers = WorkerSet(self.pipeline, num_processes=self.num_processes,
                                 timeout=self.timeout, batching=batching,
                                 libraries=preload.libraries(model))
        self.sync = WeightSync(self.pipeline, self.workers, model=model, optimizer=optimizer,
                               writer=writer, sharding=self.sharding)
        self.workers.on_loss = self.sync.restore_last_call
        self.calls = Calls(self.pipeline, self.workers, self.sync, batching=batching,
                           num_processes=self.num_processes)
        self.peak_memory = self.calls.peak_memory  # stage -> its worker's peak
        self.signatures = Signatures(self.pipeline, self.workers)
        self.session = decoding.GenerationSession(self.workers)
        self._launch()

    def _launch(self) -> None:
        """Start a worker per device and replica with the host copy's weights and optimiser
        state."""
        spread, replicas = self.pipeline.now.spread, self.pipeline.now.replicas
        meeting = next_rendezvous(process_id=self.process_id, num_processes=self.num_processes,
                                  devices=len(spread.ipus) if spread else self.workers.devices,
                                  replicas=replicas, timeout=self.timeout,
                                  across=spread is not None)
        if spread is not None:  # every process is there before any starts workers
            self._meet(meeting, spread)
        one_machine = False  # every worker on this machine, whatever its process
        if self.num_processes > 1:  # the CPU workers of every process of a machine
            cores, one_machine = cross_process.share_cores(
                self.placements, meeting, process=self.process_id,
                processes=self.num_processes, machine=peers.machine_id(), timeout=self.timeout)
            self.pipeline.now = dataclasses.replace(self.pipeline.now, placements=tuple(cores))
        devices = tuple(p.device for p in self.placements)
        keep = self.optimizer is not None and self.sync.snapshots.setting != "0"
        shares = self.sync.share(keep)
        # a training engine sharing its weights keeps a restore point from the start
        start_snapshot = keep and self.sync.shared is not None
        self.sync.points.started(saved=start_snapshot)
        self.session.restart()
        try:
            self.workers.start()
        except DeviceError:
            self.close()
            raise
        self.calls.restart()
        staged, routes, specs = self.signatures.all[0]
        folder = self.workers.folder if keep else None
        for peer, placement, shared in zip(self.workers.peers, self.placements, shares,
                                          strict=True):
            stages = tuple(DeviceStage(staged.modules[s], routes[s], staged.io[s].inputs)
                           for s in placement.stages)
            setup = m.Setup(stages, self._stage_optimizer(placement.stages, stages), specs,
                            self.schedule, self.owners, devices, self.pipeline.now.ties,
                            self.sharding)
            launch = m.Launch(placement, meeting,
                              (0 if spread else self.process_id * replicas)
                              + placement.replica, self.timeout,
                              os.getpid(), folder if placement.replica == 0 or self.sharding
                              else None, self.seed, start_snapshot, one_machine)
            try:  # the stage's tensors go from their own memory, storage by storage
                self.workers.send(peer, m.Start(launch, setup), share=shared)
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
        self.workers.gather("start-up")
        self.sync.refresh()  # pages read to send copies
        self.signatures.relaunched()
        self.session.send_skeleton()
        logger.info("Started %d device worker(s): %s", len(self.workers.peers),
                    ", ".join(p.describe() for p in self.workers.peers))

    def _meet(self, meeting: Rendezvous, spread: cross_process.Spread) -> None:
        """Meet the pipeline's other processes; the first time, every process takes process
        0's weights, as DistributedDataParallel takes rank 0's (per-rank seeds would give each
        process other initial weights; a mapped model's are its files', the same on each)."""
        first = self.workers.link is None
        link = host_link.HostLink(meeting, spread, self.timeout)
        link.serve = self.sync.serve
        self.workers.link = link
        self.workers.across(lambda link: link.start())
        if first and self.writer is None:
            self.workers.across(lambda link: link.broadcast(_tensors(self.model)))

    def _stage_optimizer(self, stage_numbers: Sequence[int], stages: Sequence[DeviceStage]
                         ) -> torch.optim.Optimizer | None:
        """The optimiser over a worker's stages, but the tied weights stepped elsewhere."""
        if self.optimizer is None:
            return None
        elsewhere = [self.model.get_parameter(name) for name in
                     stepped_elsewhere(self.pipeline.now.ties, stage_numbers, self.owners)]
        return stage_optimizer(self.optimizer, nn.ModuleList(s.module for s in stages),
                               elsewhere)

    def _ready(self, *, check: bool = True) -> None:
        """Before any message: after Ctrl-C stopped a call, new workers from the host copy
        (which holds the state after the last completed call); with `check`, lost workers
        raise."""
        if self.workers.revived():
            self._launch()
            logger.info("Restarted the stage workers after an interrupted call")
        if check:
            self.workers.check_alive()

    # -- what the wrapper reads -------------------------------------------------------------
    @property
    def schedule(self) -> str:
        return self.choice.schedule

    @property
    def predicted_bubble(self) -> float | None:
        return self.choice.predicted_bubble

    @property
    def staged(self) -> StagedModel:
        return self.pipeline.now.staged

    @property
    def placements(self) -> tuple[Placement, ...]:
        return self.pipeline.now.placements

    @property
    def owners(self) -> tuple[int, ...]:
        return self.pipeline.now.owners

    @property
    def points(self) -> Points:
        return self.sync.points

    @property
    def worker_pids(self) -> list[int]:
        return self.workers.worker_pids

    # -- calls, weights, signatures, generation: each a part's ------------------------------
    def train(self, micro_batches: MicroBatches, collector: Collector) -> None:
        """D optimiser steps of G micro-batches on each replica (laid out [D][G][R])."""
        self._ready(check=False)
        self.last_trace = self.calls.train(micro_batches, collector)
        self.choice.called(self.last_trace, self.workers)

    def infer(self, micro_batches: MicroBatches, collector: Collector) -> None:
        """Forward of every micro-batch of the call, each replica through one plan."""
        self._ready(check=False)
        self.last_trace = self.calls.infer(micro_batches, collector)

    def pull(self, *, optimizer_state: bool = False) -> None:
        """Copy every stage's weights (and with `optimizer_state` its optimiser state) into
        the host copy."""
        self.sync.pull(optimizer_state=optimizer_state)

    def push(self, *, optimizer_state: bool = False) -> None:
        """Send the host copy's weights (and with `optimizer_state` its optimiser state) to
        every stage of every replica."""
        self._ready()
        self.sync.push(optimizer_state=optimizer_state)

    def pull_gradients(self) -> None:
        """Copy the gradients of the last optimiser step into the host copy's `.grad`."""
        self._ready(check=False)
        self.sync.pull_gradients()

    def rng_state(self, states: list[list[torch.Tensor]] | None = None
                  ) -> list[list[torch.Tensor]]:
        """Every worker's random generators (one list per worker), set first when given."""
        self._ready()
        peers = self.workers.peers
        if states is not None and len(states) != len(peers):
            raise ValueError(f"This model runs on {len(peers)} worker(s); rng_state got "
                             f"{len(states)} states: pass what rng_state returned")
        for n, peer in enumerate(peers):
            self.workers.send(peer, m.Rng(None if states is None else states[n]))
        return cast(list[list[torch.Tensor]], self.workers.gather("rng_state"))

    def set_hyperparameters(self) -> None:
        """Send the host optimiser's hyper-parameters (after setOptimizer) to every stage."""
        self._ready()
        assert self.optimizer is not None
        if self.workers.link is not None:  # every process changes it, or all raise
            self.workers.across(lambda link: link.mark(host_link.Kind.OPTIMIZER))
        groups = [{k: v for k, v in g.items() if k != "params"}
                  for g in self.optimizer.param_groups]
        self.workers.broadcast(m.Hyper(groups), "setOptimizer")

    def add_signature(self, staged: StagedModel, routes: Sequence[Route],
                      specs: m.Specs) -> int:
        """Another input signature's stages on the same workers; its number for `use`."""
        self._ready()
        return self.signatures.add(staged, routes, specs)

    def use(self, key: int) -> None:
        """Run input signature `key`'s stages from the next call on (one round trip)."""
        if key != self.signatures.current:
            self._ready()
            self.signatures.use(key)

    def start_generation(self, make: Callable[[], Skeleton]) -> None:
        """Send every worker the model's code without weights, once (parallel.host.decoding)."""
        self._ready()
        self.session.start(make)

    def decode(self, steps: Sequence[Step]) -> list[StepResult]:
        """One generation step of every replica (parallel.host.decoding)."""
        self._ready()
        return self.session.decode(steps)

    def end_generation(self) -> None:
        """generate() returned: the workers drop their key/value caches."""
        self.session.end()

    def generate(self, model: nn.Module, stages: Sequence[StageSpec], *, lanes: int,
                 args: tuple, kwargs: dict) -> object:
        """HuggingFace's `model.generate`, each forward it calls run in the stages."""
        return decoding.generate(model, self, list(stages), replicas=self.pipeline.now.replicas,
                                 devices=self.workers.devices, lanes=lanes, args=args,
                                 kwargs=kwargs)

    # -- lifetime ---------------------------------------------------------------------------
    def release(self) -> None:
        """detachFromDevice: bring weights and optimiser state home, then stop the workers."""
        if not self.points.host_current(optimizer_state=self.optimizer is not None):
            self.pull(optimizer_state=self.optimizer is not None)
        self.workers.stop(remove=False)

    def acquire(self) -> None:
        """attachToDevice: start the workers again from the host copy."""
        self._ready(check=False)
        if not self.workers.peers:
            self._launch()

    def close(self) -> None:
        """Stop the workers (killing any that do not stop) and remove their files."""
        if self.workers.link is not None:
            self.workers.link.close()
        self.workers.close()
        self.calls.close()
        self.sync.close()


def _tensors(model: nn.Module) -> list[torch.Tensor]:
    """`model`'s parameters and buffers that hold values, each once (tied ones too)."""
    found = {id(t): t.detach() for t in [*model.parameters(), *model.buffers()]
             if t.device.type != "meta"}
    return list(found.values())
