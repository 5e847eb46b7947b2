"""Seed 003's data parallelism: images/s of plain PyTorch and pipetorch with 1 and 2 replicas.

The multi-IPU hands-on session (seed 003) trains a ResNet on one device, data parallel
(`opts.replicationFactor(2)`), model parallel (`model.layer4 = poptorch.BeginBlock(model.layer4,
ipu_id=1)`) and both (2 stages x 2 replicas = 4 devices, gradient accumulation 3). Here it is
scaled to a small CPU machine: examples/multi_device.py's small ResNet (torchvision's layout,
one block per layer, GroupNorm) on generated 32x32 images, micro-batches of B=16, gradient
accumulation G=3, D=4 device iterations per host call and SGD(lr=0.05, momentum=0.9). Each
call trains on D*G*R*B images: every replica keeps the micro-batch and accumulation of the
one-device run, so R=2 does twice the work of R=1 per optimiser step (weak scaling).

Rows: plain PyTorch (the same accumulation loop) and pipetorch R=1 (one device: the
in-process engine), each with all cores as intra-op threads (the baseline) and with 1 thread
(on a busy machine several threads per core wait on each other; 1 thread shows the work without
that); R=2 (one worker process per replica, cores // 2 threads each) and R=2 with the model
split at layer4 (2 stages x 2 replicas = 4 worker processes, cores // 4 threads each, at least
1). Images/s is the median over the timed host calls after compile and one warm-up call.

The all-reduce fraction comes from the workers' traces (every timed call): for each worker and
optimiser step, the time of its "AR" span (the replicas' gradients summed with
torch.distributed; it includes waiting for the other replica to arrive) over the step's time,
from its first action to the end of its "STEP"; averaged over workers and steps. With
PIPETORCH_OVERLAP=1 (the default) most buckets start during the last backward and "AR" is
only what is left and the wait (benchmarks/overlap.py compares both).

    python benchmarks/replicas.py             # full run (about 2 minutes on 2 cores)
    python benchmarks/replicas.py --quick     # tiny model, 1 timed call (a smoke test)
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import multi_device  # noqa: E402  (examples/ is not a package; the workers get sys.path too)

import pipetorch as poptorch  # noqa: E402
from pipetorch.parallel.layout.placement import cpu_cores, live_workers  # noqa: E402
from bench_timing import time_calls  # noqa: E402

ACCUMULATION = 3       # seed 003's gradientAccumulation(3), the least 2 pipelined stages train with
LEARNING_RATE = 0.05
SPLIT_AT = "layer4"    # seed 003's model.layer4 = poptorch.BeginBlock(model.layer4, ipu_id=1)
TWO = "pipetorch R=2, 2 devices"
BOTH = "pipetorch R=2 x 2 stages, 4 devices"


def plain(threads: int) -> str:
    return f"plain PyTorch, {threads} thread{'s' if threads > 1 else ''}"


def one_device(threads: int) -> str:
    return f"pipetorch R=1, 1 device, {threads} thread{'s' if threads > 1 else ''}"


@dataclass(frozen=True)
class Bench:
    """The model's size and the batch layout of one host call."""

    width: int             # channels of the small ResNet's first layer
    image_size: int
    micro_batch: int
    device_iterations: int

    def images_per_call(self, replicas: int) -> int:
        return self.device_iterations * ACCUMULATION * replicas * self.micro_batch


def new_model(bench: Bench, *, split: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)  # every row starts from the same weights
    model, _ = multi_device.build_model("small", "group", bench.width)
    if split:
        setattr(model, SPLIT_AT, poptorch.BeginBlock(getattr(model, SPLIT_AT), ipu_id=1))
    return multi_device.ClassifierWithLoss(model)


def make_data(bench: Bench, replicas: int) -> tuple[torch.Tensor, torch.Tensor]:
    images = multi_device.generated_images(bench.images_per_call(replicas), bench.image_size,
                                           seed=0)
    return images.tensors[0], images.tensors[1]


# -- rows ------------------------------------------------------------------------------------
@dataclass
class Measured:
    rate: float                  # median images/s
    traces: list                 # every timed call's engine.last_trace, concatenated
    worker_threads: list[int]    # intra-op threads of each worker process (empty in process)


def plain_rate(bench: Bench, *, threads: int, calls: int) -> Measured:
    """The loop pipetorch runs for R=1 (D steps of G micro-batches), in plain PyTorch."""
    torch.set_num_threads(threads)
    model = new_model(bench)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE, momentum=0.9)
    images, labels = make_data(bench, 1)
    b = bench.micro_batch

    def call() -> None:
        for d in range(bench.device_iterations):
            optimizer.zero_grad(set_to_none=True)
            for g in range(ACCUMULATION):
                at = (d * ACCUMULATION + g) * b
                _, loss = model(images[at:at + b], labels[at:at + b])
                (loss / ACCUMULATION).backward()
            optimizer.step()

    seconds = time_calls(call, calls)
    return Measured(bench.images_per_call(1) / statistics.median(seconds), [], [])


def pipetorch_rate(bench: Bench, *, replicas: int, split: bool, threads: int,
                   calls: int) -> Measured:
    torch.set_num_threads(threads)  # the in-process engine's threads (R=1, one stage)
    model = new_model(bench, split=split)
    opts = poptorch.Options().deviceIterations(bench.device_iterations)
    opts.replicationFactor(replicas)
    opts.Training.gradientAccumulation(ACCUMULATION)
    opts.showCompilationProgressBar(False)
    training = poptorch.trainingModel(
        model, opts, poptorch.optim.SGD(model.parameters(), lr=LEARNING_RATE, momentum=0.9))
    data = make_data(bench, replicas)
    traces: list = []
    try:
        training.compile(*data)
        workers = [w["threads"] for w in live_workers() if w.get("host_pid") == os.getpid()]
        engine = training._compiled.engine
        seconds = time_calls(lambda: training(*data), calls,
                             lambda: traces.extend(getattr(engine, "last_trace", [])))
    finally:
        training.destroy()
    return Measured(bench.images_per_call(replicas) / statistics.median(seconds), traces, workers)


# -- the all-reduce's share of a step --------------------------------------------------------
@dataclass(frozen=True)
class Reduction:
    fraction: float    # all-reduce time / step time, averaged over workers and steps
    reduce_ms: float   # mean all-reduce ms per worker and step
    step_ms: float     # mean step ms (first action to the end of STEP)
    gradient_bytes: int  # the largest stage's all-reduced gradients, in bytes
    steps: int         # (worker, step) pairs averaged


def all_reduce_share(traces: list) -> Reduction:
    """Split each worker's spans into optimiser steps (each ends with STEP) and compare times."""
    fractions, reduces, steps, sizes = [], [], [], []
    for trace in traces:
        first, reduce_ns, nbytes = None, 0, 0
        for span in trace.spans:
            if span.kind in ("H2D", "D2H"):  # the call's inputs and outputs, not a step's work
                continue
            first = span.start if first is None else first
            if span.kind == "AR":
                reduce_ns += span.end - span.start
                nbytes += span.nbytes  # sent plus received: twice the buffer
            elif span.kind == "STEP":
                step_ns = span.end - first
                fractions.append(reduce_ns / step_ns)
                reduces.append(reduce_ns / 1e6)
                steps.append(step_ns / 1e6)
                sizes.append(nbytes)
                first, reduce_ns, nbytes = None, 0, 0
    if not fractions:
        raise RuntimeError("the workers' traces hold no optimiser step (no STEP span)")
    return Reduction(statistics.fmean(fractions), statistics.fmean(reduces),
                     statistics.fmean(steps), max(sizes) // 2, len(fractions))


def stage_compute_ms(traces: list) -> dict[int, float]:
    """Forward+backward ms per optimiser step of each stage, averaged over replicas and steps."""
    totals: dict[int, list[float]] = {}
    for trace in traces:
        steps = sum(1 for s in trace.spans if s.kind == "STEP")
        busy = sum(s.end - s.start for s in trace.spans if s.kind in ("F", "B")) / 1e6
        totals.setdefault(trace.stage, []).append(busy / max(steps, 1))
    return {stage: statistics.fmean(ms) for stage, ms in sorted(totals.items())}


# -- report ----------------------------------------------------------------------------------
def run(bench: Bench, *, calls: int, cores: int) -> None:
    print(f"{cores} cores; torch {torch.__version__}. Small ResNet (width {bench.width}, "
          f"GroupNorm) on {bench.image_size}x{bench.image_size} images; B{bench.micro_batch} "
          f"G{ACCUMULATION} D{bench.device_iterations}: {bench.images_per_call(1)} images per "
          f"call per replica; SGD lr {LEARNING_RATE} momentum 0.9; median of {calls} call(s) "
          "after compile and a warm-up call.")
    print(f"Threads: the in-process rows use the threads they name; each worker gets cores // "
          f"workers (at least 1): the R=2 workers {max(1, cores // 2)} thread(s) each while R=1 "
          f"gets {cores}, the 4 workers {max(1, cores // 4)} each. R=2 gets no more compute than "
          f"R=1, only the same {cores} cores split between its replicas, so its scaling is "
          "bounded by the cores, not by the replicas.\n")
    # (row, baselines its ratios are taken to); the 1-thread rows show what a thread per core
    # gives without the contention of several threads on each core of a busy machine
    plan: list[tuple[str, Callable[[], Measured], tuple[str, ...]]] = []
    for threads in sorted({1, cores}):
        plan.append((plain(threads), lambda t=threads: plain_rate(bench, threads=t, calls=calls),
                     ()))
    for threads in sorted({1, cores}):
        plan.append((one_device(threads), lambda t=threads: pipetorch_rate(
            bench, replicas=1, split=False, threads=t, calls=calls), (plain(threads),)))
    for name, split in ((TWO, False), (BOTH, True)):
        plan.append((name, lambda split=split: pipetorch_rate(
            bench, replicas=2, split=split, threads=cores, calls=calls),
            (plain(cores), one_device(cores)) + ((one_device(1),) if cores > 1 else ())))
    rows = {name: measure() for name, measure, _ in plan}
    width = max(len(name) for name in rows) + 2
    print(f"{'case':<{width}}{'images/s':>10}  {'worker threads':<16}ratios")
    for name, _, baselines in plan:
        measured = rows[name]
        threads = str(measured.worker_threads) if measured.worker_threads else "in process"
        ratios = "; ".join(f"{measured.rate / rows[b].rate:.2f}x {b}" for b in baselines)
        print(f"{name:<{width}}{measured.rate:>10,.1f}  {threads:<16}{ratios}")
    print("\nall-reduce per optimiser step (workers' AR spans, waiting for the other replica "
          "included; step: first action to the end of STEP):")
    for name in (TWO, BOTH):
        share = all_reduce_share(rows[name].traces)
        compute = ", ".join(f"stage {s} {ms:.1f} ms" for s, ms in
                            stage_compute_ms(rows[name].traces).items())
        print(f"  {name}: all-reduce fraction {share.fraction:.3f} ({share.reduce_ms:.2f} ms of "
              f"a {share.step_ms:.1f} ms step; {share.gradient_bytes / 1e3:.0f} kB of gradients "
              f"on the largest stage; "
              f"{share.steps} worker-steps); forward+backward per step: {compute}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="a tiny model on 16x16 images, D=1, 1 timed call (a smoke test)")
    parser.add_argument("--calls", type=int, default=None,
                        help="timed host calls per row after the warm-up (default: 7, quick: 1)")
    args = parser.parse_args()
    if args.calls is not None and args.calls < 1:
        parser.error(f"--calls must be at least 1, got {args.calls}")
    calls = args.calls or (1 if args.quick else 7)
    bench = Bench(4, 16, 4, 1) if args.quick else Bench(16, 32, 16, 4)
    run(bench, calls=calls, cores=cpu_cores())


if __name__ == "__main__":
    main()
