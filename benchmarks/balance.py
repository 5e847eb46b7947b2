"""Automatic stage balancing: seed 000's CNN at 128x128 and a BERT, natural vs balanced splits.

Rows, timed with interleaved repeats (one call of each wrapper per round, so a change in the
machine's load hits every row alike) and reported as medians:

    cnn   seed 000's CNN on 128x128 images with the seed's widths (no widening): pipelined over
          2 devices with the natural split (B1+B2 | B3+B4) and with the split pipetorch.balance
          chooses from measured costs; plain PyTorch on 2 threads; torch's Schedule1F1B on the
          natural split (its own processes, timed after the rounds)
    bert  BERT (hidden 256, 8 layers, sequence 128) over 2 devices: uniform layers per device
          vs pipetorch.balance

It also times balancing itself (profiling + solving) against one epoch (60,000 images) of
seed 000's model at 28x28, pipelined on the natural split.

    python benchmarks/balance.py            # full run
    python benchmarks/balance.py --quick    # a smoke test: D=1, 1 round, small BERT
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

import pipetorch as poptorch
from pipetorch.parallel.placement import cpu_cores
from pipetorch.partition.blocks import removeBlocks
from pipetorch.partition.balance import Segment, evaluate, plan
from pipetorch.partition.candidates import candidates
from pipetorch.profiling.costs import cost_table

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pipeline as seed  # noqa: E402

# Seed 000 uses `with Block(...)` in its forward: its modules map onto blocks B1..B4.
BLOCK_OF = {"model.layer1": "B1", "model.layer2": "B2", "model.layer3": "B3",
            "model.layer3_act": "B3", "model.layer4": "B4", "loss": "B4"}
EPOCH = 60_000


def block_table(bench: seed.Bench, *, threads: int) -> list[Segment]:
    """Measured costs of B1..B4 on one micro-batch: the candidates summed per block."""
    model = seed.WithLoss(seed.new_network(bench.widths))
    images, labels = seed.make_data(bench)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        table = cost_table(model, candidates(model),
                           (images[:seed.MICRO_BATCH], labels[:seed.MICRO_BATCH]))
    finally:
        torch.set_num_threads(previous)
    blocks = []
    for block in seed.BLOCKS:
        part = [s for s in table if BLOCK_OF[s.name] == block]
        blocks.append(Segment(block, sum(s.seconds for s in part),
                              sum(s.activation_bytes for s in part),
                              sum(s.param_bytes for s in part), part[-1].transfer_seconds))
    return blocks


def interleaved(rows: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Median seconds per call of each row, one call of each per round after a warm-up."""
    for call in rows.values():
        call()
    seconds: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(rounds):
        for name, call in rows.items():
            start = time.perf_counter()
            call()
            seconds[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in seconds.items()}


def plain_call(bench: seed.Bench, data, threads: int) -> Callable[[], None]:
    model = seed.WithLoss(seed.new_network(bench.widths))
    optimizer = torch.optim.AdamW(model.parameters(), lr=seed.LEARNING_RATE)
    images, labels = data
    step = seed.ACCUMULATION * seed.MICRO_BATCH

    def call() -> None:
        torch.set_num_threads(threads)
        for d in range(bench.device_iterations):
            optimizer.zero_grad(set_to_none=True)
            for g in range(d * step, (d + 1) * step, seed.MICRO_BATCH):
                _, loss = model(images[g:g + seed.MICRO_BATCH], labels[g:g + seed.MICRO_BATCH])
                (loss / seed.ACCUMULATION).backward()
            optimizer.step()
    return call


def cnn(args: argparse.Namespace, cores: int) -> None:
    bench = seed.Bench("seed 000 at 128x128", seed.Widths(128), 1 if args.quick else 2,
                       boundary=2)
    threads = max(1, cores // 2)
    start = time.perf_counter()
    table = block_table(bench, threads=threads)
    chosen = plan(table, 2)
    took = time.perf_counter() - start
    natural = evaluate(table, (0, 2))
    print(f"\n== {bench.name}: B{seed.MICRO_BATCH} G{seed.ACCUMULATION} "
          f"D{bench.device_iterations}; measured fwd+bwd per block ({threads} thread(s)): "
          + ", ".join(f"{s.name} {s.seconds * 1e3:.1f} ms" for s in table))
    for label, p in (("natural", natural), ("balanced", chosen)):
        ms = " / ".join(f"{s.seconds * 1e3:.1f}" for s in p.stages)
        print(f"  {label:<9} {'+'.join(p.stages[0].segments)} | "
              f"{'+'.join(p.stages[1].segments)}: {ms} ms predicted per stage")
    print(f"  balancing took {took:.2f} s (profiling + solving)")
    balanced = seed.replace(bench, boundary=chosen.starts[1])
    data = seed.make_data(bench)
    wrappers = {
        "pipelined, natural split": seed.training_model(
            bench, poptorch.PipelinedExecution(*seed.two_stages(bench))),
        "pipelined, balanced split": seed.training_model(
            balanced, poptorch.PipelinedExecution(*seed.two_stages(balanced))),
    }
    try:
        rows = {name: (lambda w=w: w(*data)) for name, w in wrappers.items()}
        rows["plain PyTorch, 2 threads"] = plain_call(bench, data, 2)
        medians = interleaved(rows, args.rounds)
    finally:
        for w in wrappers.values():
            w.destroy()
    medians["torch Schedule1F1B, natural split"] = bench.images_per_call / seed.torch_pipelining_rate(
        bench, data, calls=args.rounds)
    _print_rates(bench.images_per_call, medians)
    rates = {n: bench.images_per_call / s for n, s in medians.items()}
    print(f"  balanced / natural {rates['pipelined, balanced split'] / rates['pipelined, natural split']:.2f}x "
          f"(target >= 1.2x); balanced / plain 2 threads "
          f"{rates['pipelined, balanced split'] / rates['plain PyTorch, 2 threads']:.2f}x (target >= 1.0x)")


def _print_rates(images: int, medians: dict[str, float]) -> None:
    for name, seconds in medians.items():
        print(f"  {name:<36} {images / seconds:9.1f} images/s  ({seconds * 1e3:.0f} ms/call)")


def bert(args: argparse.Namespace) -> None:
    from compile_time import bert as make_bert, inputs
    layers, hidden, sequence = (4, 64, 32) if args.quick else (8, 256, 128)
    micro, G, D = 2, 4, 1
    uniform = make_bert(layers, hidden, 2, sequence)
    balanced = removeBlocks(make_bert(layers, hidden, 2, sequence))  # balance the layers
    start = time.perf_counter()
    placement = poptorch.balance(balanced, sample_kwargs=inputs(micro, sequence), devices=2)
    took = time.perf_counter() - start
    print(f"\n== BERT hidden {hidden}, {layers} layers, sequence {sequence}, B{micro} G{G} over "
          f"2 devices; balancing took {took:.2f} s\n{placement.table()}")
    print("  " + "\n  ".join(placement.begin_block_lines()))
    batch = inputs(micro * G * D, sequence)
    wrappers = {}
    for name, model in (("uniform layers per device", uniform), ("balanced", balanced)):
        opts = poptorch.Options().deviceIterations(D).showCompilationProgressBar(False)
        opts.Training.gradientAccumulation(G)
        opts.setExecutionStrategy(poptorch.PipelinedExecution(poptorch.AutoStage.SameAsIpu))
        wrappers[name] = poptorch.trainingModel(
            model, opts, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4))
    try:
        medians = interleaved({n: (lambda w=w: w(**batch)) for n, w in wrappers.items()},
                              args.rounds)
    finally:
        for w in wrappers.values():
            w.destroy()
    _print_rates(micro * G * D, medians)


def balancing_cost(args: argparse.Namespace, cores: int) -> None:
    bench = seed.Bench("seed 000", seed.Widths(28), 1, boundary=2)
    start = time.perf_counter()
    plan(block_table(bench, threads=max(1, cores // 2)), 2)
    took = time.perf_counter() - start
    data = seed.make_data(bench)
    wrapper = seed.training_model(bench, poptorch.PipelinedExecution(*seed.two_stages(bench)))
    try:
        seconds = interleaved({"seed": lambda: wrapper(*data)}, args.rounds)["seed"]
    finally:
        wrapper.destroy()
    epoch = seconds * EPOCH / bench.images_per_call
    print(f"\n== balancing cost: {took:.2f} s vs one epoch of seed 000 ({EPOCH} images, "
          f"pipelined) {epoch:.1f} s: {100 * took / epoch:.1f}% (target < 10%)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="D=1, 1 round, a small BERT")
    parser.add_argument("--rounds", type=int, default=None,
                        help="interleaved timed rounds (default 5, quick 1)")
    parser.add_argument("--only", default="cnn,bert,cost", help="comma-separated parts")
    args = parser.parse_args()
    args.rounds = args.rounds or (1 if args.quick else 5)
    cores = cpu_cores()
    print(f"{cores} cores; torch {torch.__version__}; medians of {args.rounds} interleaved round(s)")
    parts = {"cnn": lambda: cnn(args, cores), "bert": lambda: bert(args),
             "cost": lambda: balancing_cost(args, cores)}
    for part in args.only.split(","):
        parts[part.strip()]()


if __name__ == "__main__":
    main()
