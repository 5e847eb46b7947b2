"""One device in this process: the whole model as one stage, run by the stage executor that
every worker runs (`parallel.worker.stage`), so a host call's semantics (loss, scaling, reduction,
optimiser step, outputs) exist once."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, ContextManager, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils import _pytree as pytree

from pipetorch.enums import ReductionType
from pipetorch.parallel.layout import placement
from pipetorch.parallel.layout.routes import Route
from pipetorch.parallel.comm.payloads import Call, DeviceStage
from pipetorch.parallel.worker.stage import StageExecutor
from pipetorch.partition.split import Source
from pipetorch.partition.strategies import StageSpec
from pipetorch.partition.casting import Casting, within
from pipetorch.parallel.host.decoding import hf_method
from pipetorch.parallel.host.outputs import Collector
from pipetorch.partition.export import Tree
from pipetorch.schedule import plans
from pipetorch.schedule.plans import Batching

__all__: list[str] = []


def reduction_multiplier(batching: Batching) -> float:
    """The reduction part of the loss multiplier: 1/(G*R) when gradients are averaged over
    the G x R micro-batches of a step (Mean), 1 when they are summed."""
    if batching.reduction == ReductionType.Mean:
        return 1.0 / (batching.gradient_accumulation * batching.replication_factor)
    return 1.0


class ReplicaBuffers:
    """Each replica's own copy of the buffers forward changes (broadcastBuffers(False))."""

    def __init__(self, model: nn.Module, names: list[str], replicas: int) -> None:
        self._slots: list[tuple[dict[str, torch.Tensor | None], str, list[torch.Tensor]]] = []
        for name in names:
            owner_name, _, attr = name.rpartition(".")
            owner = model.get_submodule(owner_name)
            first = owner._buffers[attr]
            assert first is not None
            copies = [first] + [first.detach().clone() for _ in range(replicas - 1)]
            self._slots.append((owner._buffers, attr, copies))

    @contextmanager
    def of(self, replica: int) -> Iterator[None]:
        """Swap replica `replica`'s buffers in for the duration of its micro-batch."""
        for table, attr, copies in self._slots:
            table[attr] = copies[replica]
        try:
            yield
        finally:
            for table, attr, copies in self._slots:
                table[attr] = copies[0]


class LocalEngine:
    """Runs host calls on one torch device: D optimiser steps of G x R micro-batches each
    (R > 1 only with PIPETORCH_EXECUTION=local: the replicas' gradients sum in place)."""

    def __init__(self, model: nn.Module, stage: "FlatStage", *,
                 optimizer: torch.optim.Optimizer | None, batching: Batching,
                 replica_buffers: ReplicaBuffers | None = None,
                 loss_index: int | None = None, casting: Casting | None = None) -> None:
        self.model, self.optimizer = model, optimizer
        self._stage = stage  # forward (maybe recomputed or compiled) over flat tensors
        self._executors: dict[bool, StageExecutor] = {}
        # Around backward too: a recomputed forward must cast as the first one did.
        self.casting = casting
        self.loss_index = loss_index
        self.batching = batching
        self._replica_buffers = replica_buffers
        self.schedule = "local"  # every stage in this process, one after another
        self.in_process = True
        self.last_trace: list = []  # the executor's spans are not reported for one device
        self.input_device = next((t.device for t in [*model.parameters(), *model.buffers()]),
                                 torch.device("cpu"))
        # every input signature's stage over the one model and optimiser (inputSignatures)
        self._signatures = [(stage, loss_index, casting, self._executors)]
        self.signature = 0

    def add_signature(self, stage: "FlatStage", *, loss_index: int | None,
                      casting: Casting | None) -> int:
        """Another input signature's flat stage (its structure, loss and casts) over this
        engine's model and optimiser; its number for `use`."""
        self._signatures.append((stage, loss_index, casting, {}))
        return len(self._signatures) - 1

    def use(self, key: int) -> None:
        """Run input signature `key` from the next call on."""
        self._stage, self.loss_index, self.casting, self._executors = self._signatures[key]
        self.signature = key

    @property
    def forward(self) -> Callable[..., Any]:
        """Forward as this engine runs it (recomputed, compiled), on the model's arguments."""
        return self._stage.inner

    # The device copy lives in this process: there is nothing to fetch, send or stop.
    def pull(self, *, optimizer_state: bool = False) -> None:
        """Device weights (and state) are `self.model`'s (and `self.optimizer`'s) already."""

    def push(self, *, optimizer_state: bool = False) -> None:
        """Host edits copied into `self.model` (and `self.optimizer`) are on the device already."""

    def pull_gradients(self) -> None:
        """The last step's gradients are on `self.model` already."""

    def set_hyperparameters(self) -> None:
        """`self.optimizer` is the device's optimiser already."""

    def rng_state(self, states: list[list[torch.Tensor]] | None = None) -> list[list[torch.Tensor]]:
        """The device's random generators (this process's), set first when `states` is given."""
        if states is not None:
            if len(states) != 1:
                raise ValueError(f"This model runs on 1 device; rng_state got {len(states)} states")
            placement.set_rng_state(states[0], self.input_device)
        return [placement.rng_state(self.input_device)]

    def close(self) -> None:
        """Nothing runs outside this process."""

    def generate(self, model: nn.Module, stages: Sequence[StageSpec], *, lanes: int,
                 args: tuple, kwargs: dict) -> object:
        """HuggingFace's generate() on the device copy, which runs all of it."""
        args, kwargs = pytree.tree_map_only(
            torch.Tensor, lambda x: x.to(self.input_device, non_blocking=True), (args, kwargs))
        return hf_method(self.model, "generate")(*args, **kwargs)

    def release(self) -> None:
        """The device copy stays in this process while detached."""

    def acquire(self) -> None:
        """Nothing to restart."""

    def train(self, micro_batches: list[tuple[tuple, dict]], collector: Collector) -> None:
        """D optimiser steps, each over G x R micro-batches laid out [D][G][R]."""
        b = self.batching
        assert self.optimizer is not None and len(micro_batches) == b.micro_batches
        self._run(micro_batches, collector, training=True, iterations=b.device_iterations,
                  per_iteration=b.gradient_accumulation * b.replication_factor,
                  scale=reduction_multiplier(b))

    def infer(self, micro_batches: list[tuple[tuple, dict]], collector: Collector) -> None:
        """Forward of every micro-batch, in [D][R] order (G is 1 for inference)."""
        self._run(micro_batches, collector, training=False, iterations=1,
                  per_iteration=len(micro_batches), scale=1.0)

    def _run(self, micro_batches: list[tuple[tuple, dict]], collector: Collector, *,
             training: bool, iterations: int, per_iteration: int, scale: float) -> None:
        """Run the one-device plan (`schedule.plans.sharded` over one stage) with the stage
        executor every multi-device worker runs, in this process."""
        replicas = self.batching.replication_factor
        flat = [self._stage.flatten(args, kwargs) for args, kwargs in micro_batches]
        wanted = frozenset(m for m in range(len(flat)) if collector.wants(m // replicas))
        inputs = {i: [f[i] for f in flat] for i in range(len(flat[0]))}
        executor = self._executor(training)
        with within(self.casting):
            executor.run(plans.sharded(1, per_iteration, training=training)[0],
                         Call(inputs, iterations, per_iteration, wanted, scale),
                         training=training)
        outputs = executor.outputs[0]
        for m in sorted(wanted):
            collector.add(m // replicas, m % replicas, self._stage.rebuild(outputs[m]))

    def _executor(self, training: bool) -> StageExecutor:
        """The executor of this engine's one stage (the loss located only in training)."""
        if training not in self._executors:
            count, loss = self._stage.outputs, self.loss_index if training else None
            route = Route(index=0, stages=1, host_inputs=tuple(range(self._stage.inputs)),
                          receive=(), send=(),
                          host_outputs=tuple(Source.stage(0, k) for k in range(count)),
                          loss=None if loss is None else Source.stage(0, loss))
            stage = DeviceStage(self._stage, route,
                                tuple(Source.input(i) for i in range(self._stage.inputs)))
            self._executors[training] = StageExecutor(
                [stage], {}, device=self.input_device,
                link=InProcessLink(),  # type: ignore[arg-type]  # one stage: never sends
                optimizer=self.optimizer if training else None,
                micro_context=self._replica_context())
        return self._executors[training]

    def _replica_context(self) -> Callable[[int], ContextManager[None]] | None:
        """Replica r's buffers swapped in around micro-batch m's forward and backward (m's
        replica is m mod R: the micro-batches are laid out [D][G][R])."""
        buffers, replicas = self._replica_buffers, self.batching.replication_factor
        if buffers is None:
            return None
        return lambda m: buffers.of(m % replicas)


class FlatStage(nn.Module):
    """Forward as a stage: a micro-batch's tensors in (pytree order), the output's tensors out.

    Whatever is not a tensor (None, Python numbers, the containers) is the first call's and
    is put back around the tensors: the wrapper recompiles when the inputs' structure changes.
    Forward's non-tensor outputs are the compile-time probe's, as a split model's are.
    """

    def __init__(self, forward: Callable[..., object], example: tuple[tuple, dict],
                 output: Tree) -> None:
        super().__init__()
        self.inner = forward
        leaves, self._spec = pytree.tree_flatten(example)
        self._slots = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        self._constants = [None if isinstance(x, torch.Tensor) else x for x in leaves]
        self._set_output(*pytree.tree_flatten(output))

    @property
    def inputs(self) -> int:
        return len(self._slots)

    @property
    def outputs(self) -> int:
        return len(self._out_slots)

    def flatten(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        """The tensors of one micro-batch's arguments, in the stage's input order."""
        leaves = pytree.tree_leaves((args, kwargs))
        return [leaves[i] for i in self._slots]

    def rebuild(self, tensors: list[torch.Tensor]) -> Tree:
        """Forward's output structure around one micro-batch's output tensors."""
        leaves = list(self._out_constants)
        for slot, tensor in zip(self._out_slots, tensors, strict=True):
            leaves[slot] = tensor
        return pytree.tree_unflatten(leaves, self._out_spec)

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        leaves = list(self._constants)
        for slot, tensor in zip(self._slots, tensors, strict=True):
            leaves[slot] = tensor
        args, kwargs = pytree.tree_unflatten(leaves, self._spec)
        out_leaves, spec = pytree.tree_flatten(self.inner(*args, **kwargs))
        if spec != self._out_spec:  # the structure is the probe's; compared, not rebuilt
            self._set_output(out_leaves, spec)
        return tuple(out_leaves[i] for i in self._out_slots)

    def _set_output(self, leaves: list[object], spec: pytree.TreeSpec) -> None:
        self._out_spec = spec
        self._out_slots = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        self._out_constants = [None if isinstance(x, torch.Tensor) else x for x in leaves]


class InProcessLink:
    """The link of a one-device plan: no peers; gradients of in-process replicas already sum
    into the same parameters, so there is nothing to all-reduce."""

    kind = "local"
    bytes_sent = bytes_received = 0

    def all_reduce(self, tensors: Sequence[torch.Tensor], *, group: dist.ProcessGroup | None = None,
                   who: str = "the other replicas") -> None:
        """The replicas of this process share their parameters' gradients."""

    def flush(self) -> None:
        """Nothing is in flight."""
