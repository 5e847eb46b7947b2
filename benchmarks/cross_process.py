"""One pipeline over two processes on 127.0.0.1: pipetorch against torch.distributed.pipelining.

Two torchrun processes (this script starts `torchrun --nproc-per-node 2` on itself) each hold
one stage of the same model: an MLP of LAYERS Linear(W, W) + tanh layers and a classifier,
split in the middle. pipetorch runs it with `opts.Distributed.stagesAcrossProcesses(True)`
(each process runs its stage's worker; activations and gradients cross between the workers
through gloo); torch.distributed.pipelining runs Schedule1F1B over the two host processes
themselves (gloo). Both: G micro-batches of B per optimiser step (the mean over them), SGD
with momentum, one intra-op thread per stage, the same initial weights and data, so both
print the same losses. The two take turns call by call (ABAB), after one warm-up call each;
samples/s is the median over the timed calls.

    python benchmarks/cross_process.py            # about a minute on 2 cores
    python benchmarks/cross_process.py --quick    # a tiny model, 2 timed calls (a smoke test)
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import pipelining

import pipetorch as poptorch

LAYERS, CLASSES, LEARNING_RATE = 4, 10, 0.01
PIPETORCH = "pipetorch, stagesAcrossProcesses (1F1B)"
TORCH = "torch.distributed.pipelining Schedule1F1B"


def layers(width: int) -> list[nn.Module]:
    torch.manual_seed(0)
    found: list[nn.Module] = []
    for _ in range(LAYERS):
        found += [nn.Linear(width, width), nn.Tanh()]
    return found + [nn.Linear(width, CLASSES)]


class Net(nn.Module):
    """The whole model for pipetorch: the second half on ipu 1 (the second process)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        found = layers(width)
        half = len(found) // 2
        self.first = nn.Sequential(*found[:half])
        self.second = poptorch.BeginBlock(nn.Sequential(*found[half:]), ipu_id=1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.second(self.first(x))
        return out, nn.functional.cross_entropy(out, labels)


def torch_stage(rank: int, width: int) -> nn.Module:
    found = layers(width)
    half = len(found) // 2
    return nn.Sequential(*(found[:half] if rank == 0 else found[half:]))


def run(args: argparse.Namespace) -> None:
    """One of the two torchrun processes."""
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # the host processes' own group, for pipelining
    g = torch.Generator().manual_seed(1)
    step = args.accumulation * args.batch
    data = [(torch.randn(step, args.width, generator=g),
             torch.randint(0, CLASSES, (step,), generator=g)) for _ in range(args.calls + 1)]

    opts = poptorch.Options().showCompilationProgressBar(False)
    opts.outputMode(poptorch.OutputMode.All)
    opts.Training.gradientAccumulation(args.accumulation)
    opts.Distributed.stagesAcrossProcesses(True)
    model = Net(args.width)
    wrapper = poptorch.trainingModel(model, opts, optimizer=torch.optim.SGD(
        model.parameters(), lr=LEARNING_RATE, momentum=0.9))

    module = torch_stage(rank, args.width)
    stage = pipelining.PipelineStage(module, rank, 2, torch.device("cpu"))
    schedule = pipelining.Schedule1F1B(stage, n_microbatches=args.accumulation,
                                       loss_fn=nn.CrossEntropyLoss())
    optimizer = torch.optim.SGD(module.parameters(), lr=LEARNING_RATE, momentum=0.9)
    losses: dict[str, list[float]] = {PIPETORCH: [], TORCH: []}

    def pipetorch_call(x: torch.Tensor, y: torch.Tensor) -> None:
        losses[PIPETORCH].append(float(wrapper(x, y)[1].mean()))

    def torch_call(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad(set_to_none=True)
        found: list[torch.Tensor] = []
        schedule.step(*((x,) if rank == 0 else ()),
                      **({"target": y, "losses": found} if rank == 1 else {}))
        optimizer.step()
        if rank == 1:
            losses[TORCH].append(float(torch.stack(found).detach().mean()))

    seconds: dict[str, list[float]] = {PIPETORCH: [], TORCH: []}
    for x, y in data:  # ABAB: the first call of each is its warm-up
        for name, call in ((PIPETORCH, pipetorch_call), (TORCH, torch_call)):
            dist.barrier()
            start = time.perf_counter()
            call(x, y)
            dist.barrier()
            seconds[name].append(time.perf_counter() - start)
    wrapper.destroy()
    if rank == 1:  # the losses are on the last stage's process (pipetorch's on both)
        print(f"width {args.width}, {LAYERS} layers + classifier, B={args.batch}, "
              f"G={args.accumulation}, {args.calls} timed calls, 2 processes on 127.0.0.1")
        print(f"{'':44s} {'samples/s':>10s} {'s/call':>8s}")
        for name, times in seconds.items():
            median = statistics.median(times[1:])
            print(f"{name:44s} {step / median:10.1f} {median:8.4f}")
        gap = max(abs(a - b) for a, b in zip(losses[PIPETORCH], losses[TORCH]))
        print(f"largest difference of a call's mean loss between the two: {gap:.2e}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--accumulation", type=int, default=8)
    args = parser.parse_args()
    if args.quick:
        args.calls, args.width, args.batch, args.accumulation = 2, 32, 4, 4
    if "RANK" in os.environ:
        run(args)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PIPETORCH_THREADS_PER_DEVICE": "1"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
                    "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
                    str(port), __file__, *sys.argv[1:]], check=True, env=env)


if __name__ == "__main__":
    main()
