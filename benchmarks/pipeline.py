"""Seed 000's pipeline and a BERT: samples/s of plain PyTorch, pipetorch, torch's schedules.

The CNN rows train with micro-batches of 40, gradient accumulation G=10 (one optimiser step per
400 images), D device iterations per host call and AdamW(lr=0.001), on synthetic images made
once and shared by every row:

    seed   seed 000's CNN (blocks B1..B4) on 28x28 images, D=10
    heavy  the same CNN on 128x128 images (its linear layer grows to match), D=2; its first
           layer is widened when the seed's widths give no split within 10% of balance
    bert   transformers' BertForSequenceClassification (4 layers, hidden 256, sequence 128,
           random weights, no download), BeginBlock(ipu_id=1) on encoder layer 2; B4 G8 D1
           (--quick: B1 G8, sequence 64; G >= 7 for four pipelined stages)

Rows: plain PyTorch (the same accumulation loop) with 1 thread and with all cores; for the CNNs
pipetorch with every block on ipu 0 (the in-process engine) with the same thread counts and
sharded over 2 devices; pipetorch pipelined over 2 devices (one worker per stage, cores // 2
threads each) over shared memory and over gloo (PIPETORCH_TRANSPORT), for the CNNs once more
with profiling on, and once with Training.pipelineSchedule("zero_bubble") (ZB-H1: each backward
split into the input's gradient, sent at once, and the weights', deferred); pipetorch with four
stages on ipus 0,1,0,1 (each CNN block, each quarter of BERT's encoder) and
pipelineSchedule("interleaved"); torch.distributed.pipelining's Schedule1F1B and
ScheduleInterleavedZeroBubble on the same split (2 processes, gloo, 1 thread each), for the
CNNs also its ScheduleInterleaved1F1B over the four blocks as four stages (1 and 3 on rank 0)
and its ScheduleZBVZeroBubble over them in a V (blocks 1 and 4 on rank 0, 2 and 3 on rank 1); with --compiled, pipelined once more with every stage run through torch.compile (inductor).
The targets compare the best pipetorch schedule with the best torch one, each named above them.

Every row is built first and kept (workers stay up), then timed in interleaved rounds: one
warm-up call per row, then each round one host call of every row in turn (ABAB...), so a change
in the machine's load hits all rows alike. The table shows each row's median and its slowest and
fastest call; ratios are of medians. The CNN stage split is chosen by timing each block's
forward+backward on one micro-batch with 1 thread (process CPU time) and cutting where the two
stages' times are closest.

    python benchmarks/pipeline.py                      # full run (~15 min on 2 quiet cores)
    python benchmarks/pipeline.py --quick --models seed
    python benchmarks/pipeline.py --models seed --compiled   # adds compiled stages' row
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

import pipetorch as poptorch
from pipetorch.parallel.layout.placement import cpu_cores, live_workers

BLOCKS = ("B1", "B2", "B3", "B4")
MICRO_BATCH = 40
ACCUMULATION = 10
LEARNING_RATE = 0.001
BALANCED = 1.10  # slower stage / faster stage at or below this counts as balanced
PIPELINED = "pipetorch, pipelined over 2 devices"
PIPELINED_GLOO = "pipetorch, pipelined over 2 devices, gloo transport"
PROFILED = "pipetorch, pipelined over 2 devices, profiling on"
COMPILED = "pipetorch, pipelined over 2 devices, compiled stages"
SHARDED = "pipetorch, sharded over 2 devices"
ZERO_BUBBLE = "pipetorch, pipelined over 2 devices, zero-bubble"
INTERLEAVED = "pipetorch, interleaved, 4 stages on 2 devices"
TORCH_1F1B = "torch.distributed.pipelining Schedule1F1B"
TORCH_ZB = "torch.distributed.pipelining ScheduleInterleavedZeroBubble"
TORCH_ZBV = "torch.distributed.pipelining ScheduleZBVZeroBubble, 4 stages"
TORCH_INTERLEAVED = "torch.distributed.pipelining ScheduleInterleaved1F1B, 4 stages"
TORCH_SCHEDULES = {TORCH_1F1B: "Schedule1F1B", TORCH_ZB: "ScheduleInterleavedZeroBubble",
                   TORCH_ZBV: "ScheduleZBVZeroBubble",
                   TORCH_INTERLEAVED: "ScheduleInterleaved1F1B"}
# stages of each rank when a torch schedule runs four: a V, or round-robin (interleaved)
FOUR_STAGES = {"ScheduleZBVZeroBubble": lambda rank: (rank, 3 - rank),
               "ScheduleInterleaved1F1B": lambda rank: (rank, rank + 2)}
BEST, BEST_TORCH = "best pipetorch schedule", "best torch schedule"
PIPETORCH_SCHEDULES = (PIPELINED, ZERO_BUBBLE, INTERLEAVED)


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


def two_stages(bench: Bench) -> tuple[poptorch.Stage, poptorch.Stage]:
    return (poptorch.Stage(*BLOCKS[:bench.boundary]).ipu(0),
            poptorch.Stage(*BLOCKS[bench.boundary:]).ipu(1))


# -- workloads: what a row trains -------------------------------------------------------------
@dataclass(frozen=True)
class CnnWork:
    """Seed 000's CNN at `bench`'s widths, split between its blocks at `bench.boundary`."""

    bench: Bench
    micro_batch: int = MICRO_BATCH
    accumulation: int = ACCUMULATION

    @property
    def name(self) -> str:
        return self.bench.name

    @property
    def device_iterations(self) -> int:
        return self.bench.device_iterations

    @property
    def samples_per_call(self) -> int:
        return self.device_iterations * self.accumulation * self.micro_batch

    def data(self) -> tuple[torch.Tensor, torch.Tensor]:
        return make_data(self.bench)

    def model(self) -> nn.Module:
        return WithLoss(new_network(self.bench.widths))

    def strategy(self, model: nn.Module, devices: str) -> object:
        """The execution strategy for "one" device, or 2 devices "sharded" / "pipelined", or
        each block a stage on ipus 0,1,0,1 ("interleaved")."""
        if devices == "one":
            return poptorch.ShardedExecution(poptorch.Stage(*BLOCKS).ipu(0))
        if devices == "interleaved":
            return poptorch.PipelinedExecution(
                *(poptorch.Stage(b).ipu(i % 2) for i, b in enumerate(BLOCKS)))
        kind = poptorch.PipelinedExecution if devices == "pipelined" else poptorch.ShardedExecution
        return kind(*two_stages(self.bench))

    def torch_stage(self, rank: int, example: torch.Tensor) -> nn.Module:
        blocks = new_network(self.bench.widths).blocks()
        boundary = self.bench.boundary
        return nn.Sequential(*(blocks[:boundary] if rank == 0 else blocks[boundary:]))

    def torch_stages(self, indices: tuple[int, ...], example: torch.Tensor
                     ) -> list[tuple[int, nn.Module]]:
        """Each block a stage: those at `indices`."""
        blocks = new_network(self.bench.widths).blocks()
        return [(i, blocks[i]) for i in indices]


@dataclass(frozen=True)
class BertWork:
    """transformers' BertForSequenceClassification from a random config (no download), split
    with BeginBlock at encoder layer `layers // 2`, as seed 003 splits BERT."""

    layers: int = 4
    hidden: int = 256
    sequence: int = 128
    vocab: int = 8192
    micro_batch: int = 4
    accumulation: int = 8
    device_iterations: int = 1
    name: str = "BERT"

    @property
    def samples_per_call(self) -> int:
        return self.device_iterations * self.accumulation * self.micro_batch

    def data(self) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, self.vocab, (self.samples_per_call, self.sequence),
                            generator=generator)
        return ids, torch.randint(0, 2, (self.samples_per_call,), generator=generator)

    def classifier(self) -> nn.Module:
        import transformers

        config = transformers.BertConfig(
            vocab_size=self.vocab, hidden_size=self.hidden, num_hidden_layers=self.layers,
            num_attention_heads=self.hidden // 64, intermediate_size=4 * self.hidden,
            max_position_embeddings=self.sequence, num_labels=2)
        torch.manual_seed(0)  # every row starts from the same weights
        return transformers.BertForSequenceClassification(config)

    def model(self) -> nn.Module:
        return BertWithLoss(self.classifier())

    def strategy(self, model: nn.Module, devices: str) -> object:
        layers = model.classifier.bert.encoder.layer
        for cut, ipu in self._cuts(devices == "interleaved"):
            layers[cut] = poptorch.BeginBlock(layers[cut], ipu_id=ipu)
        kind = poptorch.ShardedExecution if devices == "sharded" else poptorch.PipelinedExecution
        return kind(poptorch.AutoStage.SameAsIpu)

    def _cuts(self, four: bool) -> list[tuple[int, int]]:
        """(encoder layer, ipu) where a stage starts: the middle, or (four) each quarter on
        ipus 1, 0, 1 (ipus 0,1,0,1 in all)."""
        if not four:
            return [(self.layers // 2, 1)]
        return [(q * self.layers // 4, q % 2) for q in (1, 2, 3)]

    def torch_stage(self, rank: int, example: torch.Tensor) -> nn.Module:
        return self.torch_stages((rank,), example, four=False)[0][1]

    def torch_stages(self, indices: tuple[int, ...], example: torch.Tensor, *,
                     four: bool = True) -> list[tuple[int, nn.Module]]:
        from torch.distributed.pipelining import SplitPoint, pipeline

        pipe = pipeline(BertLogits(self.classifier()), mb_args=(example,),
                        split_spec={f"classifier.bert.encoder.layer.{cut}": SplitPoint.BEGINNING
                                    for cut, _ in self._cuts(four)})
        return [(i, Contiguous(pipe.get_stage_module(i))) for i in indices]


class Contiguous(nn.Module):
    """A stage whose outputs are contiguous: gloo refuses the expanded attention mask that
    BERT's first stage hands on."""

    def __init__(self, stage: nn.Module) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, *args: torch.Tensor) -> Any:
        out = self.stage(*args)
        if isinstance(out, tuple):
            return tuple(t.contiguous() if isinstance(t, torch.Tensor) else t for t in out)
        return out.contiguous() if isinstance(out, torch.Tensor) else out


class BertWithLoss(nn.Module):
    """(logits, loss) of a sequence classifier, as a PopTorch training model returns them."""

    def __init__(self, classifier: nn.Module) -> None:
        super().__init__()
        self.classifier = classifier

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        output = self.classifier(input_ids=ids, labels=labels)
        return output.logits, output.loss


class BertLogits(nn.Module):
    """The classifier's logits alone: what torch.distributed.pipelining's stages pass on."""

    def __init__(self, classifier: nn.Module) -> None:
        super().__init__()
        self.classifier = classifier

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.classifier(input_ids=ids).logits


Work = CnnWork | BertWork


# -- rows: each times one host call at a time, so the rows' calls can interleave -------------
class Row:
    """One row of the table: `call()` runs one host call and returns its seconds."""

    name: str
    baseline: str | None = None
    traces: list = []

    def call(self) -> float:
        raise NotImplementedError

    def close(self) -> None:
        pass


class PlainRow(Row):
    """The accumulation loop pipetorch runs, in plain PyTorch."""

    def __init__(self, work: Work, data: tuple, *, threads: int, baseline: str | None) -> None:
        self.name = f"plain PyTorch, {threads} thread{'s' if threads > 1 else ''}"
        self.baseline, self.work, self.data, self.threads = baseline, work, data, threads
        self.model = work.model()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LEARNING_RATE)

    def call(self) -> float:
        torch.set_num_threads(self.threads)
        inputs, labels = self.data
        work, step = self.work, self.work.accumulation * self.work.micro_batch
        start = time.perf_counter()
        for d in range(work.device_iterations):
            self.optimizer.zero_grad(set_to_none=True)
            for g in range(d * step, (d + 1) * step, work.micro_batch):
                _, loss = self.model(inputs[g:g + work.micro_batch], labels[g:g + work.micro_batch])
                (loss / work.accumulation).backward()
            self.optimizer.step()
        return time.perf_counter() - start


class PipetorchRow(Row):
    """A trainingModel on one device (in process) or two (worker processes over `transport`)."""

    def __init__(self, work: Work, data: tuple, name: str, *, devices: str, threads: int,
                 baseline: str | None, transport: str = "shm", profile: str | None = None,
                 compiled: bool = False, schedule: str | None = None) -> None:
        self.name, self.baseline, self.data, self.threads = name, baseline, data, threads
        model = work.model()
        opts = poptorch.Options().deviceIterations(work.device_iterations)
        if profile is not None:
            opts.enableProfiling(profile)
        if compiled:  # torch.compile (inductor) in each worker, at the warm-up call
            opts.Jit.compileStages(True)
        opts.Training.gradientAccumulation(work.accumulation)
        if schedule is not None:
            opts.Training.pipelineSchedule(schedule)
        opts.showCompilationProgressBar(False).setExecutionStrategy(work.strategy(model, devices))
        self.training = poptorch.trainingModel(
            model, opts, torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE))
        before = os.environ.get("PIPETORCH_TRANSPORT")
        os.environ["PIPETORCH_TRANSPORT"] = transport  # the workers read it when they start
        try:
            torch.set_num_threads(threads)
            self.training.compile(*data)
        finally:
            os.environ.pop("PIPETORCH_TRANSPORT") if before is None else os.environ.update(
                {"PIPETORCH_TRANSPORT": before})
        self.worker_threads = [r["threads"] for r in live_workers()
                               if r.get("host_pid") == os.getpid()]

    def call(self) -> float:
        torch.set_num_threads(self.threads)
        start = time.perf_counter()
        self.training(*self.data)
        seconds = time.perf_counter() - start
        self.traces = list(getattr(self.training._compiled.engine, "last_trace", []))
        return seconds

    def close(self) -> None:
        self.training.destroy()  # writes a profile: outside the timed calls


def _torch_pipeline_rank(rank: int, store: str, work: Work, data: tuple, conn: Any,
                         name: str) -> None:
    """One rank of a torch.distributed.pipelining row (a spawned process) running the schedule
    class `name`: runs a host call each time the benchmark asks, and rank 0 answers with its
    seconds."""
    from torch.distributed import pipelining

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    try:
        inputs, labels = data
        if name in FOUR_STAGES:
            held, count = work.torch_stages(FOUR_STAGES[name](rank), inputs[:work.micro_batch]), 4
        else:
            held, count = [(rank, work.torch_stage(rank, inputs[:work.micro_batch]))], 2
        stages = [pipelining.PipelineStage(m, i, count, torch.device("cpu")) for i, m in held]
        # scale_grads (the default) divides by the micro-batches: the mean over the step
        kind = getattr(pipelining, name)
        schedule = kind(stages[0] if name == "Schedule1F1B" else stages,
                        n_microbatches=work.accumulation, loss_fn=nn.CrossEntropyLoss())
        modules = nn.ModuleList(m for _, m in held)
        optimizer = torch.optim.AdamW(modules.parameters(), lr=LEARNING_RATE)
        step = work.accumulation * work.micro_batch
        first, last = any(i == 0 for i, _ in held), any(i == count - 1 for i, _ in held)
        while conn.recv():
            dist.barrier()
            start = time.perf_counter()
            for d in range(work.device_iterations):
                optimizer.zero_grad(set_to_none=True)
                part = slice(d * step, (d + 1) * step)
                schedule.step(*((inputs[part],) if first else ()),
                              **({"target": labels[part]} if last else {}))
                optimizer.step()
            dist.barrier()
            conn.send(time.perf_counter() - start)
    finally:
        dist.destroy_process_group()


class TorchPipeliningRow(Row):
    """A torch.distributed.pipelining schedule (`name`, one of TORCH_SCHEDULES) on the same
    split: 2 ranks, gloo, 1 thread each, kept running between calls."""

    def __init__(self, work: Work, data: tuple, *, baseline: str, name: str = TORCH_1F1B,
                 timeout: float = 900.0) -> None:
        self.name, self.baseline, self.timeout = name, baseline, timeout
        context = mp.get_context("spawn")
        self.folder = tempfile.TemporaryDirectory(prefix="pipeline-bench-")
        store = os.path.join(self.folder.name, "store")
        self.conns, self.ranks = [], []
        for rank in (0, 1):
            ours, theirs = context.Pipe()
            process = context.Process(target=_torch_pipeline_rank,
                                      args=(rank, store, work, data, theirs,
                                            TORCH_SCHEDULES[name]), daemon=True)
            process.start()
            self.conns.append(ours)
            self.ranks.append(process)

    def call(self) -> float:
        for conn in self.conns:
            conn.send(True)
        seconds = []
        for conn, process in zip(self.conns, self.ranks):
            if not conn.poll(self.timeout):
                raise RuntimeError(f"torch.distributed.pipelining rank exited with "
                                   f"{process.exitcode} or took over {self.timeout:.0f}s")
            seconds.append(conn.recv())
        return seconds[0]

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(False)
            except OSError:
                pass
        for process in self.ranks:
            process.join(30)
            if process.is_alive():
                process.kill()
                process.join(5)
        self.folder.cleanup()


@dataclass
class Timing:
    """A row's interleaved calls: seconds per call, and samples per call."""

    seconds: list[float]
    samples: int

    @property
    def rate(self) -> float:
        return self.samples / statistics.median(self.seconds)

    @property
    def spread(self) -> tuple[float, float]:
        """(slowest, fastest) rate over the calls."""
        return self.samples / max(self.seconds), self.samples / min(self.seconds)


def interleave(rows: list[Row], *, rounds: int, samples: int,
               log: Callable[[str], None]) -> dict[str, Timing]:
    """One warm-up call per row, then `rounds` rounds of one call per row (ABAB...), so a change
    in the machine's load hits every row alike."""
    timings = {row.name: Timing([], samples) for row in rows}
    for row in rows:
        row.call()
    for round_ in range(rounds):
        for row in rows:
            timings[row.name].seconds.append(row.call())
        log(f"  round {round_ + 1}/{rounds} done")
    return timings


# -- report ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    name: str
    numerator: str
    denominator: str
    factor: float      # denominator multiplied by this (2 for the efficiency)
    minimum: float


def targets(cores: int) -> list[Target]:
    all_cores = f"plain PyTorch, {cores} threads"
    return [
        Target(f"pipelined / {all_cores}", PIPELINED, all_cores, 1.0, 1.0),
        Target("pipelined / torch.distributed.pipelining 1F1B", PIPELINED, TORCH_1F1B, 1.0, 1.10),
        Target("pipelined over shm / over gloo", PIPELINED, PIPELINED_GLOO, 1.0, 1.0),
        Target("zero-bubble / 1F1B (pipetorch)", ZERO_BUBBLE, PIPELINED, 1.0, 1.0),
        Target("zero-bubble / torch ScheduleInterleavedZeroBubble", ZERO_BUBBLE, TORCH_ZB, 1.0,
               1.10),
        Target("zero-bubble / torch ScheduleZBVZeroBubble", ZERO_BUBBLE, TORCH_ZBV, 1.0, 1.10),
        Target("interleaved / torch ScheduleInterleaved1F1B", INTERLEAVED, TORCH_INTERLEAVED,
               1.0, 1.10),
        Target(f"{BEST} / {BEST_TORCH}", BEST, BEST_TORCH, 1.0, 1.10),
        Target("profiling on / off (pipelined, interleaved calls)", PROFILED, PIPELINED, 1.0,
               0.97),
        Target(f"efficiency: {BEST} / (2 x plain PyTorch, 1 thread)", BEST,
               "plain PyTorch, 1 thread", 2.0, 0.88),
        Target("pipetorch 1 device / plain PyTorch, 1 thread", "pipetorch, 1 device, 1 thread",
               "plain PyTorch, 1 thread", 1.0, 0.97),
        Target(f"pipetorch 1 device / {all_cores}", f"pipetorch, 1 device, {cores} threads",
               all_cores, 1.0, 0.97),
    ]


def print_rows(rows: list[Row], timings: dict[str, Timing], unit: str) -> None:
    """Each row's median rate, its slowest..fastest call and its ratio to its baseline."""
    width = max(len(row.name) for row in rows) + 2
    print(f"{'case':<{width}}{unit:>10}  {'slowest..fastest':>17}  ratio of medians")
    for row in rows:
        timing = timings[row.name]
        low, high = timing.spread
        ratio = (f"{timing.rate / timings[row.baseline].rate:.2f}x {row.baseline}"
                 if row.baseline in timings else "")
        print(f"{row.name:<{width}}{timing.rate:>10,.1f}  {low:>8,.1f}..{high:<8,.1f} {ratio}")


def print_table(work: Work, rows: list[Row], timings: dict[str, Timing], cores: int) -> None:
    print_rows(rows, timings, "samples/s" if isinstance(work, BertWork) else "images/s")
    timings = dict(timings)
    for best, names in ((BEST, PIPETORCH_SCHEDULES), (BEST_TORCH, TORCH_SCHEDULES)):
        name = max((n for n in names if n in timings), key=lambda n: timings[n].rate)
        timings[best] = timings[name]
        print(f"{best}: {name}")
    print("\ntargets:")
    for target in targets(cores):
        if target.numerator not in timings or target.denominator not in timings:
            continue
        value = timings[target.numerator].rate / (target.factor * timings[target.denominator].rate)
        verdict = "reached" if value >= target.minimum else "NOT reached"
        print(f"{target.name:<58}{value:>6.3f}  target >= {target.minimum:.2f}  {verdict}")


def print_trace(row: Row, seconds: float) -> None:
    """Where a multi-device host call's time went, per stage, from the workers' spans."""
    spans = [s for t in row.traces for s in t.spans]
    if not spans:
        return
    window = (max(s.end for s in spans) - min(s.start for s in spans)) / 1e6
    wall = seconds * 1e3
    print(f"  {row.name}: last call {wall:.0f} ms on the host, {window:.0f} ms from the first to "
          f"the last worker span; host round trip (inputs out, outputs back) {wall - window:.0f} ms")
    print(f"  {'stage':<7}{'forward':>9}{'backward':>10}{'weights':>9}{'step':>8}{'send':>8}"
          f"{'recv+wait':>11}{'H2D+D2H':>9}{'untraced':>10}   per micro-batch: F / B ms, MB moved")
    for trace in row.traces:
        total: dict[str, float] = {}
        count: dict[str, int] = {}
        for span in trace.spans:
            kind = span.kind if span.kind in ("F", "B", "W", "STEP", "H2D", "D2H") \
                else span.kind[0]
            total[kind] = total.get(kind, 0.0) + (span.end - span.start) / 1e6
            count[kind] = count.get(kind, 0) + 1
        own = (trace.spans[-1].end - trace.spans[0].start) / 1e6
        untraced = own - sum(total.values())
        moved = sum(s.nbytes for s in trace.spans) / 1e6
        per_f = total.get("F", 0.0) / max(count.get("F", 1), 1)
        per_b = total.get("B", 0.0) / max(count.get("B", 1), 1)
        print(f"  {trace.stage:<7}{total.get('F', 0):>9.0f}{total.get('B', 0):>10.0f}"
              f"{total.get('W', 0):>9.0f}{total.get('STEP', 0):>8.0f}{total.get('S', 0):>8.0f}{total.get('R', 0):>11.0f}"
              f"{total.get('H2D', 0) + total.get('D2H', 0):>9.0f}{untraced:>10.0f}   "
              f"{per_f:.2f} / {per_b:.2f}, {moved:.1f} MB")


def build_rows(work: Work, data: tuple, *, cores: int, profile: str, full: bool,
               compiled: bool) -> list[Row]:
    """Every row of `work`'s table; `full` adds the 1-device, sharded and profiling rows,
    `compiled` the pipelined row with compiled stages."""
    plain1, plain_all = "plain PyTorch, 1 thread", f"plain PyTorch, {cores} threads"
    rows: list[Row] = [PlainRow(work, data, threads=1, baseline=None),
                       PlainRow(work, data, threads=cores, baseline=plain1)]
    if full:
        for threads, baseline in ((1, plain1), (cores, plain_all)):
            rows.append(PipetorchRow(
                work, data, f"pipetorch, 1 device, {threads} thread{'s' if threads > 1 else ''}",
                devices="one", threads=threads, baseline=baseline))
        rows.append(PipetorchRow(work, data, SHARDED, devices="sharded", threads=cores,
                                 baseline=plain1))
    rows.append(PipetorchRow(work, data, PIPELINED, devices="pipelined", threads=cores,
                             baseline=plain_all))
    rows.append(PipetorchRow(work, data, PIPELINED_GLOO, devices="pipelined", threads=cores,
                             baseline=PIPELINED, transport="gloo"))
    rows.append(PipetorchRow(work, data, ZERO_BUBBLE, devices="pipelined", threads=cores,
                             baseline=PIPELINED, schedule="zero_bubble"))
    rows.append(PipetorchRow(work, data, INTERLEAVED, devices="interleaved", threads=cores,
                             baseline=PIPELINED, schedule="interleaved"))
    if compiled:
        rows.append(PipetorchRow(work, data, COMPILED, devices="pipelined", threads=cores,
                                 baseline=PIPELINED, compiled=True))
    if full:
        rows.append(PipetorchRow(work, data, PROFILED, devices="pipelined", threads=cores,
                                 baseline=PIPELINED, profile=profile))
    rows.append(TorchPipeliningRow(work, data, baseline=plain_all))
    rows.append(TorchPipeliningRow(work, data, baseline=TORCH_1F1B, name=TORCH_ZB))
    # four blocks: four stages, two per rank in a V or round-robin (BERT's later stages read
    # the attention mask from stage 0, which torch's stages pass only to their neighbour)
    if isinstance(work, CnnWork):
        rows.append(TorchPipeliningRow(work, data, baseline=TORCH_1F1B, name=TORCH_ZBV))
        rows.append(TorchPipeliningRow(work, data, baseline=TORCH_1F1B, name=TORCH_INTERLEAVED))
    return rows


def run(work: Work, *, rounds: int, cores: int, full: bool, compiled: bool) -> None:
    data = work.data()
    if isinstance(work, CnnWork):
        bench = work.bench
        first, second = bench.stage_ms
        print(f"\n== {bench.name}: {bench.widths.image_size}x{bench.widths.image_size} images, "
              f"filters {bench.widths.filters}, hidden {bench.widths.hidden}")
        print("  fwd+bwd per micro-batch, 1 thread (CPU ms): " + ", ".join(
            f"{b} {t:.1f}" for b, t in zip(BLOCKS, bench.block_ms)))
        print(f"  split {bench.split}: {first:.1f} / {second:.1f} ms per stage "
              f"({max(first, second) / min(first, second):.2f}x)")
        if bench.note:
            print(f"  {bench.note}")
    else:
        print(f"\n== {work.name}: BertForSequenceClassification, {work.layers} layers, hidden "
              f"{work.hidden}, sequence {work.sequence}, vocabulary {work.vocab} (random "
              f"weights); BeginBlock(ipu_id=1) on encoder layer {work.layers // 2}")
    print(f"  B{work.micro_batch} G{work.accumulation} D{work.device_iterations} "
          f"({work.samples_per_call} samples per call), AdamW lr {LEARNING_RATE}; every row's "
          f"calls interleaved, median of {rounds} round(s)")
    with tempfile.TemporaryDirectory() as profile:
        rows = build_rows(work, data, cores=cores, profile=profile, full=full,
                          compiled=compiled)
        try:
            timings = interleave(rows, rounds=rounds, samples=work.samples_per_call,
                                 log=lambda line: None)
        finally:
            for row in rows:
                row.close()
    workers = [row.worker_threads for row in rows
               if isinstance(row, PipetorchRow) and row.name == PIPELINED]
    print(f"  threads: plain and 1-device rows as named; 2-device workers {workers[0]}; "
          "torch.distributed.pipelining ranks [1, 1]\n")
    print_table(work, rows, timings, cores)
    print()
    print("where the last call's time went, ms per stage (recv+wait includes waiting for the "
          "peer; untraced: gaps between spans):")
    for row in rows:
        if isinstance(row, PipetorchRow) and row.name in (SHARDED, PIPELINED, PIPELINED_GLOO,
                                                           ZERO_BUBBLE, INTERLEAVED,
                                                           COMPILED):
            print_trace(row, timings[row.name].seconds[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="2 rounds, D of 1, small BERT batches, fewer block timings (a "
                             "smoke test)")
    parser.add_argument("--models", default="seed,heavy,bert",
                        help="comma-separated: seed, heavy, bert (default: all three)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="interleaved rounds of one call per row after the warm-up "
                             "(default: 5, quick: 2)")
    parser.add_argument("--compiled", action="store_true",
                        help="add a pipelined row whose stages run through torch.compile "
                             "(opts.Jit.compileStages; inductor compiles at the warm-up call, "
                             "about a minute per model on 2 cores)")
    parser.add_argument("--heavy-filters", type=int, default=None,
                        help="layer1 filters of the heavy variant (default: the seed's 10, "
                             "widened automatically when its stages are unbalanced)")
    args = parser.parse_args()
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(models) - {"seed", "heavy", "bert"})
    if unknown or not models:
        parser.error(f"--models takes seed, heavy and/or bert, got {args.models!r}")
    rounds = args.rounds or (2 if args.quick else 5)
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
    for model in models:
        if model == "bert":
            work: Work = (BertWork(micro_batch=1, accumulation=8, sequence=64) if args.quick
                          else BertWork())
        else:
            print(f"choosing the {model} model's stage split (fwd+bwd of each block on one "
                  "micro-batch, 1 thread):")
            work = CnnWork(balance(benches[model], reps=reps, log=print,
                                   widen=model == "heavy" and args.heavy_filters is None))
        run(work, rounds=rounds, cores=cores, full=model != "bert", compiled=args.compiled)


if __name__ == "__main__":
    main()
