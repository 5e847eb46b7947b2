"""Does `pipetorch plan --search` rank layouts as they run? For each model shape, the search on
1 machine x 2 devices (`poptorch.plan(..., devices=2, search=True, measure_here=True)`), then
its top 3 layouts each trained for real from the lines the search prints for it
(`Search.code(rank)`), in interleaved rounds (1, 2, 3, 1, 2, 3, ...).

    python benchmarks/search_check.py                   # gpt2-24, gpt2-tied, bert; 2 rounds
    python benchmarks/search_check.py --only gpt2-tied --rounds 1 --calls 2
    python benchmarks/search_check.py --quick       # a 2-layer GPT-2 of width 64: a smoke run

Each run is a fresh interpreter (`--child`) that builds the model (transformers' classes,
random weights and tokens: nothing is downloaded), runs the printed Options and BeginBlock
lines on it, and times `--calls` training calls (one optimiser step each); a run's step is the
median of its calls after the first (which creates the optimiser state), a layout's the
median over the rounds. Printed: predicted against measured order, and the top pick's
measured step over the fastest measured of the three (issue 53's target: at most 1.15).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plan_configs import Config, inputs, model, timed_calls  # noqa: E402

ACCUMULATION = 8  # micro-batches of a step, over the replicas
SHAPES = (
    # the memory benchmark's 24-layer GPT-2 (width 1024, GPT-2's vocabulary, sequence 64)
    Config("gpt2-24", "gpt2", (), layers=24, width=1024, vocab=50257, batch=1, sequence=64),
    Config("gpt2-tied", "gpt2", ()),  # 4 layers of width 512, vocabulary 32768, tied
    Config("bert", "bert", (), vocab=32000),  # BertForMaskedLM, 4 layers of width 512
)
QUICK = Config("tiny", "gpt2", (), layers=2, width=64, vocab=512, sequence=16)


def _shape(name: str) -> Config:
    found = [c for c in (*SHAPES, QUICK) if c.name == name]
    if not found:
        raise SystemExit(f"no shape {name!r}; there are {[c.name for c in SHAPES]}")
    return found[0]


def search(config: Config) -> Any:
    import torch

    import pipetorch as poptorch

    with torch.device("meta"):
        meta = model(config)
    return poptorch.plan(meta, ((), inputs(config, config.batch, meta=True)), devices=2,
                         accumulation=ACCUMULATION, measure_here=True, search=True)


def child(name: str, code: list[str], samples: int, calls: int) -> dict[str, Any]:
    """One run of a layout: its lines on a fresh model, `calls` timed training calls."""
    import torch

    import pipetorch as poptorch

    config = _shape(name)
    built = model(config)
    scope: dict[str, Any] = {"model": built, "poptorch": poptorch}
    exec("\n".join(code), scope)  # the lines the search printed for this layout
    opts = scope["opts"].showCompilationProgressBar(False)
    wrapper = poptorch.trainingModel(built, opts, torch.optim.AdamW(built.parameters(), lr=1e-4))
    try:
        return {"seconds": timed_calls(wrapper, config, samples, calls)}
    finally:
        wrapper.destroy()


def _run(name: str, code: list[str], samples: int, calls: int) -> float:
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", name,
                           "--samples", str(samples), "--calls", str(calls),
                           "--code", json.dumps(code)],
                          capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise RuntimeError(f"{name}: the layout's run failed:\n{done.stderr[-3000:]}")
    seconds = json.loads(done.stdout.strip().splitlines()[-1])["seconds"]
    return statistics.median(seconds[1:] or seconds)


def check(config: Config, rounds: int, calls: int) -> list[str]:
    """The search's top 3 layouts of `config` measured: the lines of its report."""
    found = search(config)
    top = found.fitting[:3]
    lines = [f"\n{config.name}: {len(found.fitting)} layouts fit, {len(found.refused)} do not; "
             f"the top {len(top)} measured in {rounds} interleaved round(s)"]
    if not top:
        return lines + ["  no layout fits"]
    codes = [found.code(rank) for rank in range(1, len(top) + 1)]
    samples = [config.batch * c.layout.accumulation * c.layout.replicas for c in top]
    measured: list[list[float]] = [[] for _ in top]
    for _ in range(rounds):
        for k, code in enumerate(codes):
            measured[k].append(_run(config.name, code, samples[k], calls))
    steps = [statistics.median(m) for m in measured]
    for rank, (considered, step) in enumerate(zip(top, steps, strict=True), 1):
        assert considered.plan is not None and considered.plan.step_seconds is not None
        predicted = considered.plan.step_seconds
        lines.append(f"  {rank}. {considered.layout.describe()}: predicted {predicted:.2f} s, "
                     f"measured {step:.2f} s ({predicted / step - 1:+.0%}; rounds "
                     + ", ".join(f"{s:.2f}" for s in measured[rank - 1]) + ")")
    order = sorted(range(len(steps)), key=steps.__getitem__)
    lines.append("  measured order (by predicted rank): "
                 + " < ".join(str(k + 1) for k in order)
                 + f"; top pick / fastest measured: {steps[0] / min(steps):.3f} (target <= 1.15)")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=[c.name for c in SHAPES])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--calls", type=int, default=3,
                        help="training calls a run times; its step: the median after the first")
    parser.add_argument("--quick", action="store_true",
                        help="a 2-layer GPT-2 of width 64, 1 round of 2 calls (a smoke run)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--code", help=argparse.SUPPRESS)
    parser.add_argument("--samples", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, json.loads(args.code), args.samples, args.calls)))
        return
    print(f"{os.cpu_count()} cores; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"load {os.getloadavg()[0]:.1f}")
    if args.quick:
        args.only, args.rounds, args.calls = [QUICK.name], 1, 2
    for name in args.only or [c.name for c in SHAPES]:
        print("\n".join(check(_shape(name), args.rounds, args.calls)), flush=True)
    print(f"done {time.strftime('%H:%M UTC', time.gmtime())}, load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
