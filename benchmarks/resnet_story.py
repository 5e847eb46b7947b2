"""Seed 002's day as one benchmark: a ResNet over 2 devices refused in 32.32, then made fast.

The ResNet of examples/resnet_optimisation.py (torchvision's layout, BasicBlocks), split over
2 devices with the seed's `poptorch.BeginBlock` in the middle of layer3 and pipelined, trained
with AdamW on generated 32x32 CIFAR-shaped images (examples/cifar_data.py: the host
normalises each image, or sends uint8 with 8-bit I/O and the model normalises it).

1. Memory: a per-device budget (`opts.setMemoryBudget`) is chosen between the estimated peaks
   of 16.16 and 32.32 (each found by compiling under a 1-byte budget and reading the
   OutOfMemoryError's estimate); 32.32 is refused under it, with the remedies, and 16.16 fits.
2. Throughput: each row adds one of the seed's changes to the one before (16.16 GA 3, GA 8,
   DI 4, 8-bit I/O, the async loader), all under the budget; then plain PyTorch rows (the
   same model, precision and optimiser in a hand loop, GA 8) and a 32.32 row with the last
   row's batching, which runs only because no budget is set for it. Images/s is the median
   over timed calls, each fetching its batch from the row's loader and training on it
   (compile and one warm-up call excluded). Bytes host-to-device per image come from the
   workers' H2D spans (engine.last_trace) when present, else from the inputs' sizes.

    python benchmarks/resnet_story.py            # full run (~5 min on 2 busy cores)
    python benchmarks/resnet_story.py --quick    # tiny sizes, one timed call per row
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

import pipetorch as poptorch
from pipetorch.parallel.layout.placement import cpu_cores, live_workers
from pipetorch.planning.estimate import fmt

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_timing import median_rate  # noqa: E402
from cifar_data import CifarImages, generated_images, resize  # noqa: E402
from resnet_optimisation import (  # noqa: E402
    LOSS_SCALING, ModelWithLoss, ModelWithNormalization, ResNet, make_optimizer, positive_int,
    split,
)

DTYPES = {"16.16": torch.float16, "32.32": torch.float32}


@dataclass(frozen=True)
class Config:
    """One row: precision, batching, data path, and whether the memory budget applies."""

    name: str
    precision: str
    accumulation: int
    iterations: int = 1
    eight_bit: bool = False
    asynchronous: bool = False
    budgeted: bool = True
    plain: bool = False
    offload: bool = False  # optimiser state in host memory, moved in for each update


@dataclass
class Row:
    """One line of the table, as measured."""

    name: str
    config: Config
    images_per_call: int
    rate: float                 # images/s, median of the timed calls
    h2d_per_image: float | None  # bytes; None for the plain rows (nothing is moved)
    h2d_source: str


STORY = (
    Config("16.16 GA 3", "16.16", 3),
    Config("+ GA 8", "16.16", 8),
    Config("+ DI 4", "16.16", 8, 4),
    Config("+ 8-bit I/O", "16.16", 8, 4, eight_bit=True),
    Config("+ async loader", "16.16", 8, 4, eight_bit=True, asynchronous=True),
)
OFFLOAD = Config("async loader row + optimiser offload", "16.16", 8, 4, eight_bit=True,
                 asynchronous=True, offload=True)
PLAIN_16 = Config("plain PyTorch 16.16, GA 8 DI 4", "16.16", 8, 4, plain=True)
FULL_32 = Config("32.32, last row's batching (no budget)", "32.32", 8, 4, eight_bit=True,
                 asynchronous=True, budgeted=False)
PLAIN_32 = Config("plain PyTorch 32.32, GA 8 DI 4", "32.32", 8, 4, plain=True)


def build(config: Config, args: argparse.Namespace) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The seed's model and optimiser for `config` (split over 2 devices unless plain)."""
    torch.manual_seed(args.seed)
    dtype = DTYPES[config.precision]
    model: nn.Module = ResNet(width=args.width, blocks=args.blocks)
    if not config.plain:
        split(model, None)
    if config.eight_bit:
        model = ModelWithNormalization(model, dtype=dtype)
    model = ModelWithLoss(model, nn.CrossEntropyLoss()).to(dtype)
    return model, make_optimizer(model, half=dtype == torch.float16, lr=args.learning_rate)


def options(config: Config, args: argparse.Namespace, budget: int | None) -> poptorch.Options:
    opts = poptorch.Options().randomSeed(args.seed).deviceIterations(config.iterations)
    opts.Training.gradientAccumulation(config.accumulation)
    opts.showCompilationProgressBar(False)
    if budget is not None:
        opts.setMemoryBudget(budget)
    if config.offload:
        opts.TensorLocations.setOptimizerLocation(
            poptorch.TensorLocationSettings().useOnChipStorage(False))
    return opts


def loader(config: Config, opts: poptorch.Options, data: tuple[torch.Tensor, torch.Tensor],
           batch_size: int) -> poptorch.DataLoader:
    dataset = CifarImages(*data, flip=True,
                          dtype=None if config.eight_bit else DTYPES[config.precision])
    mode = poptorch.DataLoaderMode.Async if config.asynchronous else poptorch.DataLoaderMode.Sync
    return poptorch.DataLoader(opts, dataset, batch_size=batch_size, shuffle=True, mode=mode)


def compile_under(config: Config, args: argparse.Namespace, data: tuple[torch.Tensor, ...],
                  budget: int) -> poptorch.errors.OutOfMemoryError | None:
    """Compile `config` under `budget` bytes per device: the refusal, or None when it fits."""
    opts = options(config, args, budget)
    model, optimizer = build(config, args)
    training = poptorch.trainingModel(model, opts, optimizer=optimizer)
    try:
        training.compile(*next(iter(loader(config, opts, data, args.batch_size))))
    except poptorch.errors.OutOfMemoryError as error:
        return error
    finally:
        training.destroy()
    return None


def estimated_peak(config: Config, args: argparse.Namespace, data: tuple) -> int:
    """The largest device peak the compile-time estimate gives `config` (under 1 byte)."""
    error = compile_under(config, args, data, 1)
    assert error is not None, "every configuration is over a 1-byte budget"
    return max(device.total for device in error.estimate.devices.values())


def choose_budget(fits: int, over: int) -> int:
    """Bytes that `fits` (a peak) stays within and `over` exceeds: near their geometric
    mean, rounded down to 2 significant digits when that keeps it between them."""
    if not 0 < fits < over:
        raise ValueError(f"choose_budget needs 0 < fits < over, got fits={fits}, over={over}: "
                         "the 16.16 estimate must be below the 32.32 one")
    middle = int((fits * over) ** 0.5)
    unit = 10 ** max(len(str(middle)) - 2, 0)
    budget = middle // unit * unit
    return budget if fits <= budget < over else (fits + over) // 2


def pipetorch_row(config: Config, args: argparse.Namespace, data: tuple,
                  budget: int | None) -> tuple[Row, list[int]]:
    """A row run through trainingModel, and the threads of its stage workers."""
    opts = options(config, args, budget if config.budgeted else None)
    model, optimizer = build(config, args)
    batches = loader(config, opts, data, args.batch_size)
    images = batches.combinedBatchSize
    training = poptorch.trainingModel(model, opts, optimizer=optimizer)
    fed: list[tuple[torch.Tensor, torch.Tensor]] = []
    stream = iter(batches)
    try:
        training.compile(*next(stream))
        threads = [r["threads"] for r in live_workers() if r.get("host_pid") == os.getpid()]

        def call() -> None:
            fed[:] = [next(stream)]
            training(*fed[0])

        rate = median_rate(call, images, args.calls)[0]
        spans = [s for trace in getattr(training._compiled.engine, "last_trace", [])
                 for s in trace.spans if s.kind == "H2D"]
    finally:
        training.destroy()
        if config.asynchronous:
            batches.terminate()
    if spans:
        moved, source = sum(s.nbytes for s in spans), "H2D spans"
    else:
        moved, source = sum(t.nbytes for t in fed[0]), "input sizes"
    return Row(config.name, config, images, rate, moved / images, source), threads


def plain_row(config: Config, args: argparse.Namespace, data: tuple, threads: int) -> Row:
    """The same training in a hand loop: host-normalised images, one step per GA batches."""
    torch.set_num_threads(threads)
    model, optimizer = build(config, args)
    model.train()
    dataset = CifarImages(*data, flip=True, dtype=DTYPES[config.precision])
    stream = iter(torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, shuffle=True,
                                              drop_last=True))
    scale = getattr(optimizer, "loss_scaling", None) or 1.0

    def call() -> None:
        for _ in range(config.iterations):
            optimizer.zero_grad(set_to_none=True)
            for _ in range(config.accumulation):
                images, labels = next(stream)
                _, loss = model(images, labels)
                (loss * scale).backward()  # the optimiser divides it back out
            optimizer.step()

    images = args.batch_size * config.accumulation * config.iterations
    try:
        rate = median_rate(call, images, args.calls)[0]
    finally:
        torch.set_num_threads(args.threads)
    name = f"{config.name}, {threads} thread{'s' if threads > 1 else ''}"
    return Row(name, config, images, rate, None, "")


def memory_story(args: argparse.Namespace, data: tuple) -> tuple[int, int]:
    """Print the budget and 32.32's refusal under it; return the budget and 16.16's peak."""
    half, full = STORY[0], Config("32.32 GA 3", "32.32", 3)
    fits, over = estimated_peak(half, args, data), estimated_peak(full, args, data)
    budget = choose_budget(fits, over)
    print(f"\n== memory: ResNet over 2 devices, batch {args.batch_size} x GA 3\n"
          f"estimated peak of the fuller device: 32.32 {fmt(over)}, 16.16 {fmt(fits)}; "
          f"budget chosen between them: opts.setMemoryBudget({budget})  # {fmt(budget)} "
          "per device")
    refusal = compile_under(full, args, data, budget)
    if refusal is None:
        raise SystemExit(f"32.32 compiled under {budget} bytes although its estimate is {over}")
    message = str(refusal).splitlines()
    table_end = message.index("", 2)
    print("32.32 GA 3: refused at compile, OutOfMemoryError:")
    print("\n".join("  | " + line for line in message[:table_end]))
    print("  | top remedies:")
    for rank, remedy in enumerate(refusal.remedies[:3], 1):
        verdict = "fits on its own" if remedy.fits else "not enough on its own"
        print(f"  | {rank}. {remedy.name}: saves {fmt(remedy.saving)}; {verdict}")
    return budget, fits


def print_table(rows: list[Row]) -> None:
    """The rows; x plain PyTorch compares with the fastest plain row of the same precision."""
    width = max(len(r.name) for r in rows) + 2
    print(f"{'step':<{width}}{'images/call':>12}{'images/s':>10}{'x previous':>12}"
          f"{'x plain PyTorch':>17}{'H2D bytes/image':>17}")
    plain: dict[str, float] = {}
    for row in rows:
        if row.config.plain:
            plain[row.config.precision] = max(plain.get(row.config.precision, 0.0), row.rate)
    previous = None
    for row in rows:
        config = row.config
        step = f"{row.rate / previous:.2f}x" if previous and config in STORY[1:] else ""
        versus = "" if config.plain else f"{row.rate / plain[config.precision]:.2f}x"
        moved = "-" if row.h2d_per_image is None else f"{row.h2d_per_image:,.0f}"
        print(f"{row.name:<{width}}{row.images_per_call:>12}{row.rate:>10.1f}{step:>12}"
              f"{versus:>17}{moved:>17}")
        previous = row.rate


def thread_counts(text: str) -> list[int]:
    counts = [positive_int(part) for part in text.split(",") if part.strip()]
    if not counts:
        raise argparse.ArgumentTypeError(f"give thread counts such as 1,2; got {text!r}")
    return counts


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="tiny model and batches, one timed call per row (a smoke test)")
    parser.add_argument("--calls", type=positive_int, default=None,
                        help="timed calls per row after the warm-up (default: 5, quick: 1)")
    parser.add_argument("--width", type=positive_int, default=None,
                        help="channels of the ResNet's first layer (default: 8, quick: 4)")
    parser.add_argument("--blocks", type=positive_int, default=None,
                        help="BasicBlocks per layer (default: 2 as ResNet-18, quick: 1)")
    parser.add_argument("--batch-size", type=positive_int, default=None,
                        help="micro-batch size (default: 8, quick: 2; the seed's IPUs took 64)")
    parser.add_argument("--image-size", type=positive_int, default=32,
                        help="image side (default: 32; the seed resized to 64)")
    parser.add_argument("--plain-threads", type=thread_counts, default=None,
                        help="intra-op threads of the plain PyTorch rows, comma-separated "
                             "(default: 1 and all cores; quick: 1)")
    parser.add_argument("--learning-rate", type=float, default=0.001)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    quick = args.quick
    args.calls = args.calls or (1 if quick else 5)
    args.width = args.width or (4 if quick else 8)
    args.blocks = args.blocks or (1 if quick else 2)
    args.batch_size = args.batch_size or (2 if quick else 8)
    cores = cpu_cores()
    args.plain_threads = args.plain_threads or ([1] if quick else sorted({1, cores}))
    args.threads = torch.get_num_threads()
    return args


def main() -> None:
    args = parse_args()
    print(f"{cpu_cores()} cores (of {os.cpu_count()}), torch {torch.__version__}, "
          f"{args.threads} intra-op threads in this process")
    print(f"ResNet width {args.width}, {args.blocks} block(s) per layer, BeginBlock at "
          f"layer3.{args.blocks // 2}, pipelined over 2 devices; {args.image_size}x"
          f"{args.image_size} generated images, micro-batch {args.batch_size}, AdamW lr "
          f"{args.learning_rate} (16.16: loss scaling {LOSS_SCALING:g}, fp16 accumulators); "
          f"median of {args.calls} timed call(s) per row")
    # Enough images for every row's compile batch, warm-up call and timed calls.
    count = (args.calls + 2) * args.batch_size * 8 * 4
    images, labels = generated_images(count, seed=args.seed)
    data = (resize(images, args.image_size), labels)

    budget, fits = memory_story(args, data)
    rows, threads = [], []
    for config in STORY:
        row, threads = pipetorch_row(config, args, data, budget)
        rows.append(row)
        if config is STORY[0]:
            print(f"16.16 GA 3: compiled under the same budget (estimated peak {fmt(fits)} <= "
                  f"{fmt(budget)}) and ran; so did every 16.16 row below")
    rows.append(pipetorch_row(OFFLOAD, args, data, budget)[0])
    rows += [plain_row(PLAIN_16, args, data, n) for n in args.plain_threads]
    rows.append(pipetorch_row(FULL_32, args, data, budget)[0])
    rows += [plain_row(PLAIN_32, args, data, n) for n in args.plain_threads]
    print(f"\n== throughput: each story row adds one change to the row above; stage workers "
          f"run {threads} threads; plain rows are a hand loop with the same model, optimiser "
          "and host-normalised images")
    print_table(rows)
    sources = sorted({r.h2d_source for r in rows if r.h2d_source})
    print(f"\nH2D bytes/image: from the {' and '.join(sources)} of the last timed call "
          "(images and labels); plain rows train on the host's own tensors: nothing moves.")
    last, full = rows[len(STORY) - 1].rate, next(r.rate for r in rows if r.config is FULL_32)
    offload = next(r.rate for r in rows if r.config is OFFLOAD)
    print(f"Optimiser offload: {offload:.1f} images/s, {offload / last:.2f}x the same row with "
          "the state on the device (the update copies the state in and out each step; on a "
          "CPU device both sides are host memory, so this is the copies' cost only).")
    print(f"Note: CPUs have no fast fp16 kernels, so 16.16 computes slower than 32.32 once "
          f"convolutions dominate (on IPUs and GPUs it is the faster one); here 32.32 with the "
          f"last row's batching ran at {full:.1f} images/s, {full / last:.2f}x the 16.16 row. "
          "It runs only because no budget is set for that row.")


if __name__ == "__main__":
    main()
