"""A model's candidate segments measured on fake tensors (the planner's cost table), and each
segment timed for real on this CPU.

The segments are what runs before the model's layer list (its largest ModuleList), each layer,
and what runs after it; code between two layers counts with the one before. One forward on
fake tensors under saved-tensor hooks (as `memory.measure_forward` sizes a stage) gives each
segment's Footprint, and a FlopCounterMode its forward FLOPs. Identical layers (same class and
parameter shapes) are measured once: for that forward the others stand aside, giving back the
first one's output, so forward may walk the list any way it likes. `measure_here` runs the
model for real with a worker's threads and reads the clock where each segment's forward and
backward begin and end.
"""
from __future__ import annotations

import copy
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass, field, replace
from typing import Callable, TypedDict

import torch
import torch.nn as nn

from pipetorch.losses import tensor_leaves
from pipetorch.parallel.host import pool, preload
from pipetorch.partition.probe import modes_kept
from pipetorch.planning.memory import (
    ZERO, Footprint, Size, fake_tensors, faked, largest, module_tensors, sized, storage_key,
)

__all__: list[str] = []

@dataclass(eq=False)
class Piece:
    """A candidate segment: what one forward leaves on it, its forward FLOPs, its tensors."""

    name: str
    params: list[nn.Parameter] = field(default_factory=list)
    buffers: list[torch.Tensor] = field(default_factory=list)
    received: dict[int, Size] = field(default_factory=dict)
    saved: dict[int, Size] = field(default_factory=dict)
    outputs: dict[int, Size] = field(default_factory=dict)
    flops: int = 0

    def footprint(self) -> Footprint:
        kept = self._kept()

        def total(sizes: dict[int, Size]) -> Size:
            return sum(sizes.values(), ZERO)

        return Footprint(total(self.received), total(kept), total(self.outputs),
                         largest([*kept.values(), *self.outputs.values()]))

    def small(self, threshold: int) -> int:
        """Bytes of what one forward leaves on it (kept for backward or produced) in tensors
        of fewer than `threshold` bytes each."""
        return sum(s.bytes for s in (*self._kept().values(), *self.outputs.values())
                   if s.bytes < threshold)

    def _kept(self) -> dict[int, Size]:
        return {k: v for k, v in self.saved.items()
                if k not in self.received and k not in self.outputs}


def _layer_list(model: nn.Module) -> tuple[str, nn.ModuleList | None]:
    """The ModuleList holding the most parameters (the layers), with its path."""
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        return "", None
    return max(lists, key=lambda nm: sum(p.numel() for p in nm[1].parameters()))


def _signature(module: nn.Module) -> tuple:
    return (type(module).__name__,
            tuple((n, tuple(t.shape), t.dtype) for n, t in module.state_dict().items()))


class _FlashAttention(torch.autograd.Function):
    """What flash attention keeps for backward: q, k, v, the output and one float32 log-sum-exp
    per query and head, never the scores."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> torch.Tensor:
        out = q.new_empty((*q.shape[:-1], v.shape[-1]))
        ctx.save_for_backward(q, k, v, out, q.new_empty(q.shape[:-1], dtype=torch.float32))
        return out


class _State(TypedDict, total=False):
    """What `measure`'s hooks share: the piece running, the FLOPs counted when it began, the
    identical layers stood in for so far, and the output of the last layer run (`again`)."""

    at: int
    flops: int
    stood: int
    again: object


def measure(model: nn.Module, inputs: tuple[tuple, dict], *, flash: bool = False) -> list[Piece]:
    """The candidate segments of `model` run on one micro-batch `inputs` (args, kwargs).
    With `flash`, scaled_dot_product_attention keeps what flash attention keeps (a GPU's
    kernel; on the meta device it would run the math one, which keeps the scores)."""
    from torch.utils.flop_counter import FlopCounterMode

    from pipetorch import ops

    _, layers = _layer_list(model)
    units = _units(model) or list(model.named_children())
    same = layers is not None and len(units) > 1 and len({_signature(u) for _, u in units}) == 1
    run = [u for _, u in units[:1]] if same else [u for _, u in units]
    pieces = [Piece(""), *(Piece(n) for n, _ in units[:len(run)]), Piece(""), Piece("")]
    after = len(pieces) - 2  # the last: what runs between identical layers standing aside
    counter = FlopCounterMode(display=False)
    state: _State = {"at": 0, "flops": 0, "stood": 0}
    seen: set[int] = set()
    names = {id(m): n for n, m in model.named_modules()}

    def flush(to: int) -> None:
        total = counter.get_total_flops()
        pieces[state["at"]].flops += total - state["flops"]
        state["flops"], state["at"] = total, to

    def enter(k: int) -> Callable[[nn.Module, tuple, dict], None]:
        def hook(_: nn.Module, args: tuple, kwargs: dict) -> None:
            flush(k)
            pieces[k].received.update(_sizes((args, kwargs), weights))
        return hook

    def leave(k: int) -> Callable[[nn.Module, tuple, object], None]:
        def hook(_: nn.Module, __: tuple, output: object) -> None:
            pieces[k].outputs.update(_sizes(output, weights))
            state["again"] = output
            flush(k if k < len(units) else after)  # code between layers: the one before
        return hook

    def stood_in() -> None:  # an identical layer's turn: what runs until the next is not priced
        state["stood"] += 1
        flush(after if state["stood"] == len(units) - 1 else after + 1)

    def touched(module: nn.Module, *_: tuple) -> None:
        at = pieces[state["at"]]
        if state["at"] in (0, after) and id(module) not in seen | inside:
            seen.add(id(module))
            at.name = at.name or names[id(module)]
            at.params += list(module.parameters(recurse=False))
            at.buffers += list(module.buffers(recurse=False))

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = storage_key(tensor)
        if key not in weights:
            nbytes = tensor.untyped_storage().nbytes()
            pieces[state["at"]].saved.setdefault(key, sized(tensor, nbytes))
        return tensor

    # scaled_dot_product_attention's other arguments (attn_mask, dropout_p, is_causal, scale,
    # enable_gqa) go unread
    def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  *_: torch.Tensor | float | None,
                  **__: torch.Tensor | float | None) -> torch.Tensor:
        # QK^T and PV, as counted
        pieces[state["at"]].flops += 4 * query.numel() * key.shape[-2]
        return _FlashAttention.apply(query, key, value)

    sdpa = nn.functional.scaled_dot_product_attention
    inside = {id(m) for unit in run for m in unit.modules()}
    handles = [h for k, unit in enumerate(run, 1)
               for h in (unit.register_forward_pre_hook(enter(k), with_kwargs=True),
                         unit.register_forward_hook(leave(k)))]
    handles += [m.register_forward_pre_hook(touched) for m in model.modules()
                if m._parameters or m._buffers]
    again = _Again(state, stood_in)
    slots = layers._modules if layers is not None and same else {}
    try:
        for key in list(slots)[1:]:
            slots[key] = again  # the model's own indexing and slicing still work
        if flash:
            nn.functional.scaled_dot_product_attention = attention
        with modes_kept(model), fake_tensors() as mode, ops.running_on_device():
            model.train(True)
            fake = faked(mode)
            # the fake weights are held (a freed storage's key is reused), and their real
            # (meta) tensors' keys kept too: a meta weight may reach an op as it is
            held = [(w, fake(w)) for w in module_tensors(model)]
            weights = {storage_key(t) for pair in held for t in pair}
            args, kwargs = torch.utils._pytree.tree_map(
                lambda t: fake(t) if isinstance(t, torch.Tensor) else t, inputs)
            pieces[0].received.update(_sizes((args, kwargs), weights))
            with torch.enable_grad(), counter, \
                    torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                output = model(*args, **kwargs)
            flush(after)
            pieces[after].outputs.update(_sizes(output, weights))
    finally:
        nn.functional.scaled_dot_product_attention = sdpa
        for key, (_, unit) in zip(list(slots)[1:], units[1:], strict=False):
            slots[key] = unit
        for h in handles:
            h.remove()
    pieces.pop()  # between identical layers standing aside
    middle = pieces[1:-1]
    if same:  # the other identical layers: the first one's sizes, their own tensors
        middle = [replace(middle[0], name=n) for n, _ in units]
    for piece, (_, unit) in zip(middle, units, strict=True):
        piece.params, piece.buffers = list(unit.parameters()), list(unit.buffers())
    pieces = [pieces[0], *middle, pieces[-1]]
    if middle:
        pieces[0].outputs = dict(middle[0].received)
        pieces[-1].received = dict(middle[-1].outputs)
    owned = {id(p) for piece in pieces for p in piece.params}
    pieces[0].params += [p for p in model.parameters() if id(p) not in owned]  # never run
    for piece, default in ((pieces[0], "(before the layers)"), (pieces[-1], "(after them)")):
        piece.name = piece.name or default
    mids = {id(m) for m in middle}
    kept = [p for p in pieces if p.params or p.saved or p.flops or id(p) in mids]
    return kept


class _Again(nn.Module):
    """Stands in for an identical layer while measuring: gives back the first layer's output
    (the same shapes), so the layer list is run once whatever way forward walks it."""

    def __init__(self, state: _State, turn: Callable[[], None]) -> None:
        super().__init__()
        self.state, self.turn = state, turn

    def forward(self, *_: object, **__: object) -> object:
        self.turn()
        return self.state["again"]


def _sizes(value: object, weights: set[int]) -> dict[int, Size]:
    return {storage_key(t): sized(t, t.untyped_storage().nbytes())
            for t in tensor_leaves(value) if storage_key(t) not in weights}


@dataclass(frozen=True)
class Rates:
    """This machine's measured speed: each piece's forward and backward seconds on one
    micro-batch (the model run for real with a worker's threads), seconds of an optimiser
    step per parameter element, bytes a second of a copy (what a transfer through shared
    memory does twice) and of an all-reduce between two workers, and a worker process's
    memory outside the model; `crowding`: how much slower a worker computes when the run's
    workers outnumber the cores (4 one-thread workers on 2 cores: 2), else 1."""

    seconds: list[tuple[float, float]]  # per piece: (forward, backward)
    step_per_element: float
    copy_rate: float
    all_reduce_rate: float
    overhead: int
    crowding: float = 1.0


def _real(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, or a real CPU one for a meta tensor: random floats, integer zeros."""
    if not tensor.is_meta:
        return tensor
    if tensor.dtype.is_floating_point:
        return torch.randn(tensor.shape, dtype=tensor.dtype)
    return (torch.ones if tensor.dtype == torch.bool else torch.zeros)(tensor.shape,
                                                                        dtype=tensor.dtype)


def _materialised(model: nn.Module) -> nn.Module:
    """`model` itself, or a copy on the CPU with random weights where it is on meta."""
    if not any(t.is_meta for t in module_tensors(model)):
        return model
    real = copy.deepcopy(model).to_empty(device="cpu")
    with torch.no_grad():
        for t in module_tensors(real):
            t.normal_(0, 0.02) if t.is_floating_point() else t.fill_(1)
    return real


def _piece_seconds(model: nn.Module, pieces: list[Piece], inputs: tuple[tuple, dict],
                   rounds: int = 3) -> list[tuple[float, float]]:
    """Each piece's (forward, backward) seconds: the whole model run for real, the clock read
    where each layer begins and ends and, in backward, where the gradient of a layer's input
    (and of the last layer's output) arrives; code between layers counts with the one before,
    as `measure` counts FLOPs. The least of `rounds` runs after one to warm up (what other
    work on the machine slowed the least); gradients accumulate as in a step, and the model's
    gradients and the RNG are left as they were."""
    layers = _layers(model)
    count = len(layers)
    marks: dict[tuple[str, int], float] = {}

    def first_grad(value: object) -> torch.Tensor | None:
        return next((t for t in tensor_leaves(value) if t.requires_grad), None)

    def mark(key: tuple[str, int]) -> Callable[..., None]:
        return lambda *_: marks.__setitem__(key, _clock())

    def enter(k: int) -> Callable[..., None]:
        def hook(_: nn.Module, args: tuple, kwargs: dict) -> None:
            mark(("enter", k))()
            hidden = first_grad((args, kwargs))
            if hidden is not None:
                hidden.register_hook(mark(("grad in", k)))
        return hook

    def leave(_: nn.Module, __: tuple, output: object) -> None:
        mark(("leave", count - 1))()
        hidden = first_grad(output)
        if hidden is not None:
            hidden.register_hook(mark(("grad out", count - 1)))

    handles = [u.register_forward_pre_hook(enter(k), with_kwargs=True)
               for k, u in enumerate(layers)] + [layers[-1].register_forward_hook(leave)]
    grads = {p: p.grad for p in model.parameters()}
    args, kwargs = torch.utils._pytree.tree_map(
        lambda t: _real(t) if isinstance(t, torch.Tensor) else t, inputs)
    runs = []
    try:
        with torch.random.fork_rng():
            for _ in range(rounds + 1):
                start = _clock()
                loss = tensor_leaves(model(*args, **kwargs))[0].float().sum()
                middle = _clock()
                loss.backward()
                runs.append(_split(marks, count, start, middle, _clock()))
    finally:
        for h in handles:
            h.remove()
        for p, g in grads.items():
            p.grad = g
    least = [(min(r[k][0] for r in runs[1:]), min(r[k][1] for r in runs[1:]))
             for k in range(count + 2)]
    names = {n for n, _ in _units(model)}
    before = [] if pieces[0].name in names else [least[0]]
    after = [] if pieces[-1].name in names else [least[-1]]
    return [*before, *least[1:-1], *after]


def _split(marks: dict[tuple[str, int], float], count: int, start: float, middle: float,
           end: float) -> list[tuple[float, float]]:
    """(forward, backward) seconds of before, each layer, after, from one run's marks."""
    enter = [marks[("enter", k)] for k in range(count)] + [marks[("leave", count - 1)]]
    grad = [marks.get(("grad in", k), end) for k in range(count)]
    grad += [marks.get(("grad out", count - 1), middle)]
    forward = [enter[0] - start, *(b - a for a, b in zip(enter, enter[1:], strict=False)),
               middle - enter[-1]]
    backward = [end - grad[0], *(a - b for a, b in zip(grad, grad[1:], strict=False)),
                grad[-1] - middle]
    return list(zip(forward, backward, strict=True))


def _layers(model: nn.Module) -> nn.ModuleList:
    _, layers = _layer_list(model)
    if layers is None:
        raise ValueError("measure_here times the model's layer list (its largest ModuleList) "
                         "and what runs around it; this model has none: give flops instead")
    return layers


def _units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    path, layers = _layer_list(model)
    return [(f"{path}.{i}", u) for i, u in enumerate(layers)] if layers is not None else []


def copy_rate() -> float:
    """Bytes a second of one copy of 32 MiB (a transfer through shared memory is two)."""
    source, target = torch.ones(2**23), torch.empty(2**23)
    return source.nbytes / _least(lambda: target.copy_(source), 5)


def _clock() -> float:
    """Seconds this thread has run on a CPU when torch computes in it alone (one thread, as
    a worker sharing 2 cores with another gets): what other work on the machine does not
    slow, so the plan is the step of a quiet machine; else the wall clock."""
    return time.thread_time() if torch.get_num_threads() == 1 else time.perf_counter()


def _least(work: Callable[[], object], rounds: int) -> float:
    """The fewest seconds `work` took in `rounds` runs after one to warm up."""
    work()
    times = []
    for _ in range(rounds):
        start = _clock()
        work()
        times.append(_clock() - start)
    return min(times)


def measure_here(model: nn.Module, pieces: list[Piece], inputs: tuple[tuple, dict],
                 make: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                 workers: int) -> Rates:
    """Time each piece's forward and backward, an optimiser step on the first layer, a copy
    and an all-reduce between two workers for real on this CPU, with the threads a worker gets (a model on meta is made real
    on the CPU first: a CPU run must hold it anyway); and a worker's interpreter's resident
    memory. `workers`: the run's worker processes on this CPU (stages x replicas), which
    share its cores."""
    from pipetorch.parallel.layout.placement import cpu_cores

    _layers(model)
    cores = cpu_cores()
    threads, each = torch.get_num_threads(), max(1, cores // workers)
    torch.set_num_threads(each)
    try:
        real = _materialised(model)
        with modes_kept(real):
            real.train(True)
            seconds = _piece_seconds(real, pieces, inputs)
        layer = copy.deepcopy(_layers(real)[0])
        stepper = make(list(layer.parameters()))
        for p in layer.parameters():
            p.grad = torch.zeros_like(p)
        per_element = _least(stepper.step, 3) / sum(p.numel() for p in layer.parameters())
        rate = copy_rate()
    finally:
        torch.set_num_threads(threads)
    overhead, all_reduce_rate = _workers(each, preload.libraries(model))
    return Rates(seconds, per_element, rate, all_reduce_rate, overhead,
                 crowding=max(1.0, workers * each / cores))


_WORKER = """
import datetime, importlib, os, sys, time, torch, torch._dynamo, torch.distributed as dist
import torch.optim, pipetorch.parallel.worker.serve
rank, path, threads, fork = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
for name in sys.argv[5:]:
    try:
        importlib.import_module(name)
    except Exception:
        pass
if fork:  # as the zygote forks a worker: its anonymous pages come along, not its file pages
    child = os.fork()
    if child:
        os._exit(os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]))
torch.set_num_threads(threads)
dist.init_process_group("gloo", init_method="file://" + path, rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
layer = torch.nn.Linear(64, 64)
torch.optim.AdamW(layer.parameters()).step(layer(torch.ones(8, 64)).sum().backward())
rss = int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) * 1024
bucket = torch.ones(2**23)
dist.all_reduce(bucket)
times = []
for _ in range(4):
    start = time.perf_counter()
    dist.all_reduce(bucket)
    times.append(time.perf_counter() - start)
print(rss, bucket.nbytes / min(times), flush=True)
dist.destroy_process_group()
"""


def _workers(threads: int, libraries: tuple[str, ...]) -> tuple[int, float]:
    """Two interpreters started as stage workers are (forked from one that imported torch,
    pipetorch's worker and the model's `libraries`, as the worker pool's zygote does, unless
    the pool is off): one's resident bytes once it has run a step of a small layer in its
    process group (its VmRSS: ru_maxrss would carry this process's peak over the exec), and
    the bytes a second of an all-reduce of 32 MiB between them over gloo (how tied weights
    cross), the fastest of 4."""
    fork = "1" if pool.enabled() else "0"
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "rendezvous")
        workers = [subprocess.Popen(pool.python_command("-c", _WORKER, str(rank), path,
                                                        str(threads), fork, *libraries),
                                    stdout=subprocess.PIPE, text=True, env=pool.worker_env())
                   for rank in (0, 1)]
        try:
            outs = [w.communicate(timeout=120)[0] for w in workers]
        finally:
            for w in workers:
                w.kill()
    if any(w.returncode for w in workers):
        raise RuntimeError("measure_here: the two probe workers (gloo all-reduce) failed, "
                           f"exit codes {[w.returncode for w in workers]}")
    rss, rate = outs[0].split()
    return int(rss), float(rate)
