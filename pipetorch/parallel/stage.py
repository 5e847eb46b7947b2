"""The one executor: runs a stage's action list (any schedule) inside its worker process."""
from __future__ import annotations

import operator
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn

from pipetorch import ops
from pipetorch.errors import DeviceError
from pipetorch.optim.scaling import loss_scale
from pipetorch.parallel.routes import Constant, Route, TensorSpec
from pipetorch.parallel.transport import BundleLayout, ChannelSpec, PeerLink, Tag
from pipetorch.runtime.recompute import original_module
from pipetorch.partition.split import Source
from pipetorch.schedule.actions import Action, Kind

__all__: list[str] = []

Spec = TensorSpec | Constant


@dataclass(frozen=True)
class Call:
    """One host call as a stage sees it."""

    inputs: dict[int, torch.Tensor]  # forward's tensor argument i -> its micro-batches stacked
    iterations: int                  # times the plan runs (D when training, 1 for inference)
    micro_batches: int               # micro-batches per run of the plan
    wanted: frozenset[int]           # micro-batches whose outputs go back to the host
    scale: float = 1.0               # the loss's multiplier before loss scaling: 1/(G*R) for a mean


@dataclass
class _Forward:
    """What a forward leaves for its backward and for the sends after it."""

    values: dict[Source, Any]          # this stage's outputs and the values it received
    received: dict[Source, torch.Tensor]
    loss: torch.Tensor | None = None
    rewritten: set[Source] = field(default_factory=set)  # received values changed in place


@dataclass
class Span:
    """One action as it ran: what, which micro-batch, when (monotonic ns), bytes moved."""

    kind: str
    micro_batch: int | None
    start: int
    end: int
    nbytes: int = 0


@dataclass
class Trace:
    """The spans of one host call on one stage (of one replica)."""

    stage: int
    spans: list[Span] = field(default_factory=list)
    replica: int = 0
    peak_memory: int | None = None  # the CUDA allocator's peak during the call (GPU only)
    transport: str = "gloo"  # how bundles crossed to the neighbours: "shm" or "gloo"


def _bundle(sources: tuple[Source, ...], specs: dict[Source, Spec], *,
            grads: bool = False) -> tuple[tuple[Source, ...], BundleLayout]:
    """The tensor entries of a bundle (only those carrying a gradient when `grads`)."""
    chosen = tuple(s for s in sources if isinstance(specs[s], TensorSpec)
                   and (not grads or specs[s].requires_grad))
    return chosen, BundleLayout(tuple(specs[s] for s in chosen))  # type: ignore[misc]


def inplace_inputs(module: nn.Module) -> set[int]:
    """Positions of the stage's inputs that an op modifies in place (ReLU(inplace=True), add_)."""
    if not isinstance(module, fx.GraphModule):
        return set()
    mutated = set()
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    for index, node in enumerate(placeholders):
        for user in node.users:
            if user.args and user.args[0] is node and _is_inplace(module, user):
                mutated.add(index)
    return mutated


def _is_inplace(module: fx.GraphModule, node: fx.Node) -> bool:
    if node.kwargs.get("inplace"):
        return True
    if isinstance(node.target, torch._ops.OpOverload):  # an aten op from a torch.export capture
        return any(a.alias_info is not None and a.alias_info.is_write
                   for a in node.target._schema.arguments)
    if node.op == "call_module":
        return bool(getattr(module.get_submodule(str(node.target)), "inplace", False))
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return isinstance(name, str) and name.endswith("_") and not name.startswith("__") or \
        node.target in (operator.iadd, operator.isub, operator.imul, operator.itruediv)


class StageExecutor:
    """Runs schedule actions for one stage: compute, bundle transfers and optimiser steps."""

    def __init__(self, module: nn.Module, route: Route, specs: dict[Source, Spec], *,
                 inputs: tuple[Source, ...], link: PeerLink, device: torch.device,
                 optimizer: torch.optim.Optimizer | None, replica: int = 0) -> None:
        self.module, self.route, self.specs, self.link = module, route, specs, link
        self.replica = replica
        self.device, self.optimizer = device, optimizer
        self.inputs = inputs  # where each argument of the stage module comes from
        self.clone_inputs = inplace_inputs(original_module(module))
        self.act_in = _bundle(route.receive, specs)
        self.act_out = _bundle(route.send, specs)
        self.grad_in = _bundle(route.send, specs, grads=True)
        self.grad_out = _bundle(route.receive, specs, grads=True)
        self._handlers: dict[Kind, Callable[[int, Action], None]] = {
            Kind.FORWARD: self._forward, Kind.BACKWARD: self._backward,
            Kind.RECV_ACT: self._recv_act, Kind.SEND_ACT: self._send_act,
            Kind.RECV_GRAD: self._recv_grad, Kind.SEND_GRAD: self._send_grad,
            Kind.SEND_DONE: lambda m, a: self.link.signal(a.peer),
            Kind.RECV_DONE: lambda m, a: self.link.wait_signal(a.peer),
            Kind.ALL_REDUCE: self._all_reduce, Kind.STEP: self._step,
        }
        self._reset()
        self.current: tuple[Action, int] | None = None  # for error messages

    def channels(self, actions: list[Action]) -> list[ChannelSpec]:
        """Every direction of traffic `actions` use, with its largest message (empty bundles,
        which are never sent, left out)."""
        carries = {Kind.SEND_ACT: (Tag.ACTIVATIONS, True, self.act_out),
                   Kind.RECV_ACT: (Tag.ACTIVATIONS, False, self.act_in),
                   Kind.SEND_GRAD: (Tag.GRADIENTS, True, self.grad_out),
                   Kind.RECV_GRAD: (Tag.GRADIENTS, False, self.grad_in),
                   Kind.SEND_DONE: (Tag.DONE, True, None), Kind.RECV_DONE: (Tag.DONE, False, None)}
        found: dict[tuple[int, Tag, bool], int] = {}
        for action in actions:
            if action.kind in carries and action.peer is not None:
                tag, outgoing, bundle = carries[action.kind]
                if bundle is None or bundle[1].specs:
                    key = (action.peer, tag, outgoing)
                    found[key] = max(found.get(key, 0), bundle[1].nbytes if bundle else 0)
        return [ChannelSpec(peer, tag, outgoing, nbytes)
                for (peer, tag, outgoing), nbytes in sorted(found.items())]

    def _reset(self) -> None:
        self._received: dict[int, dict[Source, torch.Tensor]] = {}
        self._forwards: dict[int, _Forward] = {}
        self._grads: dict[int, list[torch.Tensor]] = {}
        self._grads_out: dict[int, list[torch.Tensor]] = {}
        self.outputs: dict[int, list[Any]] = {}
        self.trace = Trace(self.route.index, replica=self.replica, transport=self.link.kind)

    # -- the loop ---------------------------------------------------------------------------
    def run(self, actions: list[Action], call: Call, *, training: bool) -> None:
        """Run `actions` call.iterations times; outputs the host wants land in `self.outputs`."""
        self._reset()
        self._call, self._training, self._scale = call, training, call.scale
        self.module.train(training)
        raw: list[tuple] = []
        record, clock, link, handlers = raw.append, time.monotonic_ns, self.link, self._handlers
        with ops.running_on_device(), torch.set_grad_enabled(training):
            for iteration in range(call.iterations):
                base = iteration * call.micro_batches
                if training and self.optimizer is not None:
                    self.optimizer.zero_grad(set_to_none=True)
                    # automatic loss scaling changes the scale between optimiser steps
                    self._scale = call.scale * loss_scale(self.optimizer)
                for action in actions:
                    self.current = (action, base)
                    micro = base + action.micro_batch if action.micro_batch is not None else -1
                    moved = link.bytes_sent + link.bytes_received
                    start = clock()
                    handlers[action.kind](micro, action)
                    # a tuple per action; Spans are made once the call is over
                    record((action.kind.value, micro if micro >= 0 else None, start, clock(),
                            link.bytes_sent + link.bytes_received - moved))
                self.current = None
                self.link.flush()
        self.trace.spans.extend(Span(*span) for span in raw)
        assert not self._forwards and not self._received, "a schedule left work undone"

    # -- compute ----------------------------------------------------------------------------
    def _forward(self, m: int, action: Action) -> None:
        route = self.route
        values: dict[Source, Any] = {Source.input(i): self._call.inputs[i][m]
                                     for i in route.host_inputs}
        received = self._received.pop(m, {})
        values.update(received)
        values.update({s: self.specs[s].value for s in route.receive  # type: ignore[union-attr]
                       if isinstance(self.specs[s], Constant)})
        args = [values[s] for s in self.inputs]
        rewritten: set[Source] = set()
        for i in self.clone_inputs:
            if isinstance(args[i], torch.Tensor) and args[i].requires_grad:
                args[i] = args[i].clone()  # autograd forbids in-place ops on a leaf
                rewritten.add(self.inputs[i])
        outputs = self.module(*args)
        for i in self.clone_inputs:  # later stages read the value as this stage left it
            if self.inputs[i] in rewritten:
                values[self.inputs[i]] = args[i]
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
            loss = values[route.loss]
            loss = (loss.sum() if loss.dim() else loss) * self._scale
        if m in self._call.wanted:
            self.outputs[m] = [_for_host(values[s]) for s in route.host_outputs]
        if self._training:
            self._forwards[m] = _Forward(values, received, loss, rewritten)
        elif not route.is_last:  # kept until its S>F, even for an empty bundle
            self._forwards[m] = _Forward(values, received)

    def _backward(self, m: int, action: Action) -> None:
        forward = self._forwards.pop(m)
        sources, _ = self.grad_in
        grads = self._grads.pop(m, [])
        tensors, seeds = [], []
        for source, grad in zip(sources, grads):
            if source[1] == self.route.index or source in forward.rewritten:
                # computed (or changed in place) here: back-propagate through it
                tensors.append(forward.values[source])
                seeds.append(grad)
            else:  # relayed through this stage: its gradient passes on, plus ours if we read it
                leaf = forward.received[source]
                leaf.grad = grad if leaf.grad is None else leaf.grad + grad
        if forward.loss is not None:
            tensors.append(forward.loss)
            seeds.append(None)
        if tensors:
            torch.autograd.backward(tensors, seeds)
        out_sources, _ = self.grad_out
        if out_sources:
            self._grads_out[m] = [_grad_or_zeros(forward.received[s]) for s in out_sources]

    def _all_reduce(self, m: int, action: Action) -> None:
        self.link.all_reduce([p.grad for p in self.module.parameters() if p.grad is not None])

    def _step(self, m: int, action: Action) -> None:
        self.link.flush()
        if self.optimizer is not None:
            self.optimizer.step()

    # -- transfers --------------------------------------------------------------------------
    def _recv_act(self, m: int, action: Action) -> None:
        sources, layout = self.act_in
        tensors = self.link.recv(layout, self.route.index - 1, Tag.ACTIVATIONS)
        for source, tensor in zip(sources, tensors):
            if self._training and self.specs[source].requires_grad:  # type: ignore[union-attr]
                tensor.requires_grad_(True)
        self._received[m] = dict(zip(sources, tensors))

    def _send_act(self, m: int, action: Action) -> None:
        forward = self._forwards[m] if self._training else self._forwards.pop(m)
        sources, layout = self.act_out
        self.link.send(layout, [forward.values[s] for s in sources], self.route.index + 1,
                       Tag.ACTIVATIONS)

    def _recv_grad(self, m: int, action: Action) -> None:
        _, layout = self.grad_in
        self._grads[m] = self.link.recv(layout, self.route.index + 1, Tag.GRADIENTS)

    def _send_grad(self, m: int, action: Action) -> None:
        _, layout = self.grad_out
        self.link.send(layout, self._grads_out.pop(m, []), self.route.index - 1, Tag.GRADIENTS)


def _grad_or_zeros(leaf: torch.Tensor) -> torch.Tensor:
    return leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)


def _for_host(value: Any) -> Any:
    """A value for the host: on the CPU and detached. No copy here: the reply copies it into
    shared memory (arena.pack_tree) before anything can change it."""
    if not isinstance(value, torch.Tensor):
        return value
    return value.detach().to("cpu")
