"""One pipeline over two processes on 127.0.0.1, at default threads: pipetorch against torch's
Schedule1F1B and against pipetorch in one process, through both torchrun recipes.

Models (flags): an MLP of LAYERS Linear(W, W) + tanh layers and a classifier, split in the
middle, at each width of --widths (B16 G8 D1, SGD with momentum); and a tiny GPT-2 (--gpt2, on
by default: transformers' GPT2LMHeadModel from a GPT2Config of 4 layers, n_embd 64, vocabulary
512, 4 heads, dropout 0 so every row gives the same losses; sequence 32, B4 G4 D2, AdamW),
split by poptorch.BeginBlock(transformer.h[2], ipu_id=1).

Launches: each starts fresh processes, builds each model in turn and times it.
    one      this script in one process, no torchrun: pipetorch with 2 stages on 2 workers
    nproc    torchrun --nproc-per-node 2 (which sets OMP_NUM_THREADS=1 in each process)
    nnodes   two torchruns, --nnodes 2 --node-rank 0 / 1, --nproc-per-node 1 each,
             --master-addr 127.0.0.1
In nproc and nnodes each process holds one stage: pipetorch with
opts.Distributed.stagesAcrossProcesses(True) (each process runs its stage's worker) and, for the
MLP, torch.distributed.pipelining's Schedule1F1B over the same processes (gloo; one intra-op
thread per process, as torchrun gives with --nproc-per-node 2, set for torch's calls only).
pipetorch gets no thread setting: what a user gets by default is measured.

Timing (pipeline.py's interleave and Timing): a row is one launch. The launcher runs --rows
rounds of the launches in turn (one, nproc, nnodes, one, nproc, ...: ABAB across launches), so
a change in the machine's load hits every configuration alike. Inside a launch, after one
warm-up call per row, --calls calls per row alternate (pipetorch, torch, pipetorch, ...) and
the launch keeps each row's median call, which pays no start-up. samples/s is the samples of
a call over the median of those launch medians; slowest..fastest are the launches'. Every
launch trains the same initial weights on the same batches, so all rows give the same losses:
the largest difference of a call's mean loss is printed (pipetorch vs torch, 2 processes vs 1).

    python benchmarks/cross_process.py                  # all rows, 5 each: ~5 min on 2 cores
    python benchmarks/cross_process.py --widths 512 --no-gpt2 --rows 3
    python benchmarks/cross_process.py --quick          # width 32 + GPT-2, 1 row each: ~40 s
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline import Row, Timing, interleave  # noqa: E402

import pipetorch as poptorch  # noqa: E402
from pipetorch.parallel.layout.placement import cpu_cores, live_workers  # noqa: E402

LAYERS, CLASSES, LEARNING_RATE = 4, 10, 0.01
SEQUENCE, VOCABULARY = 32, 512
LAUNCHES = ("one", "nproc", "nnodes")
RECIPES = {"nproc": "--nproc-per-node 2", "nnodes": "--nnodes 2"}
PIPETORCH, TORCH = "pipetorch", "torch Schedule1F1B"
RESULT = "RESULT "  # a launch's line of results for the launcher


# -- the models ------------------------------------------------------------------------------
def layers(width: int) -> list[nn.Module]:
    torch.manual_seed(0)
    found: list[nn.Module] = []
    for _ in range(LAYERS):
        found += [nn.Linear(width, width), nn.Tanh()]
    return found + [nn.Linear(width, CLASSES)]


class Net(nn.Module):
    """The MLP for pipetorch: its second half on ipu 1 (the second process, or worker)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        found = layers(width)
        half = len(found) // 2
        self.first = nn.Sequential(*found[:half])
        self.second = poptorch.BeginBlock(nn.Sequential(*found[half:]), ipu_id=1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.second(self.first(x))
        return out, nn.functional.cross_entropy(out, labels)


@dataclass(frozen=True)
class Work:
    """A model of the benchmark: B micro-batches of G per optimiser step, D steps a call."""

    batch: int
    accumulation: int
    iterations: int = 1

    @property
    def samples(self) -> int:
        return self.batch * self.accumulation * self.iterations

    @property
    def sizes(self) -> str:
        return f"B{self.batch} G{self.accumulation} D{self.iterations}"

    def torch_stage(self, rank: int) -> nn.Module | None:
        """Its half on torch's rank `rank`; None: no torch row."""
        return None


@dataclass(frozen=True)
class Mlp(Work):
    """The MLP at one width, SGD with momentum."""

    width: int = 512

    @property
    def name(self) -> str:
        return (f"MLP width {self.width} ({LAYERS} Linear + tanh, classifier; {self.sizes}, "
                "SGD momentum)")

    def model(self) -> nn.Module:
        return Net(self.width)

    def optimizer(self, params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=LEARNING_RATE, momentum=0.9)

    def batches(self, count: int) -> list[dict[str, torch.Tensor]]:
        g = torch.Generator().manual_seed(1)
        return [{"x": torch.randn(self.samples, self.width, generator=g),
                 "labels": torch.randint(0, CLASSES, (self.samples,), generator=g)}
                for _ in range(count)]

    def loss(self, output: Any) -> float:
        return float(output[1].mean())

    def torch_stage(self, rank: int) -> nn.Module | None:
        found = layers(self.width)
        half = len(found) // 2
        return nn.Sequential(*(found[:half] if rank == 0 else found[half:]))


@dataclass(frozen=True)
class Gpt2(Work):
    """The tiny GPT-2, AdamW (no torch row: pipetorch in 1 process against 2)."""

    @property
    def name(self) -> str:
        return (f"tiny GPT-2 (4 layers, n_embd 64, vocabulary {VOCABULARY}, 4 heads; sequence "
                f"{SEQUENCE}, {self.sizes}, AdamW)")

    def model(self) -> nn.Module:
        import transformers  # only when asked for: its import takes seconds

        config = transformers.GPT2Config(
            vocab_size=VOCABULARY, n_positions=SEQUENCE, n_embd=64, n_layer=4, n_head=4,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
        torch.manual_seed(0)
        gpt2 = transformers.GPT2LMHeadModel(config)
        gpt2.transformer.h[2] = poptorch.BeginBlock(gpt2.transformer.h[2], ipu_id=1)
        return gpt2

    def optimizer(self, params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-3)

    def batches(self, count: int) -> list[dict[str, torch.Tensor]]:
        g = torch.Generator().manual_seed(1)
        ids = [torch.randint(0, VOCABULARY, (self.samples, SEQUENCE), generator=g)
               for _ in range(count)]
        return [{"input_ids": x, "labels": x} for x in ids]

    def loss(self, output: Any) -> float:
        return float(output.loss.mean())


def works(args: argparse.Namespace) -> list[Work]:
    batch, accumulation = (4, 4) if args.quick else (16, 8)
    found: list[Work] = [Mlp(batch, accumulation, width=w) for w in args.widths]
    return found + ([Gpt2(4, 4, iterations=2)] if args.gpt2 else [])


# -- rows of one launch: each times one host call, so a launch's rows interleave ---------------
def synchronise() -> None:
    """Both processes start and end each timed call together (a no-op in one process)."""
    if dist.is_initialized():
        dist.barrier()


class PipetorchRow(Row):
    """The work's trainingModel: its stages on 2 workers of this process, or (`across`) one
    stage per process, each process running its stage's worker."""

    def __init__(self, work: Work, batches: list[dict[str, torch.Tensor]], *, across: bool) -> None:
        self.name, self.work, self.batches, self.losses = PIPETORCH, work, batches, []
        model = work.model()
        opts = poptorch.Options().showCompilationProgressBar(False).deviceIterations(
            work.iterations)
        opts.outputMode(poptorch.OutputMode.All)
        opts.Training.gradientAccumulation(work.accumulation)
        if across:
            opts.Distributed.stagesAcrossProcesses(True)
        self.training = poptorch.trainingModel(model, opts,
                                               optimizer=work.optimizer(model.parameters()))

    def call(self) -> float:
        batch = self.batches[len(self.losses) % len(self.batches)]
        synchronise()
        start = time.perf_counter()
        output = self.training(**batch)
        synchronise()
        seconds = time.perf_counter() - start
        self.losses.append(self.work.loss(output))
        return seconds

    def threads(self) -> list[int]:
        """This process's workers' intra-op threads (what pipetorch chose)."""
        return [r["threads"] for r in live_workers() if r.get("host_pid") == os.getpid()]

    def close(self) -> None:
        self.training.destroy()


class TorchRow(Row):
    """torch.distributed.pipelining's Schedule1F1B on this process's stage (rank 0 or 1), one
    intra-op thread during its calls."""

    def __init__(self, work: Work, module: nn.Module, batches: list[dict[str, torch.Tensor]],
                 rank: int) -> None:
        from torch.distributed import pipelining

        self.name, self.rank, self.batches, self.losses = TORCH, rank, batches, []
        stage = pipelining.PipelineStage(module, rank, 2, torch.device("cpu"))
        # scale_grads (the default) divides by the micro-batches: the mean over the step
        self.schedule = pipelining.Schedule1F1B(stage, n_microbatches=work.accumulation,
                                                loss_fn=nn.CrossEntropyLoss())
        self.optimizer = work.optimizer(module.parameters())

    def call(self) -> float:
        batch = self.batches[len(self.losses) % len(self.batches)]
        found: list[torch.Tensor] = []
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            synchronise()
            start = time.perf_counter()
            self.optimizer.zero_grad(set_to_none=True)
            self.schedule.step(*((batch["x"],) if self.rank == 0 else ()),
                               **({"target": batch["labels"], "losses": found}
                                  if self.rank == 1 else {}))
            self.optimizer.step()
            synchronise()
            seconds = time.perf_counter() - start
        finally:
            torch.set_num_threads(threads)
        self.losses.append(float(torch.stack(found).detach().mean()) if found else 0.0)
        return seconds


def measure(args: argparse.Namespace) -> None:
    """One launch: every work in turn, its rows' calls interleaved; the last stage's process
    prints each row's median call, losses and worker threads as one JSON line."""
    across = args.launch != "one"
    rank = int(os.environ.get("RANK", "0"))
    if across:
        dist.init_process_group("gloo")  # the host processes' own group, for torch's schedule
    results: dict[str, dict[str, Any]] = {}
    for work in works(args):
        batches = work.batches(args.calls + 1)
        rows: list[Row] = [PipetorchRow(work, batches, across=across)]
        stage = work.torch_stage(rank) if across else None
        if stage is not None:
            rows.append(TorchRow(work, stage, batches, rank))
        timings = interleave(rows, rounds=args.calls, samples=work.samples, log=lambda _: None)
        threads = rows[0].threads()
        results[work.name] = {row.name: {"median": statistics.median(timings[row.name].seconds),
                                         "losses": row.losses} for row in rows}
        results[work.name][PIPETORCH]["threads"] = threads
        for row in rows:
            row.close()
    if rank == (1 if across else 0):  # torch's losses are on the last stage's process
        print(RESULT + json.dumps(results), flush=True)
    if across:
        dist.destroy_process_group()


# -- the launcher ------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def commands(kind: str) -> list[list[str]]:
    """The command line(s) of one launch of `kind` (this script, told which it is)."""
    script = [__file__, *sys.argv[1:], "--launch", kind]
    if kind == "one":
        return [[sys.executable, *script]]
    run = [sys.executable, "-m", "torch.distributed.run", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port())]
    if kind == "nproc":
        return [[*run, "--nnodes", "1", "--nproc-per-node", "2", *script]]
    return [[*run, "--nnodes", "2", "--node-rank", str(n), "--nproc-per-node", "1", *script]
            for n in range(2)]


def launch(kind: str, timeout: float) -> dict[str, Any]:
    """Run one launch; its results (it must exit 0 and print them)."""
    processes = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for c in commands(kind)]
    try:
        logs = [p.communicate(timeout=timeout)[0] for p in processes]
    finally:
        for p in processes:
            p.kill()
    lines = [line for log in logs for line in log.splitlines() if line.startswith(RESULT)]
    if any(p.returncode for p in processes) or not lines:
        sys.exit(f"the {kind} launch failed:\n" + "\n".join(logs))
    return json.loads(lines[0][len(RESULT):])


def report(work: Work, launches: dict[str, list[dict[str, Any]]]) -> None:
    """The work's rows (median of the launches' medians), ratios, loss differences, threads."""
    results = {kind: [r[work.name] for r in found] for kind, found in launches.items()}
    timings = {(kind, row): Timing([r[row]["median"] for r in found], work.samples)
               for kind, found in results.items() for row in found[0]}
    labels = {("one", PIPETORCH): "pipetorch, 1 process (2 workers)"} | {
        (kind, row): f"{'pipetorch, 2 processes' if row == PIPETORCH else row}, {recipe}"
        for kind, recipe in RECIPES.items() for row in (PIPETORCH, TORCH)
        if (kind, row) in timings}
    width = max(map(len, labels.values())) + 2
    print(f"\n{work.name}: {work.samples} samples a call, medians of {len(results['one'])} "
          "launches")
    print(f"{'case':<{width}}{'samples/s':>10}  {'slowest..fastest':>17}")
    for key, label in labels.items():
        low, high = timings[key].spread
        print(f"{label:<{width}}{timings[key].rate:>10,.1f}  {low:>8,.1f}..{high:<8,.1f}")
    one = timings["one", PIPETORCH].rate
    print("pipetorch 2 processes, ratios of medians:")
    for kind, recipe in RECIPES.items():
        two = timings[kind, PIPETORCH].rate
        torch_ratio = (f" / torch Schedule1F1B {two / timings[kind, TORCH].rate:5.2f}x  "
                       if (kind, TORCH) in timings else "")
        print(f"  {recipe:<19}{torch_ratio} / 1 process {two / one:5.2f}x")
    reference = results["one"][0][PIPETORCH]["losses"]
    pairs = {"2 processes vs 1 process": [(reference, r[PIPETORCH]["losses"])
                                          for kind in RECIPES for r in results[kind]],
             "pipetorch vs torch": [(r[PIPETORCH]["losses"], r[TORCH]["losses"])
                                    for kind in RECIPES for r in results[kind] if TORCH in r]}
    gaps = [f"{name} {max(abs(a - b) for x, y in found for a, b in zip(x, y)):.2e}"
            for name, found in pairs.items() if found]
    print(f"largest difference of a call's mean loss: {'; '.join(gaps)}")
    threads = "; ".join(f"{name} {results[kind][0][PIPETORCH]['threads']}" for name, kind in (
        ("1 process", "one"), *((f"{r} (a process's)", k) for k, r in RECIPES.items())))
    print(f"pipetorch workers' intra-op threads: {threads}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="width 32 and GPT-2, B4 G4 for the MLP, 1 round of launches, 2 "
                             "calls a row (a smoke test)")
    parser.add_argument("--widths", type=int, nargs="+", default=None,
                        help="the MLP's widths (default: 512 2048; quick: 32)")
    parser.add_argument("--gpt2", action=argparse.BooleanOptionalAction, default=True,
                        help="the tiny GPT-2's rows (default: on)")
    parser.add_argument("--rows", type=int, default=None,
                        help="rows of each kind, one launch each, taken in turn (default: 5; "
                             "quick: 1)")
    parser.add_argument("--calls", type=int, default=None,
                        help="timed calls per row in a launch, after one warm-up (default: 5; "
                             "quick: 2)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds a launch may take")
    parser.add_argument("--launch", choices=LAUNCHES, help=argparse.SUPPRESS)  # the launcher's
    args = parser.parse_args()
    args.widths = args.widths or ([32] if args.quick else [512, 2048])
    args.rows = args.rows or (1 if args.quick else 5)
    args.calls = args.calls or (2 if args.quick else 5)
    if args.launch:
        measure(args)
        return
    print(f"{cpu_cores()} cores, torch {torch.__version__}, default threads (torch's "
          f"Schedule1F1B: 1 per process); {args.rows} round(s) of launches (1 process, "
          f"{', '.join(RECIPES.values())}), {args.calls} timed calls a row in each", flush=True)
    launches: dict[str, list[dict[str, Any]]] = {kind: [] for kind in LAUNCHES}
    for round_ in range(args.rows):
        took = []
        for kind in LAUNCHES:
            start = time.perf_counter()
            launches[kind].append(launch(kind, args.timeout))
            took.append(f"{kind} {time.perf_counter() - start:.0f} s")
        print(f"round {round_ + 1}/{args.rows}: {', '.join(took)}", flush=True)
    for work in works(args):
        report(work, launches)


if __name__ == "__main__":
    main()
