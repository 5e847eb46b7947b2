"""The host copy of a process engine's weights and optimiser state against the workers':
shared with them, pulled, pushed, the moved optimiser state given back, restored after a
failure from the workers' files, and which point of training each copy holds."""
from __future__ import annotations

import copy
import logging
from collections import defaultdict
from typing import Sequence, cast

import torch
import torch.nn as nn

from pipetorch import environment
from pipetorch.errors import DeviceError
from pipetorch.parallel.comm import messages as m
from pipetorch.parallel.comm import resident, wire
from pipetorch.parallel.host.host_link import Kind
from pipetorch.parallel.host.pipeline import Current
from pipetorch.parallel.host.workers import WorkerSet
from pipetorch.parallel.layout.ties import stepped_elsewhere
from pipetorch.weights import saving, snapshot
from pipetorch.weights.points import Points
from pipetorch.weights.shared import SharedWeights

__all__: list[str] = []

logger = logging.getLogger(__name__)


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


class WeightSync:
    """Copies between the host copy (`model` and `optimizer`) and `pipeline`'s `workers`;
    `writer` takes a mapped model's weights; `sharding`: replicas share the state out."""

    def __init__(self, pipeline: Current, workers: WorkerSet, *, model: nn.Module,
                 optimizer: torch.optim.Optimizer | None, writer: saving.Writer | None,
                 sharding: tuple[int, int] | None) -> None:
        self.pipeline, self.workers = pipeline, workers
        self.model, self.optimizer, self.writer = model, optimizer, writer
        self.sharding = sharding
        self.points = Points()  # which point of training each copy holds
        self.shared: SharedWeights | None = None  # this launch's weights in shared memory
        self.snapshots = snapshot.SnapshotPolicy(environment.get("snapshots"))

    @property
    def asked(self) -> list[wire.Peer]:
        """The workers asked for weights or gradients: replica 0's, or every one when the
        replicas share the optimiser state out (they gather its slices together)."""
        workers = self.workers
        return workers.peers if self.sharding is not None else workers.first_replica

    def share(self, keep: bool) -> list[frozenset[int]]:
        """Each worker's weights mapped from the host's (weights.shared): the
        parameters of the first replica's CPU workers, a weight tied across devices by its
        first device only; nothing with PIPETORCH_SHARED_WEIGHTS=0, or when training without
        snapshots (a worker killed mid-step could leave them torn with no restore point)."""
        now = self.pipeline.now
        self.close()
        if (environment.get("shared_weights") == "0"
                or (self.optimizer is not None and not keep)):
            return [frozenset() for _ in now.placements]
        holder: dict[int, int] = {}  # parameter -> the first worker holding it
        params: list[nn.Parameter] = []
        for n, placement in enumerate(now.placements):
            if placement.replica or torch.device(placement.device).type != "cpu":
                continue
            for stage in placement.stages:
                for param in now.staged.modules[stage].parameters():
                    if id(param) not in holder:
                        holder[id(param)] = n
                        params.append(param)
        self.shared = SharedWeights.write(params)
        if self.shared is None:
            return [frozenset() for _ in now.placements]
        # a pointer of a parameter not moved (a weights file's) is ignored: not a live region
        return [frozenset(p.untyped_storage().data_ptr() for p in params if holder[id(p)] == n)
                for n in range(len(now.placements))]

    def refresh(self) -> None:
        """The host's pages of shared weights read the file again (see weights.shared)."""
        if self.shared is not None:
            self.shared.refresh()

    def close(self) -> None:
        if self.shared is not None:
            self.shared.close()  # the host's tensors keep their mappings
            self.shared = None

    def pull(self, *, optimizer_state: bool = False) -> None:
        """Copy every stage's weights (and with `optimizer_state` its optimiser state) into
        the host copy, value by value, each into its place."""
        workers = self.workers
        if workers.interrupted:
            return  # the host copy holds the state after the last completed call
        if workers.lost:
            logger.warning("The stage workers are gone (%s): the host copy keeps the weights of "
                           "the last completed call", workers.lost)
            return
        try:
            loader = snapshot.Loader(self.pipeline.now.staged.modules, self.optimizer,
                                     writer=self.writer)
            if self.writer is not None:
                self.writer.begin(self.points.workers,
                                  current=self.points.host == self.points.workers)
            self._receive(loader, optimizer_state)
            written = self.writer.seal() if self.writer is not None else {}
            if workers.link is not None:  # the other processes' stages, from their hosts
                written = self._pull_across(
                    loader, optimizer_state and self.optimizer is not None, written)
            loader.finish(written)
            if written and workers.link is not None:  # none replaces its files before all
                workers.across(lambda link: link.mark(Kind.MAPPING))  # mapped the others'
            self.points.pulled(optimizer_state=optimizer_state and self.optimizer is not None)
        except DeviceError as exc:
            if workers.link is not None:  # the other processes' stages are missing
                raise
            logger.warning("Could not copy the weights from the stage workers (%s): the host "
                           "copy keeps the weights of the last completed call",
                           str(exc).splitlines()[0])

    def _receive(self, loader: snapshot.Loader, optimizer_state: bool) -> None:
        """This process's workers' weights (and optimiser state) into `loader`."""
        workers = self.workers
        counts = workers.broadcast(m.Pull(optimizer_state), "copyWeightsToHost", self.asked)
        for peer, count in zip(workers.first_replica, counts, strict=False):
            assert isinstance(count, int)
            for _ in range(count):
                item = workers.receive(peer, "copyWeightsToHost")
                assert isinstance(item, tuple)  # a snapshot.Item
                loader.put(item)

    def serve(self) -> object:
        """This process's stages' weights, for another process's read while this process's
        script is elsewhere (host_link): pulled from its workers into the host copy, whose
        other stages and point of training stay as they were."""
        loader = snapshot.Loader(self.pipeline.now.staged.modules, self.optimizer)
        self._receive(loader, False)
        loader.finish({})
        return self._mine(False), {}

    def _mine(self, optimizer_state: bool) -> dict[int, snapshot.StageState]:
        """The host copy's state of this process's stages (but what map_weights's files
        hold, which each process writes itself)."""
        optimizer = self.optimizer if optimizer_state else None
        mine = {}
        for peer in self.workers.first_replica:
            for s in peer.stages:
                module = self.pipeline.now.staged.modules[s]
                filed = frozenset(id(t) for t in [*module.parameters(), *module.buffers()]
                                  if self.writer is not None and self.writer.stays(t))
                mine[s] = snapshot.stage_state(module, optimizer, skip=filed)
        return mine

    def _pull_across(self, loader: snapshot.Loader, optimizer_state: bool,
                     written: dict[str, str]) -> dict[str, str]:
        """Each stage's weights (and optimiser state) into the host copy from the process
        holding it: this process's stages out, the others' into `loader`; but the weights
        going to map_weights's files, which each process writes for its own stages (the
        files' save ids cross instead: `written`, every process's, is returned)."""
        # served by the others at their next call when this process alone reads: weights
        # only, with no files of their own to write
        servable = not optimizer_state and self.writer is None
        value = (self._mine(optimizer_state), written)
        every = dict(written)
        for theirs in self.workers.across(
                lambda link: link.exchange(Kind.READ, value, servable=servable)).values():
            states, files = cast(tuple, theirs)
            every.update(files)
            for stage, state in states.items():
                for item in snapshot.items(stage, state):
                    loader.put(item)
        return every

    def return_state(self) -> None:
        """The optimiser state a copy to the host moved there, back to replica 0's workers
        before a training call: a worker at a time, the host's copy of each worker's share
        dropped once it has arrived (so the state is never in memory twice)."""
        if not self.points.state_on_host:
            return
        now = self.pipeline.now
        assert self.optimizer is not None
        for peer, placement in zip(self.workers.first_replica, now.placements, strict=False):
            modules = [now.staged.modules[s] for s in placement.stages]
            states: dict[int, snapshot.StageState] = {
                s: ({}, *snapshot.stage_state(module, self.optimizer)[1:])
                for s, module in zip(placement.stages, modules, strict=True)}
            self.workers.broadcast(m.GiveState(states), "giving the optimiser state back",
                                   [peer])
            elsewhere = {id(self.model.get_parameter(n)) for n in
                         stepped_elsewhere(now.ties, placement.stages, now.owners)}
            for module in modules:
                for param in module.parameters():
                    if id(param) not in elsewhere:
                        self.optimizer.state.pop(param, None)
            del states
            resident.give_back_freed()
        self.points.state_on_host = False

    def pull_gradients(self) -> None:
        """Copy the gradients of the last optimiser step into the host copy's `.grad`."""
        staged = self.pipeline.now.staged
        replies = self.workers.broadcast(m.Grads(), "getAnchoredTensor", self.asked)
        found: dict[int, torch.Tensor] = {}  # a tied weight's gradient: its stepping device's
        for stages in replies[:self.workers.devices]:
            assert isinstance(stages, dict)
            for stage, grads in stages.items():
                for name, param in staged.modules[stage].named_parameters():
                    if name in grads:
                        found[id(param)] = grads[name]
        for module in staged.modules:
            for param in module.parameters():
                param.grad = found.get(id(param))

    def restore_last_call(self) -> None:
        """After a failure: the host copy takes the state the workers saved after the last
        completed call (nothing to do if none completed since the launch or the last pull)."""
        points, now = self.points, self.pipeline.now
        if self.optimizer is None or (points.workers == 0 and self.shared is None):
            return  # with shared weights a cut call may have changed them: restore anyway
        folder = self.workers.folder
        held = {s for p in now.placements for s in p.stages}  # this process's stages
        routes = [r for r in now.routes if r.index in held]
        saved = ([snapshot.read(folder, r.index, points.saved) for r in routes]
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
        for route, stage in zip(routes, saved, strict=True):
            assert stage is not None  # checked above
            snapshot.load_stage_state(now.staged.modules[route.index], self.optimizer, stage)

    def push(self, *, optimizer_state: bool = False) -> None:
        """Send the host copy's weights (and with `optimizer_state` the host optimiser's
        state) to every stage of every replica."""
        staged = self.pipeline.now.staged
        if self.workers.link is not None:  # every process uploads, or all raise
            self.workers.across(lambda link: link.mark(Kind.UPLOAD))
        if not optimizer_state:
            self.return_state()  # the snapshot the workers write holds their state
        commit = self.points.workers + 1
        optimizer = self.optimizer if optimizer_state else None
        for peer in self.workers.peers:
            states = {stage: snapshot.stage_state(staged.modules[stage], optimizer)
                      for stage in peer.stages}
            self.workers.send(peer, m.Push(states, commit))
        self.points.changed(saved=any(self.workers.gather("copyWeightsToDevice")), uploaded=True)
        self.points.state_on_host &= not optimizer_state  # then it went to every worker
        self.refresh()  # the file now holds what the host's own pages held
