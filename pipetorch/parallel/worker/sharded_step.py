"""Replicated tensor sharding of optimiser state (ZeRO-1): each replica steps 1/R of a weight.

With `opts.TensorLocations.setOptimizerLocation(TensorLocationSettings()
.useReplicatedTensorSharding(True))`, every weight of more than
`minElementsForReplicatedTensorSharding` elements (PopART's default: 8192) is, as PopTorch
lays it out, flattened and zero-padded to R x `chunk` elements; replica r holds the state of
elements [r x chunk, (r + 1) x chunk) only. The padding travels on the wire (collectives want
equal parts) and is never stored: its state would stay 0. At the step:

    gradients  [ a0 a1 | b0 b1 ]  on every replica (a, b: weights; 0, 1: their halves)
    reduce-scatter, in buckets ordered replica-major: [a0 b0 | a1 b1] -> replica 0 sums a0 b0
    step       each replica updates its halves (views of the weights) with its state
    all-gather the updated halves, so every replica holds every weight again

The collectives work in place in one buffer per dtype, made once (25 MiB at most): NCCL's
reduce_scatter_single and all_gather_single. gloo (torch 2.13) has both, but for a 25 MiB
bucket they held 100-190 MB more resident memory after 20 rounds and took 4-5x as long as
an all-reduce of it (measured 2026-11-28 on 2 processes); there the reduce-scatter is an
all-reduce of the bucket (each replica then reads its part) and the all-gather is one
broadcast per replica's part, which hold no extra memory.

Smaller weights keep whole state on every replica and are all-reduced as before. Clipping's
global norm counts each slice once (optim.peers' weight); LAMB sums each weight's and
update's squared norms over the slices. The state reads back whole (pull, gathered one tensor
at a time) and loads from whole tensors (push, each replica takes its slice), so a
checkpoint resumes into any replica count; snapshots keep each replica's slices in a file of
its own (weights.snapshot joins them).
"""
from __future__ import annotations

import copy
import datetime
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence, TypeVar

import torch
import torch.distributed as dist
import torch.nn as nn

from pipetorch.errors import DeviceError
from pipetorch.optim import scaling
from pipetorch.optim.peers import SLICED
from pipetorch.parallel.comm.buckets import BUCKET_BYTES
from pipetorch.parallel.comm.rendezvous import Rendezvous
from pipetorch.weights.snapshot import Item

__all__: list[str] = []

V = TypeVar("V")

#: PopART's minElementsForReplicatedTensorSharding when the options leave it unset.
DEFAULT_MIN_ELEMENTS = 8192


@dataclass(frozen=True)
class Slice:
    """This replica's part of `param` flattened and padded to R x `chunk`: [start, stop)."""

    param: nn.Parameter
    chunk: int
    start: int
    stop: int
    view: torch.Tensor  # the weight's elements [start, stop): what the optimiser steps

    def bounds(self, rank: int, lo: int, hi: int) -> tuple[int, int]:
        """Elements [lo, hi) of replica `rank`'s chunk, as a range of the real (unpadded)
        elements: shorter, or empty, in the padding."""
        n = self.param.numel()
        return min(rank * self.chunk + lo, n), min(rank * self.chunk + hi, n)


def slice_of(param: nn.Parameter, rank: int, replicas: int) -> Slice:
    n = param.numel()
    chunk = -(-n // replicas)
    start, stop = min(rank * chunk, n), min((rank + 1) * chunk, n)
    return Slice(param, chunk, start, stop, param.detach().view(-1)[start:stop])


@dataclass(frozen=True)
class Run:
    """Offsets [lo, hi) of every replica's chunk of one weight, in one bucket."""

    slice: Slice
    lo: int
    hi: int


def runs(slices: Sequence[Slice], replicas: int, limit: int = BUCKET_BYTES) -> list[list[Run]]:
    """The slices' chunks cut into buckets of at most `limit` bytes over all replicas, each of
    one dtype and device, a weight's chunk cut where it does not fit."""
    groups: dict[tuple[torch.dtype, torch.device], list[Slice]] = {}
    for s in slices:
        groups.setdefault((s.param.dtype, s.param.device), []).append(s)
    out: list[list[Run]] = []
    for group in groups.values():
        room = max(1, limit // (group[0].param.element_size() * replicas))
        current: list[Run] = []
        used = 0
        for s in group:
            at = 0
            while at < s.chunk:
                if used == room:
                    out.append(current)
                    current, used = [], 0
                take = min(room - used, s.chunk - at)
                current.append(Run(s, at, at + take))
                used, at = used + take, at + take
        if current:
            out.append(current)
    return out


def _width(bucket: list[Run]) -> int:
    return sum(run.hi - run.lo for run in bucket)


def _pack(bucket: list[Run], flat: torch.Tensor, of: Callable[[Slice], torch.Tensor],
          ranks: Sequence[int]) -> None:
    """Copy the chunks of `ranks` (replica-major) from the tensors `of` names into `flat`,
    zeros filling the padding."""
    at = 0
    for rank in ranks:
        for run in bucket:
            a, b = run.slice.bounds(rank, run.lo, run.hi)
            flat[at:at + b - a].copy_(of(run.slice).view(-1)[a:b])
            flat[at + b - a:at + run.hi - run.lo].zero_()
            at += run.hi - run.lo


def _unpack(bucket: list[Run], flat: torch.Tensor, of: Callable[[Slice], torch.Tensor],
            ranks: Sequence[int], *, skip: int | None = None) -> None:
    """The reverse of `_pack` (the padding dropped; the chunks of `skip` left as they are)."""
    at = 0
    for rank in ranks:
        for run in bucket:
            a, b = run.slice.bounds(rank, run.lo, run.hi)
            if rank != skip:
                of(run.slice).view(-1)[a:b].copy_(flat[at:at + b - a])
            at += run.hi - run.lo


class ShardedStep:
    """The optimiser step of one worker holding slice `rank` of `replicas` of its weights.

    `optimizer` (the worker's, over whole weights) keeps the param groups the host updates
    and zero_grad; a shallow copy of it, `shell`, holds the slices' state and steps them.
    `group` is the process group of this device's replicas that share the state out; with
    several host processes, `across` holds this slice's replicas in the others.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, rank: int, replicas: int,
                 group: dist.ProcessGroup, min_elements: int, timeout: float,
                 wire_device: torch.device, backend: str,
                 across: dist.ProcessGroup | None = None) -> None:
        self.optimizer, self.rank, self.replicas, self.group = optimizer, rank, replicas, group
        self.across = across  # the same slice in the other host processes: summed with them
        self.timeout, self.wire_device, self.backend = timeout, wire_device, backend
        self.slices: dict[int, Slice] = {}
        groups: list[dict[str, Any]] = []
        self._origin: list[int] = []  # the shell's group -> the optimiser's group it came from
        for index, g in enumerate(optimizer.param_groups):
            big = [p for p in g["params"] if p.requires_grad and p.is_contiguous()
                   and p.numel() > min_elements]
            for p in big:
                self.slices[id(p)] = slice_of(p, rank, replicas)
            whole = [p for p in g["params"] if id(p) not in self.slices]
            for params, sliced in ((whole, False), ([self.slices[id(p)].view for p in big], True)):
                if params:
                    groups.append({**g, "params": params, SLICED: sliced})
                    self._origin.append(index)
        self.shell = copy.copy(optimizer)
        self.shell.param_groups = groups
        self.shell.state = defaultdict(dict)
        self.layout = runs(list(self.slices.values()), replicas)
        # one buffer per dtype and device for every bucket and step, made before any state:
        # buckets allocated and freed at each step left the allocator holding more memory
        # than the state saved
        self._buffers: dict[torch.dtype, torch.Tensor] = {}
        for bucket in self.layout:
            dtype, size = bucket[0].slice.param.dtype, _width(bucket) * replicas
            if self._buffers.get(dtype, torch.empty(0)).numel() < size:
                self._buffers[dtype] = torch.empty(size, dtype=dtype, device=wire_device)
        self.take_state()

    def peers(self) -> dict[str, Any]:
        """What optim.peers.Peers needs to count slices: how many replicas share a weight's
        slices, and the sum over them."""
        def slice_sum(tensor: torch.Tensor) -> torch.Tensor:
            total = tensor.to(self.wire_device)
            self._wait(dist.all_reduce(total, group=self.group, async_op=True),
                       "a norm summed over the slices")
            return total.to(tensor.device)

        return {"slices": self.replicas, "slice_sum": slice_sum}

    def holds(self, param: torch.Tensor) -> bool:
        """Whether `param`'s gradient is reduce-scattered and its state sliced."""
        return id(param) in self.slices

    # -- state: whole on the host, sliced here ------------------------------------------------
    def take_state(self) -> None:
        """Move the optimiser's state (whole tensors: sent at start-up or pushed) into the
        shell, each sliced weight's cut to this replica's slice."""
        for param, state in list(self.optimizer.state.items()):
            found = self.slices.get(id(param))
            if found is None:
                self.shell.state[param] = state
                continue
            self.shell.state[found.view] = {
                key: value.reshape(-1)[found.start:found.stop].clone()
                if _sliced_value(value, param) else value for key, value in state.items()}
        self.optimizer.state.clear()

    def named_state(self, module: nn.Module) -> Iterator[tuple[str, dict[str, Any]]]:
        """(name, state) of `module`'s parameters stepped here: a slice's as this replica
        holds it (1-D parts of the whole tensors), in a dict of its own: a copy to the host
        takes values out of what it is given (weights.snapshot.items), the shell keeps them."""
        for name, param in module.named_parameters():
            found = self.slices.get(id(param))
            state = self.shell.state.get(found.view if found is not None else param)
            if state:
                yield name, dict(state)

    def describe(self, module: nn.Module) -> dict[str, Any]:
        """What joins the replicas' snapshot parts (weights.snapshot.read): how many there
        are, and which of `module`'s weights they slice."""
        return {"slices": self.replicas,
                "sliced": [n for n, p in module.named_parameters() if self.holds(p)]}

    def whole_items(self, items: Iterable[Item], modules: dict[int, nn.Module]
                    ) -> Iterator[Item]:
        """`items` (weights.snapshot's) with each slice of the state gathered whole."""
        for stage, kind, name, key, value in items:
            if kind == "state":
                value = self.whole(name, modules[stage].get_parameter(name), key, value)
            yield stage, kind, name, key, value

    def whole(self, name: str, param: nn.Parameter, key: str, value: V) -> V | torch.Tensor:
        """`value` (this replica's state `key` of `param`) as the whole tensor: gathered
        from every replica when it is a slice (a collective: every replica calls it)."""
        found = self.slices.get(id(param))
        if found is None or not isinstance(value, torch.Tensor) or not value.dim():
            return value
        whole = torch.zeros(found.chunk * self.replicas, dtype=value.dtype,
                            device=self.wire_device)
        whole[found.start:found.start + value.numel()].copy_(value)
        self._all_gather(whole, f"the optimiser state {key} of {name}")
        return whole[:param.numel()].view(param.shape).to(value.device)

    def whole_grads(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """`module`'s gradients after the step, on the CPU, each sliced one gathered (this
        replica holds only its own slice summed over the replicas)."""
        out = {}
        for name, param in module.named_parameters():
            if param.grad is None:
                continue
            grad = param.grad.detach()
            if self.holds(param):
                found = self.slices[id(param)]
                grad = self.whole(name, param, "gradient",
                                  grad.reshape(-1)[found.start:found.stop])
            out[name] = grad.to("cpu", copy=True)
        return out

    # -- the step -------------------------------------------------------------------------------
    def reduce(self) -> int:
        """Reduce-scatter the sliced weights' gradients: this replica's slice of each becomes
        the sum over the replicas (in the gradient itself); the rest of it is left stale.
        Returns the bytes sent."""
        for found in self.slices.values():
            grad = found.param.grad
            if grad is not None and not grad.is_contiguous():
                found.param.grad = grad.contiguous()
        everyone, sent = range(self.replicas), 0
        for bucket in self._buckets():
            flat, mine = self._buffer(bucket)
            _pack(bucket, flat, _grad, everyone)
            if self.backend == "nccl":
                work = dist.reduce_scatter_single(mine, flat, group=self.group, async_op=True)
            else:  # gloo's reduce-scatter: see the module doc
                work = dist.all_reduce(flat, group=self.group, async_op=True)
            self._wait(work, "the reduce-scatter of the gradients")
            if self.across is not None:
                self._wait(dist.all_reduce(mine, group=self.across, async_op=True),
                           "the sum of the gradients' slices over the host processes")
            _unpack(bucket, mine, _grad, [self.rank])
            sent += flat.numel() * flat.element_size()
        return sent

    def step(self) -> int:
        """Step the slices (and the whole small weights), then all-gather the slices; the
        bytes sent."""
        for shell_group, index in zip(self.shell.param_groups, self._origin, strict=True):
            params = shell_group["params"]  # hyper-parameters as the host last set them
            shell_group.update(self.optimizer.param_groups[index])
            shell_group["params"] = params
        own = self.optimizer.__dict__.get(scaling._ATTR)  # the executor reads it there
        if own is None:
            self.shell.__dict__.pop(scaling._ATTR, None)
        else:
            self.shell.__dict__[scaling._ATTR] = own
        for found in self.slices.values():
            grad = found.param.grad
            found.view.grad = None if grad is None else grad.view(-1)[found.start:found.stop]
        try:
            self.shell.step()
        finally:
            for found in self.slices.values():
                found.view.grad = None
        return self.gather_weights()

    def gather_weights(self) -> int:
        """Every replica's updated slices into every replica's weights; the bytes sent."""
        everyone, sent = range(self.replicas), 0
        for bucket in self._buckets(all_weights=True):
            flat, mine = self._buffer(bucket)
            _pack(bucket, mine, _weight, [self.rank])
            self._all_gather(flat, "the all-gather of the stepped weights")
            _unpack(bucket, flat, _weight, everyone, skip=self.rank)
            sent += flat.numel() * flat.element_size()
        return sent

    def _all_gather(self, flat: torch.Tensor, what: str) -> None:
        """Every replica's part of `flat` (R equal parts, replica-major; this replica's
        filled) into every replica's `flat`, in place."""
        parts = flat.chunk(self.replicas)
        if self.backend == "nccl":
            works = [dist.all_gather_single(flat, parts[self.rank], group=self.group,
                                            async_op=True)]
        else:  # gloo's all-gather: see the module doc
            works = [dist.broadcast(part, dist.get_global_rank(self.group, k), group=self.group,
                                    async_op=True) for k, part in enumerate(parts)]
        for work in works:
            self._wait(work, what)

    def _buffer(self, bucket: list[Run]) -> tuple[torch.Tensor, torch.Tensor]:
        """(every replica's part of `bucket`, replica-major; this replica's part of it): both
        in the dtype's one buffer, the collectives working in place."""
        width = _width(bucket)
        flat = self._buffers[bucket[0].slice.param.dtype][:width * self.replicas]
        return flat, flat[self.rank * width:(self.rank + 1) * width]

    def _buckets(self, *, all_weights: bool = False) -> list[list[Run]]:
        """The layout's buckets, without the weights that have no gradient this step (none
        on every replica alike); every bucket for the weights."""
        if all_weights:
            return self.layout
        kept = [[run for run in bucket if run.slice.param.grad is not None]
                for bucket in self.layout]
        return [bucket for bucket in kept if bucket]

    def _wait(self, work: dist.Work, what: str) -> None:
        """Wait for a collective of this device's replicas (see transport.PeerLink._wait)."""
        if self.backend == "nccl":
            work.wait()
        elif not work.wait(datetime.timedelta(seconds=self.timeout)):
            raise DeviceError(f"The other replicas did not join {what} within "
                              f"{self.timeout:.0f}s (PIPETORCH_TIMEOUT)")


def build(optimizer: torch.optim.Optimizer | None, setting: tuple[int, int] | None,
          meeting: Rendezvous, groups: Sequence[dist.ProcessGroup | None], *, device: int,
          replica: int, timeout: float, wire_device: torch.device, backend: str
          ) -> ShardedStep | None:
    """A worker's sharded step when the options ask for one (`setting`: the minimum elements
    of a sliced weight, and this host process's replicas, which share the state out as in
    PopTorch); None otherwise. Every worker calls it: with several host processes it creates
    each process's groups, in one order everywhere (`groups[d]`: device d of every replica)."""
    if setting is None or setting[1] < 2:
        return None
    min_elements, local = setting
    group, across = groups[device], None
    if local != meeting.replicas:
        processes = meeting.replicas // local
        ranks = {(p, r, d): meeting.rank(p * local + r, d) for p in range(processes)
                 for r in range(local) for d in range(meeting.devices)}
        shares = {(p, d): dist.new_group([ranks[p, r, d] for r in range(local)])
                  for p in range(processes) for d in range(meeting.devices)}
        slices = {(r, d): dist.new_group([ranks[p, r, d] for p in range(processes)])
                  for r in range(local) for d in range(meeting.devices)}
        group, across = shares[replica // local, device], slices[replica % local, device]
    if optimizer is None:
        return None
    assert group is not None, "several replicas: every device has its group"
    return ShardedStep(optimizer, rank=replica % local, replicas=local, group=group,
                       min_elements=min_elements, timeout=timeout, wire_device=wire_device,
                       backend=backend, across=across)


def _grad(found: Slice) -> torch.Tensor:
    grad = found.param.grad
    assert grad is not None, "a bucket holds only weights with a gradient"
    return grad


def _weight(found: Slice) -> torch.Tensor:
    return found.param.detach()


def _sliced_value(value: object, param: torch.Tensor) -> bool:
    """Whether a state value is per element of its weight (a moment), not a scalar (step)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == param.numel()
