"""Automatic stage balancing: seed 000's CNN at 128x128 and a BERT, natural vs balanced splits.

Rows, timed with interleaved repeats (one call of each wrapper per round, so a change in the
machine's load hits every row alike) and reported as medians:

    cnn   seed 000's CNN on 128x128 images with the seed's widths (no widening): pipelined over
          2 devices with the natural split (B1+B2 | B3+B4) and with the split pipetorch.balance
          chooses from measured costs; plain PyTorch on 2 threads; torch's Schedule1F1B on the
          natural split (its own processes, interleaved with the others)
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

import torch

import pipetorch as poptorch
from pipetorch.parallel.layout.placement import cpu_cores
from pipetorch.partition.blocks import removeBlocks
from pipetorch.partition.balance import Segment, evaluate, plan
from pipetorch.partition.candidates import candidates
from pipetorch.planning.costs import cost_table

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pipeline as seed  # noqa: E402

# Seed 000 uses `with Block(...)` in its forward: its modules map onto blocks B1..B4.
BLOCK_OF = {"model.layer1": "B1", "model.layer2": "B2", "model.layer3": "B3",
            "model.layer3_act": "B3", "model.layer4": "B4", "loss": "B4"}
EPOCH = 60_000
NATURAL, BALANCED = "pipelined, natural split", "pipelined, balanced split"


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


class WrapperRow(seed.Row):
    """A pipetorch wrapper called with the same batch every time."""

    def __init__(self, name: str, wrapper, *, baseline: str | None = None,
                 kwargs: dict | None = None, args: tuple = ()) -> None:
        self.name, self.wrapper, self.baseline = name, wrapper, baseline
        self.args, self.kwargs = args, kwargs or {}

    def call(self) -> float:
        start = time.perf_counter()
        self.wrapper(*self.args, **self.kwargs)
        return time.perf_counter() - start

    def close(self) -> None:
        self.wrapper.destroy()


def timed(rows: list[seed.Row], rounds: int, samples: int) -> dict[str, seed.Timing]:
    """Every row's interleaved calls (pipeline.py's rounds); the rows are closed after."""
    try:
        return seed.interleave(rows, rounds=rounds, samples=samples, log=lambda line: None)
    finally:
        for row in rows:
            row.close()


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
    natural = seed.CnnWork(bench)
    balanced = seed.CnnWork(seed.replace(bench, boundary=chosen.starts[1]))
    data = natural.data()
    plain = seed.PlainRow(natural, data, threads=2, baseline=None)
    rows = [plain,
            seed.PipetorchRow(natural, data, NATURAL, devices="pipelined", threads=cores,
                              baseline=plain.name),
            seed.PipetorchRow(balanced, data, BALANCED, devices="pipelined", threads=cores,
                              baseline=NATURAL),
            seed.TorchPipeliningRow(natural, data, baseline=NATURAL)]
    timings = timed(rows, args.rounds, natural.samples_per_call)
    seed.print_rows(rows, timings, "images/s")
    rates = {n: t.rate for n, t in timings.items()}
    print(f"  balanced / natural {rates[BALANCED] / rates[NATURAL]:.2f}x (target >= 1.2x); "
          f"balanced / plain 2 threads {rates[BALANCED] / rates[plain.name]:.2f}x "
          "(target >= 1.0x)")


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
    rows = []
    for name, model in (("uniform layers per device", uniform), ("balanced", balanced)):
        opts = poptorch.Options().deviceIterations(D).showCompilationProgressBar(False)
        opts.Training.gradientAccumulation(G)
        opts.setExecutionStrategy(poptorch.PipelinedExecution(poptorch.AutoStage.SameAsIpu))
        wrapper = poptorch.trainingModel(
            model, opts, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4))
        rows.append(WrapperRow(name, wrapper, kwargs=batch,
                               baseline=rows[0].name if rows else None))
    seed.print_rows(rows, timed(rows, args.rounds, micro * G * D), "samples/s")


def balancing_cost(args: argparse.Namespace, cores: int) -> None:
    bench = seed.Bench("seed 000", seed.Widths(28), 1, boundary=2)
    start = time.perf_counter()
    plan(block_table(bench, threads=max(1, cores // 2)), 2)
    took = time.perf_counter() - start
    work = seed.CnnWork(bench)
    row = seed.PipetorchRow(work, work.data(), "seed", devices="pipelined",
                            threads=cores, baseline=None)
    seconds = statistics.median(timed([row], args.rounds, work.samples_per_call)["seed"].seconds)
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
