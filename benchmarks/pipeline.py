"""Seed 000's pipeline: images/s of plain PyTorch, pipetorch on 1 and 2 devices, torch's 1F1B.

Each model trains with micro-batches of 40, gradient accumulation G=10 (one optimiser step per
400 images), D device iterations per host call and AdamW(lr=0.001), on synthetic images made
once and shared by every row:

    seed   seed 000's CNN (blocks B1..B4) on 28x28 images, D=10
    heavy  the same CNN on 128x128 images (its linear layer grows to match), D=2; its first
           layer is widened when the seed's widths give no split within 10% of balance

Rows: plain PyTorch (the same accumulation loop) with 1 thread and with all cores; pipetorch
with every block on ipu 0 (the in-process engine) with the same thread counts; pipetorch
sharded and pipelined over 2 devices (one worker per stage, cores // 2 threads each); and
torch.distributed.pipelining's Schedule1F1B on the same split (2 processes, gloo, 1 thread
each). Each row is timed over steady-state host calls (compile, start-up and one warm-up call
excluded); images/s is the median. The stage split is chosen by timing each block's
forward+backward on one micro-batch with 1 thread (process CPU time, so other load on the
machine distorts it less) and cutting where the two stages' times are closest.

    python benchmarks/pipeline.py                      # full run (~10 min on 2 quiet cores)
    python benchmarks/pipeline.py --quick --models seed
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

import pipetorch as poptorch
from pipetorch.parallel.placement import cpu_cores, live_workers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_timing import median_rate  # noqa: E402

BLOCKS = ("B1", "B2", "B3", "B4")
MICRO_BATCH = 40
ACCUMULATION = 10
LEARNING_RATE = 0.001
BALANCED = 1.10  # slower stage / faster stage at or below this counts as balanced
PIPELINED = "pipetorch, pipelined over 2 devices"
PROFILED = "pipetorch, pipelined over 2 devices, profiling on"
UNPROFILED = "pipetorch, pipelined over 2 devices, profiling off (calls alternating with on)"
SHARDED = "pipetorch, sharded over 2 devices"
TORCH_1F1B = "torch.distributed.pipelining Schedule1F1B"


# -- the model -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Widths:
    """Seed 000's CNN with its input size and layer widths as parameters."""

    image_size: int = 28
    filters: tuple[int, int] = (10, 20)
    hidden: int = 256

    @property
    def features(self) -> int:
        side = ((self.image_size - 4) // 2 - 4) // 2  # two 5x5 convolutions, each pooled by 2
        return self.filters[1] * side * side


class ConvLayer(nn.Module):
    def __init__(self, in_channels: int, num_filters: int, kernel_size: int, pool_size: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, num_filters, kernel_size=kernel_size)
        self.pool = nn.MaxPool2d(kernel_size=pool_size)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.pool(self.conv(x)))


class Network(nn.Module):
    """Seed 000's network (mnist_pipeline.py) with blocks B1..B4."""

    def __init__(self, widths: Widths) -> None:
        super().__init__()
        self.layer1 = ConvLayer(1, widths.filters[0], 5, 2)
        self.layer2 = ConvLayer(widths.filters[0], widths.filters[1], 5, 2)
        self.layer3 = nn.Linear(widths.features, widths.hidden)
        self.layer3_act = nn.ReLU()
        self.layer4 = nn.Linear(widths.hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with poptorch.Block("B1"):
            x = self.layer1(x)
        with poptorch.Block("B2"):
            x = self.layer2(x)
        with poptorch.Block("B3"):
            x = self.layer3_act(self.layer3(torch.flatten(x, 1)))
        with poptorch.Block("B4"):
            x = self.layer4(x)
        return x

    def blocks(self) -> list[nn.Module]:
        """B1..B4 as modules sharing this network's layers (for hand-built stages)."""
        return [self.layer1, self.layer2,
                nn.Sequential(nn.Flatten(1), self.layer3, self.layer3_act), self.layer4]


class WithLoss(nn.Module):
    """Seed 000's TrainingModelWithLoss: (output, loss), the loss in block B4."""

    def __init__(self, model: Network) -> None:
        super().__init__()
        self.model, self.loss = model, nn.CrossEntropyLoss()

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        output = self.model(x)
        with poptorch.Block("B4"):
            loss = self.loss(output, labels)
        return output, loss


def new_network(widths: Widths) -> Network:
    torch.manual_seed(0)  # every row starts from the same weights
    return Network(widths)


# -- benchmark configuration -----------------------------------------------------------------
@dataclass(frozen=True)
class Bench:
    """One model's benchmark: widths, D, the stage split and how it was chosen."""

    name: str
    widths: Widths
    device_iterations: int
    boundary: int = 0                      # stage 0 runs BLOCKS[:boundary]
    block_ms: tuple[float, ...] = ()
    note: str = ""
    targeted: bool = False                 # the issue's targets are set for this model

    @property
    def images_per_call(self) -> int:
        return self.device_iterations * ACCUMULATION * MICRO_BATCH

    @property
    def stage_ms(self) -> tuple[float, float]:
        return sum(self.block_ms[:self.boundary]), sum(self.block_ms[self.boundary:])

    @property
    def split(self) -> str:
        return f"{'+'.join(BLOCKS[:self.boundary])} | {'+'.join(BLOCKS[self.boundary:])}"


def make_data(bench: Bench) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    size = bench.widths.image_size
    images = torch.randn(bench.images_per_call, 1, size, size, generator=generator)
    return images, torch.randint(0, 10, (bench.images_per_call,), generator=generator)


def time_blocks(widths: Widths, *, reps: int) -> list[float]:
    """Forward+backward ms of each block on one micro-batch, 1 thread (min of `reps`)."""
    torch.set_num_threads(1)
    blocks = new_network(widths).blocks()
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(MICRO_BATCH, 1, widths.image_size, widths.image_size, generator=generator)
    labels = torch.randint(0, 10, (MICRO_BATCH,), generator=generator)
    times = []
    for index, block in enumerate(blocks):
        samples = []
        for _ in range(reps + 1):  # the first run warms the allocator and kernels up
            inputs = x.detach().requires_grad_(index > 0)
            start = time.process_time()
            out = block(inputs)
            if index == len(blocks) - 1:
                nn.functional.cross_entropy(out, labels).backward()
            else:
                out.backward(torch.ones_like(out))
            samples.append(time.process_time() - start)
        times.append(min(samples[1:]) * 1e3)
        x = out.detach()
    return times


def closest_split(times: list[float]) -> int:
    return min(range(1, len(times)), key=lambda k: abs(sum(times[:k]) - sum(times[k:])))


def imbalance(times: list[float], boundary: int) -> float:
    first, second = sum(times[:boundary]), sum(times[boundary:])
    return max(first, second) / max(min(first, second), 1e-9)


def balance(bench: Bench, *, reps: int, widen: bool, log: Callable[[str], None]) -> Bench:
    """Pick the boundary where the stages' times are closest; widen layer1 if that is off."""
    times = time_blocks(bench.widths, reps=reps)
    boundary = closest_split(times)
    note = ""
    if widen and imbalance(times, boundary) > BALANCED and boundary == 1 \
            and times[0] < sum(times[1:]):
        # B1's cost grows with layer1's filters while B2's barely moves (measured): widen it
        # until stage 0 catches up with stage 1, keeping the closer of the last two widths.
        seed_widths, seed_times = bench.widths, times
        log(f"  {bench.name}: seed widths give {_ms(times, boundary)} ms (off by "
            f"{imbalance(times, boundary):.2f}x): widening layer1")
        best = (imbalance(times, boundary), bench.widths, times, boundary)
        for filters in (12, 14, 16, 18, 20, 24, 28, 32):
            widths = replace(bench.widths, filters=(filters, bench.widths.filters[1]))
            times = time_blocks(widths, reps=reps)
            boundary = closest_split(times)
            log(f"    layer1 {filters} filters: {_ms(times, boundary)} ms")
            if imbalance(times, boundary) < best[0]:
                best = (imbalance(times, boundary), widths, times, boundary)
            if imbalance(times, boundary) <= BALANCED or sum(times[:boundary]) > sum(times[boundary:]):
                break
        _, widths, times, boundary = best
        if widths != seed_widths:
            note = (f"WIDENED: layer1 has {widths.filters[0]} filters (seed: "
                    f"{seed_widths.filters[0]}) because the seed's layers at this size split "
                    f"at best {_ms(seed_times, closest_split(seed_times))} ms per micro-batch")
        bench = replace(bench, widths=widths)
    return replace(bench, boundary=boundary, block_ms=tuple(times), note=note)


def _ms(times: list[float], boundary: int) -> str:
    return f"{sum(times[:boundary]):.1f} / {sum(times[boundary:]):.1f}"


# -- rows ------------------------------------------------------------------------------------
def plain_rate(bench: Bench, data: tuple[torch.Tensor, torch.Tensor], *, threads: int,
               calls: int) -> float:
    """The accumulation loop pipetorch runs, in plain PyTorch."""
    torch.set_num_threads(threads)
    model = WithLoss(new_network(bench.widths))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    images, labels = data
    step = ACCUMULATION * MICRO_BATCH

    def call() -> None:
        for d in range(bench.device_iterations):
            optimizer.zero_grad(set_to_none=True)
            for g in range(d * step, (d + 1) * step, MICRO_BATCH):
                _, loss = model(images[g:g + MICRO_BATCH], labels[g:g + MICRO_BATCH])
                (loss / ACCUMULATION).backward()
            optimizer.step()

    return median_rate(call, bench.images_per_call, calls)[0]


@dataclass
class Measured:
    rate: float
    seconds: float              # the last timed call's wall time
    traces: list                # engine.last_trace of that call (empty in process)
    worker_threads: list[int]


def training_model(bench: Bench, strategy: object, *,
                   profile: str | None = None) -> poptorch.PoplarExecutor:
    model = WithLoss(new_network(bench.widths))
    opts = poptorch.Options().deviceIterations(bench.device_iterations)
    if profile is not None:
        opts.enableProfiling(profile)
    opts.Training.gradientAccumulation(ACCUMULATION)
    opts.showCompilationProgressBar(False).setExecutionStrategy(strategy)
    return poptorch.trainingModel(
        model, opts, torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE))


def profiling_rates(bench: Bench, data: tuple[torch.Tensor, torch.Tensor], *,
                    calls: int) -> tuple[float, float]:
    """(images/s with profiling on, off): two pipelined wrappers whose calls alternate, so a
    change in the machine's load hits both alike (separate runs differ by more than 3%)."""
    with tempfile.TemporaryDirectory() as report:
        on = training_model(bench, poptorch.PipelinedExecution(*two_stages(bench)),
                            profile=report)
        off = training_model(bench, poptorch.PipelinedExecution(*two_stages(bench)))
        try:
            seconds: dict[str, list[float]] = {"on": [], "off": []}
            for name, training in (("on", on), ("off", off)):
                training(*data)  # compile and warm up
            for _ in range(calls):
                for name, training in (("on", on), ("off", off)):
                    start = time.perf_counter()
                    training(*data)
                    seconds[name].append(time.perf_counter() - start)
        finally:
            on.destroy()  # writes the report: outside the timed calls
            off.destroy()
    return tuple(bench.images_per_call / statistics.median(seconds[n])  # type: ignore[return-value]
                 for n in ("on", "off"))


def pipetorch_rate(bench: Bench, data: tuple[torch.Tensor, torch.Tensor], strategy: object, *,
                   threads: int, calls: int) -> Measured:
    torch.set_num_threads(threads)
    training = training_model(bench, strategy)
    try:
        training.compile(*data)
        workers = [r["threads"] for r in live_workers() if r.get("host_pid") == os.getpid()]
        rate, seconds = median_rate(lambda: training(*data), bench.images_per_call, calls)
        engine = training._compiled.engine
        return Measured(rate, seconds, list(getattr(engine, "last_trace", [])), workers)
    finally:
        training.destroy()


def two_stages(bench: Bench) -> tuple[poptorch.Stage, poptorch.Stage]:
    return (poptorch.Stage(*BLOCKS[:bench.boundary]).ipu(0),
            poptorch.Stage(*BLOCKS[bench.boundary:]).ipu(1))


def _torch_pipeline_stage(rank: int, store: str, bench: Bench, images: torch.Tensor,
                          labels: torch.Tensor, calls: int, results: mp.SimpleQueue) -> None:
    """One rank of the torch.distributed.pipelining row (runs in a spawned process)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    try:
        blocks = new_network(bench.widths).blocks()
        module = nn.Sequential(*(blocks[:bench.boundary] if rank == 0 else blocks[bench.boundary:]))
        stage = PipelineStage(module, rank, 2, torch.device("cpu"))
        # scale_grads (the default) divides by the micro-batches: the mean over the step
        schedule = Schedule1F1B(stage, n_microbatches=ACCUMULATION, loss_fn=nn.CrossEntropyLoss())
        optimizer = torch.optim.AdamW(module.parameters(), lr=LEARNING_RATE)
        step = ACCUMULATION * MICRO_BATCH

        def call() -> None:
            for d in range(bench.device_iterations):
                optimizer.zero_grad(set_to_none=True)
                if rank == 0:
                    schedule.step(images[d * step:(d + 1) * step])
                else:
                    schedule.step(target=labels[d * step:(d + 1) * step])
                optimizer.step()

        seconds = []
        for _ in range(calls + 1):  # the first call is the warm-up
            dist.barrier()
            start = time.perf_counter()
            call()
            dist.barrier()
            seconds.append(time.perf_counter() - start)
        if rank == 0:
            results.put(seconds[1:])
    finally:
        dist.destroy_process_group()


def torch_pipelining_rate(bench: Bench, data: tuple[torch.Tensor, torch.Tensor], *,
                          calls: int, timeout: float = 900.0) -> float:
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    with tempfile.TemporaryDirectory(prefix="pipeline-bench-") as folder:
        store = os.path.join(folder, "store")
        ranks = [context.Process(target=_torch_pipeline_stage,
                                 args=(rank, store, bench, *data, calls, results))
                 for rank in (0, 1)]
        for process in ranks:
            process.start()
        deadline = time.monotonic() + timeout
        for process in ranks:
            process.join(max(1.0, deadline - time.monotonic()))
        for process in ranks:
            if process.is_alive():
                process.kill()
        codes = [process.exitcode for process in ranks]
        if codes != [0, 0] or results.empty():
            raise RuntimeError(f"torch.distributed.pipelining ranks exited with {codes}")
        return bench.images_per_call / statistics.median(results.get())


# -- report ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    name: str
    numerator: str
    denominator: str
    factor: float      # denominator multiplied by this (2 for the efficiency)
    minimum: float
    aim: float | None = None


def targets(cores: int) -> list[Target]:
    all_cores = f"plain PyTorch, {cores} threads"
    return [
        Target(f"pipelined / {all_cores}", PIPELINED, all_cores, 1.0, 1.0, 1.15),
        Target("pipelined / torch.distributed.pipelining 1F1B", PIPELINED, TORCH_1F1B, 1.0, 1.0),
        Target("profiling on / off (pipelined, alternating calls)", PROFILED, UNPROFILED, 1.0,
               0.97),
        Target("efficiency: pipelined / (2 x plain PyTorch, 1 thread)", PIPELINED,
               "plain PyTorch, 1 thread", 2.0, 0.85),
        Target("pipetorch 1 device / plain PyTorch, 1 thread", "pipetorch, 1 device, 1 thread",
               "plain PyTorch, 1 thread", 1.0, 0.97),
        Target(f"pipetorch 1 device / {all_cores}", f"pipetorch, 1 device, {cores} threads",
               all_cores, 1.0, 0.97),
    ]


def print_table(bench: Bench, rows: dict[str, tuple[float, str | None]], cores: int) -> None:
    width = max(len(name) for name in rows) + 2
    print(f"{'case':<{width}}{'images/s':>10}  ratio")
    for name, (rate, baseline) in rows.items():
        ratio = f"{rate / rows[baseline][0]:.2f}x {baseline}" if baseline in rows else ""
        print(f"{name:<{width}}{rate:>10,.0f}  {ratio}")
    print(f"\ntargets{'' if bench.targeted else ' (set for the heavy variant; shown for reference)'}:")
    for target in targets(cores):
        if target.numerator not in rows or target.denominator not in rows:
            continue
        value = rows[target.numerator][0] / (target.factor * rows[target.denominator][0])
        verdict = "reached" if value >= target.minimum else "NOT reached"
        if target.aim is not None:
            verdict += f" (aim {target.aim:.2f}: {'reached' if value >= target.aim else 'not reached'})"
        print(f"{target.name:<58}{value:>6.3f}  target >= {target.minimum:.2f}  {verdict}")


def print_trace(name: str, measured: Measured) -> None:
    """Where a multi-device host call's time went, per stage, from the workers' spans."""
    spans = [s for t in measured.traces for s in t.spans]
    if not spans:
        return
    window = (max(s.end for s in spans) - min(s.start for s in spans)) / 1e6
    wall = measured.seconds * 1e3
    print(f"  {name}: last call {wall:.0f} ms on the host, {window:.0f} ms from the first to the "
          f"last worker span; host round trip (inputs out, outputs back) {wall - window:.0f} ms")
    print(f"  {'stage':<7}{'forward':>9}{'backward':>10}{'step':>8}{'send':>8}"
          f"{'recv+wait':>11}{'H2D+D2H':>9}{'untraced':>10}   per micro-batch: F / B ms, MB moved")
    for trace in measured.traces:
        total: dict[str, float] = {}
        count: dict[str, int] = {}
        for span in trace.spans:
            kind = span.kind if span.kind in ("F", "B", "STEP", "H2D", "D2H") else span.kind[0]
            total[kind] = total.get(kind, 0.0) + (span.end - span.start) / 1e6
            count[kind] = count.get(kind, 0) + 1
        own = (trace.spans[-1].end - trace.spans[0].start) / 1e6
        untraced = own - sum(total.values())
        moved = sum(s.nbytes for s in trace.spans) / 1e6
        per_f = total.get("F", 0.0) / max(count.get("F", 1), 1)
        per_b = total.get("B", 0.0) / max(count.get("B", 1), 1)
        print(f"  {trace.stage:<7}{total.get('F', 0):>9.0f}{total.get('B', 0):>10.0f}"
              f"{total.get('STEP', 0):>8.0f}{total.get('S', 0):>8.0f}{total.get('R', 0):>11.0f}"
              f"{total.get('H2D', 0) + total.get('D2H', 0):>9.0f}{untraced:>10.0f}   {per_f:.2f} / {per_b:.2f}, {moved:.1f} MB")


def run(bench: Bench, *, calls: int, cores: int) -> None:
    data = make_data(bench)
    first, second = bench.stage_ms
    print(f"\n== {bench.name}: {bench.widths.image_size}x{bench.widths.image_size} images, "
          f"filters {bench.widths.filters}, hidden {bench.widths.hidden}; B{MICRO_BATCH} "
          f"G{ACCUMULATION} D{bench.device_iterations} ({bench.images_per_call} images per "
          f"call), AdamW lr {LEARNING_RATE}, median of {calls} call(s)")
    print("  fwd+bwd per micro-batch, 1 thread (CPU ms): " + ", ".join(
        f"{b} {t:.1f}" for b, t in zip(BLOCKS, bench.block_ms)))
    print(f"  split {bench.split}: {first:.1f} / {second:.1f} ms per stage "
          f"({max(first, second) / min(first, second):.2f}x)")
    if bench.note:
        print(f"  {bench.note}")
    plain1, plain_all = "plain PyTorch, 1 thread", f"plain PyTorch, {cores} threads"
    rows: dict[str, tuple[float, str | None]] = {}
    rows[plain1] = (plain_rate(bench, data, threads=1, calls=calls), None)
    rows[plain_all] = (plain_rate(bench, data, threads=cores, calls=calls), plain1)
    one_device = poptorch.ShardedExecution(poptorch.Stage(*BLOCKS).ipu(0))
    for threads, baseline in ((1, plain1), (cores, plain_all)):
        measured = pipetorch_rate(bench, data, one_device, threads=threads, calls=calls)
        rows[f"pipetorch, 1 device, {threads} thread{'s' if threads > 1 else ''}"] = (
            measured.rate, baseline)
    traced = {}
    for name, strategy in ((SHARDED, poptorch.ShardedExecution),
                           (PIPELINED, poptorch.PipelinedExecution)):
        traced[name] = pipetorch_rate(bench, data, strategy(*two_stages(bench)), threads=cores,
                                      calls=calls)
        rows[name] = (traced[name].rate, plain1 if name == SHARDED else plain_all)
    profiled, unprofiled = profiling_rates(bench, data, calls=calls)
    rows[UNPROFILED] = (unprofiled, plain_all)
    rows[PROFILED] = (profiled, UNPROFILED)
    rows[TORCH_1F1B] = (torch_pipelining_rate(bench, data, calls=calls), plain_all)
    threads = traced[PIPELINED].worker_threads
    print(f"  threads: plain and 1-device rows as named; 2-device workers {threads}; "
          "torch.distributed.pipelining ranks [1, 1]\n")
    print_table(bench, rows, cores)
    print()
    print("where the last call's time went, ms per stage (recv+wait includes waiting for the "
          "peer; untraced: gaps between spans):")
    for name, measured in traced.items():
        print_trace(name, measured)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="1 timed call, D of 1, fewer block timings (a smoke test)")
    parser.add_argument("--models", default="seed,heavy",
                        help="comma-separated: seed, heavy (default: both)")
    parser.add_argument("--calls", type=int, default=None,
                        help="timed host calls per row after the warm-up (default: 5, quick: 1)")
    parser.add_argument("--heavy-filters", type=int, default=None,
                        help="layer1 filters of the heavy variant (default: the seed's 10, "
                             "widened automatically when its stages are unbalanced)")
    args = parser.parse_args()
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(models) - {"seed", "heavy"})
    if unknown or not models:
        parser.error(f"--models takes seed and/or heavy, got {args.models!r}")
    calls = args.calls or (1 if args.quick else 5)
    reps = 2 if args.quick else 7
    cores = cpu_cores()
    benches = {
        "seed": Bench("seed 000", Widths(28), 1 if args.quick else 10),
        "heavy": Bench("heavy (seed 000 at 128x128)",
                       Widths(128, filters=(args.heavy_filters or 10, 20)),
                       1 if args.quick else 2, targeted=True),
    }
    print(f"{cores} cores; plain PyTorch rows use 1 and {cores} intra-op threads, 2-device rows "
          f"one worker per stage; torch {torch.__version__}")
    print("choosing stage splits (fwd+bwd of each block on one micro-batch, 1 thread):")
    for model in models:
        bench = balance(benches[model], reps=reps, log=print,
                        widen=model == "heavy" and args.heavy_filters is None)
        run(bench, calls=calls, cores=cores)


if __name__ == "__main__":
    main()
