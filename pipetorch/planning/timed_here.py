"""Each segment of a model (`segments.measure`) timed for real on this CPU, and the machine's
other rates a plan needs: `measure_here` runs the model with a worker's threads and reads the
clock where each segment's forward and backward begin and end, times a zero-bubble backward's
two parts, an optimiser step, a copy, and an all-reduce between two worker interpreters (one
of which also gives a worker's memory outside the model).
"""
from __future__ import annotations

import copy
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from pipetorch.losses import tensor_leaves
from pipetorch.parallel.host import pool, preload
from pipetorch.parallel.worker.split_backward import backward_input, backward_weight
from pipetorch.partition.probe import modes_kept
from pipetorch.planning.memory import module_tensors
from pipetorch.planning.segments import Piece, layer_list, layer_units

__all__: list[str] = []


@dataclass(frozen=True)
class Rates:
    """This machine's measured speed: each piece's forward and backward seconds on one
    micro-batch (the model run for real with a worker's threads), seconds of an optimiser
    step per parameter element, bytes a second of a copy (what a transfer through shared
    memory does twice) and of an all-reduce between two workers, and a worker process's
    memory outside the model; `crowding`: how much slower a worker computes when the run's
    workers outnumber the cores (4 one-thread workers on 2 cores: 2), else 1; `split`: a
    zero-bubble backward's two parts, the input's gradient and the weights', as shares of a
    whole backward (`_split_shares`)."""

    seconds: list[tuple[float, float]]  # per piece: (forward, backward)
    step_per_element: float
    copy_rate: float
    all_reduce_rate: float
    overhead: int
    crowding: float = 1.0
    split: tuple[float, float] = (0.5, 0.5)


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
    names = {n for n, _ in layer_units(model)}
    before = [] if pieces[0].name in names else [least[0]]
    after = [] if pieces[-1].name in names else [least[-1]]
    return [*before, *least[1:-1], *after]


def _split_shares(model: nn.Module, inputs: tuple[tuple, dict], rounds: int = 2
                  ) -> tuple[float, float]:
    """A zero-bubble stage's backward in its two parts as the workers run them
    (`split_backward`: the input's gradient, recording where the weights' subgraphs join it,
    then an autograd call per group of weights), each as a share of a whole backward: timed
    here on the model from its first layer's input (made a leaf, as a stage's received input
    is), the least of `rounds` runs after one to warm up. They add up to more than one: the
    weights' calls walk their subgraphs again. (1.0, 0.0) when it cannot split."""
    layers, leaf = _layers(model), list[torch.Tensor]()

    def cut(_: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        leaf.clear()

        def swap(t: object) -> object:
            if isinstance(t, torch.Tensor) and t.requires_grad and not leaf:
                leaf.append(t.detach().requires_grad_())
                return leaf[0]
            return t
        return torch.utils._pytree.tree_map(swap, (args, kwargs))

    handle = layers[0].register_forward_pre_hook(cut, with_kwargs=True)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = {p: p.grad for p in params}
    args, kwargs = torch.utils._pytree.tree_map(
        lambda t: _real(t) if isinstance(t, torch.Tensor) else t, inputs)
    whole, first, second = [], [], []

    def loss() -> torch.Tensor:
        return tensor_leaves(model(*args, **kwargs))[0].float().sum()
    try:
        with torch.random.fork_rng():
            for _ in range(rounds + 1):
                out = loss()
                start = _clock()
                out.backward()
                whole.append(_clock() - start)
                out = loss()
                start = _clock()
                deferred = backward_input([out], [None], leaf, params)
                middle = _clock()
                backward_weight(deferred)
                first.append(middle - start)
                second.append(_clock() - middle)
                if deferred is None:
                    return 1.0, 0.0
    finally:
        handle.remove()
        for p, g in grads.items():
            p.grad = g
    least = min(whole[1:]) or 1.0
    return min(first[1:]) / least, min(second[1:]) / least


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
    _, layers = layer_list(model)
    if layers is None:
        raise ValueError("measure_here times the model's layer list (its largest ModuleList) "
                         "and what runs around it; this model has none: give flops instead")
    return layers


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
            split = _split_shares(real, inputs)
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
                 crowding=max(1.0, workers * each / cores), split=split)


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
