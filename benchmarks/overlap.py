"""Replicas' all-reduce overlapped with the last backward: step time with and without it.

Two replicas (gloo, one worker process per replica and stage) train an MLP of 6 equal layers
whose 96 MiB of fp32 gradients fill four 25 MiB buckets, on 1 stage and on 2 stages
(pipelined). Each row is run with PIPETORCH_OVERLAP=0 (every bucket summed at the step,
after the whole backward) and =1 (a bucket's all-reduce starts as soon as the step's last
backward finished its gradients, parallel/worker/overlap.py). Numbers, from the workers' traces of
the timed calls, per worker and optimiser step: the step (first action to the end of STEP),
and the time spent at the "AR" action (starting what is left and waiting for every bucket).
The host call's median seconds is printed as well. Both settings run on the same workers,
call after call, so a busy machine's drift falls on both alike. Ratios are overlap / no
overlap: below 1 is faster.

    python benchmarks/overlap.py            # about a minute on 2 cores
    python benchmarks/overlap.py --quick    # a smaller model, 1 timed call (a smoke test)
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import pipetorch as poptorch

REPLICAS, ACCUMULATION, MICRO_BATCH = 2, 4, 32


class Mlp(nn.Module):
    """`depth` square layers then a 10-way head; with `split`, the second half of the layers
    on a second device. Equal layers let a bucket start while the layers before it still run
    their backward."""

    def __init__(self, width: int, depth: int, *, split: bool) -> None:
        super().__init__()
        self.split = split
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor, labels: torch.Tensor):  # type: ignore[no-untyped-def]
        half = len(self.layers) // 2
        with poptorch.Block("first", ipu_id=0):
            for layer in self.layers[:half]:
                x = torch.relu(layer(x))
        with poptorch.Block("second", ipu_id=1 if self.split else 0):
            for layer in self.layers[half:]:
                x = torch.relu(layer(x))
            out = self.head(x)
            return out, F.cross_entropy(out, labels)


@dataclass(frozen=True)
class Row:
    call_s: float    # median host call
    step_ms: float   # mean per worker and step
    wait_ms: float   # mean AR span per worker and step
    buckets: float   # early all-reduces per worker and step (0 without overlap)


def trainer(width: int, depth: int, *, split: bool):  # type: ignore[no-untyped-def]
    """A compiled training model of 2 replicas."""
    torch.manual_seed(0)
    model = Mlp(width, depth, split=split)
    opts = poptorch.Options().replicationFactor(REPLICAS)
    opts.Training.gradientAccumulation(ACCUMULATION)
    opts.showCompilationProgressBar(False)
    training = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.01))
    training.compile(*data_for(width))
    return training


def data_for(width: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    count = REPLICAS * ACCUMULATION * MICRO_BATCH
    return torch.randn(count, width), torch.randint(0, 10, (count,))


def measure(width: int, depth: int, *, split: bool, calls: int) -> dict[bool, Row]:
    """Both settings on the same workers, call after call (PIPETORCH_OVERLAP is read at each
    call), so a busy machine's drift falls on both alike."""
    data = data_for(width)
    training = trainer(width, depth, split=split)
    seconds: dict[bool, list[float]] = {False: [], True: []}
    traces: dict[bool, list] = {False: [], True: []}
    try:
        for turn in range(calls + 1):  # the first turn warms both up
            for overlap in (False, True):
                os.environ["PIPETORCH_OVERLAP"] = "1" if overlap else "0"
                took = _timed(lambda: training(*data))
                if turn:
                    seconds[overlap].append(took)
                    traces[overlap] += training._compiled.engine.last_trace
    finally:
        training.destroy()
        os.environ.pop("PIPETORCH_OVERLAP", None)
    return {overlap: _row(seconds[overlap], traces[overlap]) for overlap in (False, True)}


def _timed(call) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def _row(seconds: list[float], traces: list) -> Row:
    steps, waits, buckets = [], [], []
    for trace in traces:
        first = None
        for span in trace.spans:
            if span.kind in ("H2D", "D2H"):
                continue
            first = span.start if first is None else first
            if span.kind == "AR":
                waits.append((span.end - span.start) / 1e6)
            elif span.kind == "STEP":
                steps.append((span.end - first) / 1e6)
                first = None
        buckets.append(len(trace.early_reduces) / max(1, sum(s.kind == "STEP"
                                                             for s in trace.spans)))
    return Row(statistics.median(seconds), statistics.fmean(steps), statistics.fmean(waits),
               statistics.fmean(buckets))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small model, 1 timed call")
    parser.add_argument("--calls", type=int, default=5, help="timed calls per row")
    args = parser.parse_args()
    width, depth, calls = (256, 4, 1) if args.quick else (2048, 6, args.calls)
    size = sum(p.numel() for p in Mlp(width, depth, split=False).parameters()) * 4
    print(f"torch {torch.__version__}, {os.cpu_count()} cores; R={REPLICAS} replicas over gloo, "
          f"G={ACCUMULATION} x B={MICRO_BATCH}; MLP of {depth} x {width}: "
          f"{size / 2**20:.0f} MiB of fp32 gradients; median of {calls} call(s) each after a "
          "warm-up.")
    print(f"{'row':<28}{'call s':>9}{'step ms':>10}{'AR wait ms':>12}{'early':>7}")
    for split in (False, True):
        name = f"R=2 x {2 if split else 1} stage{'s' if split else ''}"
        rows = measure(width, depth, split=split, calls=calls)
        for overlap, row in rows.items():
            print(f"{name + (', overlap' if overlap else ', at the step'):<28}{row.call_s:>9.3f}"
                  f"{row.step_ms:>10.1f}{row.wait_ms:>12.1f}{row.buckets:>7.1f}")
        off, on = rows[False], rows[True]
        print(f"{name + ', ratio':<28}{on.call_s / off.call_s:>9.2f}"
              f"{on.step_ms / off.step_ms:>10.2f}{on.wait_ms / max(off.wait_ms, 1e-9):>12.2f}")


if __name__ == "__main__":
    main()
