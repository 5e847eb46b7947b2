"""The one executor: runs a device's action list (any schedule) over its stages, in its worker."""
from __future__ import annotations

import contextlib
import time
from collections import Counter
from typing import Any, Callable, ContextManager, Sequence

import torch

from pipetorch import ops
from pipetorch.errors import DeviceError
from pipetorch.losses import for_backward
from pipetorch.optim.peers import Peers, during
from pipetorch.optim.scaling import loss_scale
from pipetorch.parallel.worker.host_copies import HostCopies
from pipetorch.parallel.worker.overlap import EarlyReduce, arming
from pipetorch.parallel.worker.sharded_step import ShardedStep
from pipetorch.parallel.layout.routes import Constant
from pipetorch.parallel.worker.tied import TiedGrads
from pipetorch.parallel.worker.held import HeldStage, Forward, Spec
from pipetorch.parallel.worker.stage_transfers import Transfers
from pipetorch.parallel.comm.payloads import Call, DeviceStage, Span, Trace
from pipetorch.parallel.comm.transport import PeerLink
from pipetorch.parallel.worker.split_backward import backward_input, backward_weight
from pipetorch.partition.split import Source
from pipetorch.schedule.actions import Action, Kind

__all__: list[str] = []

class StageExecutor:
    """Runs a device's action list (any schedule) over the stages the device holds: compute,
    bundle transfers and optimiser steps.

    `owners[s]` is the device of stage s (default: every stage on its own device, numbered
    like the stages); the link reaches the other devices by that number. A transfer between
    two held stages is a hand-over in memory: the receiver gets the sender's tensors, detached.
    `tied` holds the device's copies of weights tied with other devices (TIED_REDUCE).
    `micro_context(m)`, when given, is entered around micro-batch m's forward and backward
    (one device running its replicas in turn swaps each replica's buffers in). `peers`, on a
    stage worker, are the workers whose gradients the optimiser's step sums with (clipping).
    `sharding`, with replicated tensor sharding, reduce-scatters and steps the sliced weights.
    """

    def __init__(self, stages: Sequence[DeviceStage], specs: dict[Source, Spec], *,
                 link: PeerLink, device: torch.device, optimizer: torch.optim.Optimizer | None,
                 owners: Sequence[int] | None = None, replica: int = 0,
                 tied: TiedGrads | None = None, peers: Peers | None = None,
                 micro_context: Callable[[int], ContextManager[object]] | None = None,
                 sharding: ShardedStep | None = None) -> None:
        assert stages, "a device holds at least one stage"
        self.specs, self.link, self.replica = specs, link, replica
        self._context = micro_context or (lambda m: contextlib.nullcontext())
        self.device, self.optimizer, self.tied, self.peers = device, optimizer, tied, peers
        self.sharding = sharding
        self._to_host = HostCopies.for_device(device)
        self.owners = tuple(owners) if owners is not None else tuple(
            range(stages[0].route.stages))
        self.held = {s.route.index: HeldStage(s, specs, replica) for s in stages}
        self.transfers = t = Transfers(self.held, link, self.owners)
        self._handlers: dict[Kind, Callable[[int, Action], None]] = {
            Kind.FORWARD: self._forward, Kind.BACKWARD: self._backward,
            Kind.BACKWARD_WEIGHT: self._backward_weight,
            Kind.RECV_ACT: t.recv_act, Kind.SEND_ACT: t.send_act,
            Kind.RECV_GRAD: t.recv_grad, Kind.SEND_GRAD: t.send_grad,
            Kind.SEND_DONE: t.send_done, Kind.RECV_DONE: t.recv_done,
            Kind.ALL_REDUCE: self._all_reduce, Kind.TIED_REDUCE: self._tied_reduce,
            Kind.STEP: self._step,
        }
        self.current: tuple[Action, int] | None = None  # for error messages
        self.early: EarlyReduce | None = None  # built by the first run that all-reduces
        self._early_now: EarlyReduce | None = None  # in use by this run

    @property
    def outputs(self) -> dict[int, dict[int, list[Any]]]:
        """Stage -> micro-batch -> the host outputs of the last `run` the host asked for."""
        return {s: h.outputs for s, h in self.held.items()}

    @property
    def traces(self) -> list[Trace]:
        """The spans of the last `run`, one Trace per held stage in pipeline order."""
        return [h.trace for h in self.held.values()]

    # -- the loop ---------------------------------------------------------------------------
    def run(self, actions: list[Action], call: Call, *, training: bool) -> None:
        """Run `actions` call.iterations times; outputs the host wants land in `self.outputs`."""
        for held in self.held.values():
            held.reset()
            held.trace.transport = getattr(self.link, "kind", "gloo")
            held.module.train(training)
        self._call, self._training, self._scale = call, training, call.scale
        self.transfers.training = training
        # the backwards a later W completes: those B computes the input's gradient only
        self._split = {(a.stage, a.micro_batch) for a in actions
                       if a.kind is Kind.BACKWARD_WEIGHT}
        early = self._early_now = (self._early_path(actions)
                                   if training and call.overlap else None)
        self._actions = actions
        arms = arming(actions) if early is not None else {}
        with ops.running_on_device(), torch.set_grad_enabled(training):
            for iteration in range(call.iterations):
                base = iteration * call.micro_batches
                if training and self.optimizer is not None:
                    self.optimizer.zero_grad(set_to_none=True)
                    # automatic loss scaling changes the scale between optimiser steps
                    self._scale = call.scale * loss_scale(self.optimizer)
                if early is not None:
                    early.begin()
                for n, action in enumerate(actions):
                    self.current = (action, base)
                    micro = base + action.micro_batch if action.micro_batch is not None else -1
                    sent, received = self.link.bytes_sent, self.link.bytes_received
                    start = time.monotonic_ns()
                    if early is not None and n in arms:
                        early.arm(action.stage, n, hooks=self._hooks_fire(action))
                    self._handlers[action.kind](micro, action)
                    if early is not None and n in arms:
                        early.sweep(action.stage)
                    nbytes = self.link.bytes_sent - sent + self.link.bytes_received - received
                    self.held[action.stage].trace.spans.append(
                        Span(action.kind.value, micro if micro >= 0 else None, start,
                             time.monotonic_ns(), nbytes))
                self.current = None
                self.link.flush()
        self._to_host.ready()  # once per call: the outputs' copies ran beside the schedule
        assert not any(h.forwards or h.received or h.deferred for h in self.held.values()) \
            and not self.transfers.handovers, "a schedule left work undone"

    # -- the replicas' all-reduce started early (parallel/worker/overlap.py) ----------------------
    def _early_path(self, actions: list[Action]) -> EarlyReduce | None:
        """The early all-reduce when `actions` sum gradients over replicas through a
        torch.distributed link; else None."""
        if not any(a.kind is Kind.ALL_REDUCE for a in actions) or not isinstance(self.link,
                                                                                 PeerLink):
            return None
        if self.early is None:
            held = [(s, list(h.module.parameters())) for s, h in self.held.items()]
            uses = Counter(id(p) for _, params in held for p in params)
            apart = self.tied.copies() if self.tied else set()  # summed at ALL_REDUCE
            if self.sharding is not None:  # reduce-scattered there
                apart |= {id(p) for _, params in held for p in params if self.sharding.holds(p)}
            self.early = EarlyReduce({s: [p for p in params if p.requires_grad and
                                          uses[id(p)] == 1 and id(p) not in apart]
                                      for s, params in held}, self.link)
        return self.early

    def _trace_early(self, early: EarlyReduce) -> None:
        """The step's buckets started before its AR, on the traces of the stages whose
        actions started them."""
        end = time.monotonic_ns()
        base = self.current[1] if self.current is not None else 0
        for started in early.started:
            if started.by == "step":
                continue
            action = self._actions[started.at]
            micro = base + action.micro_batch if action.micro_batch is not None else None
            self.held[action.stage].trace.early_reduces.append(
                Span(Kind.ALL_REDUCE.value, micro, started.start, end, started.nbytes))

    def _hooks_fire(self, action: Action) -> bool:
        """Whether a weight's post-accumulate-grad hook in `action` means its gradient is
        final: a B of a stage autograd runs once (not recomputed nor compiled); W assigns
        `.grad` without hooks."""
        return action.kind is Kind.BACKWARD and self.held[action.stage].splits

    # -- compute ----------------------------------------------------------------------------
    def _forward(self, m: int, action: Action) -> None:
        held = self.held[action.stage]
        route = held.route
        values: dict[Source, Any] = {Source.input(i): self._call.inputs[i][m]
                                     for i in route.host_inputs}
        received = held.received.pop(m, {})
        values.update(received)
        values.update({s: known.value for s in route.receive
                       if isinstance(known := self.specs[s], Constant)})
        args = [values[s] for s in held.inputs]
        rewritten: set[Source] = set()
        for i in held.clone_inputs:
            if isinstance(args[i], torch.Tensor):
                # autograd forbids in-place ops on a leaf, and the value may be shared: the
                # host's inputs, or a tensor a stage of this device handed over
                if args[i].requires_grad:
                    rewritten.add(held.inputs[i])
                args[i] = args[i].clone()
                values[held.inputs[i]] = args[i]  # later stages read it as this stage left it
        with self._context(m):
            outputs = held.module(*args)
        for k, value in enumerate(outputs):
            source = Source.stage(route.index, k)
            spec = self.specs.get(source)
            if isinstance(spec, Constant) and spec.value != value:
                raise DeviceError(
                    f"Stage {route.index} output {k} was {spec.value!r} when the model was "
                    f"compiled and is {value!r} for this micro-batch: a non-tensor value passed "
                    "between stages must not depend on the data; return it as a tensor")
            values[source] = value
        loss = None
        if self._training and route.loss is not None:
            loss = for_backward(values[route.loss], self._scale)
        if m in self._call.wanted:
            held.outputs[m] = [self._to_host.take(values[s]) for s in route.host_outputs]
        if self._training:
            held.forwards[m] = Forward(values, received, loss, rewritten)
        elif not route.is_last:  # kept until its S>F, even for an empty bundle
            held.forwards[m] = Forward(values, received)

    def _backward(self, m: int, action: Action) -> None:
        held = self.held[action.stage]
        forward = held.forwards.pop(m)
        sources, _ = held.grad_in
        grads = held.grads.pop(m, [])
        tensors: list[torch.Tensor] = []
        seeds: list[torch.Tensor | None] = []
        for source, grad in zip(sources, grads, strict=True):
            if source[1] == held.route.index or source in forward.rewritten:
                # computed (or changed in place) here: back-propagate through it
                tensors.append(forward.values[source])
                seeds.append(grad)
            else:  # relayed through this stage: its gradient passes on, plus ours if we read it
                leaf = forward.received[source]
                leaf.grad = grad if leaf.grad is None else leaf.grad + grad
        if forward.loss is not None:
            tensors.append(forward.loss)
            seeds.append(None)
        out_sources, _ = held.grad_out
        split = (action.stage, action.micro_batch) in self._split
        if split and held.splits and tensors:
            leaves = [forward.received[s] for s in out_sources]
            params = [p for p in held.module.parameters() if p.requires_grad]
            with self._context(m):
                held.deferred[m] = backward_input(tensors, seeds, leaves, params)
        else:
            if split:
                held.deferred[m] = None  # the whole backward runs here: W has nothing left
            if tensors:
                with self._context(m):  # a recomputed forward runs again in here
                    torch.autograd.backward(tensors, seeds)
        if out_sources:
            held.grads_out[m] = [_grad_or_zeros(forward.received[s]) for s in out_sources]

    def _backward_weight(self, m: int, action: Action) -> None:
        """The weights' gradients of micro-batch m, whose B computed only its input's."""
        deferred = self.held[action.stage].deferred.pop(m)
        with self._context(m):
            backward_weight(deferred)

    def _all_reduce(self, m: int, action: Action) -> None:
        """Sum the gradients of every held stage over the replicas of this device (a weight
        two of its stages share, once)."""
        params = {id(p): p for h in self.held.values() for p in h.module.parameters()}
        if self._early_now is not None:  # most started during the backward: wait for them
            self._early_now.finish()
            self._trace_early(self._early_now)
            params = {k: p for k, p in params.items() if k not in self._early_now.params}
        if self.sharding is not None:
            self._count(self.sharding.reduce())
            params = {k: p for k, p in params.items() if not self.sharding.holds(p)}
        self.link.all_reduce([p.grad for p in params.values() if p.grad is not None])

    def _count(self, nbytes: int) -> None:
        """Bytes a collective sent, and as many received, on the action's span."""
        self.link.bytes_sent += nbytes
        self.link.bytes_received += nbytes

    def _tied_reduce(self, m: int, action: Action) -> None:
        """Sum the gradients of the weights tied with other devices over those devices."""
        assert self.tied is not None, "TIED_REDUCE in the plan of a device with no tied weight"
        self.tied.sum(self.link)

    def _step(self, m: int, action: Action) -> None:
        self.link.flush()
        if self.optimizer is not None:
            with during(self.peers):
                if self.sharding is not None:
                    self._count(self.sharding.step())
                else:
                    self.optimizer.step()
        if self.tied:
            self.tied.share_updates(self.link)


def _grad_or_zeros(leaf: torch.Tensor) -> torch.Tensor:
    return leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)

