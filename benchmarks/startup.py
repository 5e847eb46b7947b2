"""Start-up: seconds from trainingModel(...) to the first result, pool of warm workers on/off.

    python benchmarks/startup.py            # 5 interleaved repeats of each setting
    python benchmarks/startup.py --quick    # 2 repeats

The 2-device seed CNN (benchmarks/pipeline.py's seed 000 network, blocks B1+B2 | B3+B4,
D=1, G=10): each repeat runs a fresh interpreter that builds a first wrapper, calls it once,
destroys it, then does the same with a second wrapper, timing each from trainingModel(...) to
the first call's return (the model and its optimiser are made before), and counting how many
times forward ran in the host process before that result (the probe and the capture on a
miss, none from the executable cache; the training steps themselves run in the workers).
Settings alternate (pool, pool started at import, fresh, cached, cached and ready, pool, ...)
so a change in the machine's load hits all alike; the table gives the median and the range of each. The cached settings (zygote at import) read
POPTORCH_CACHE_DIR from a temporary directory that one untimed run filled first, so every
timed run is a cache hit; "zygote ready" waits, before the clock starts, until the zygote has
imported torch, as a script that loads its data first would.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
READY_ENV = "STARTUP_BENCHMARK_ZYGOTE_READY"


def one_run() -> None:
    """In a fresh interpreter: two wrappers one after the other; print their seconds and the
    forward runs of this process before each first result (JSON)."""
    start = time.perf_counter()
    import torch

    sys.path.insert(0, HERE)
    import pipetorch as poptorch
    from pipeline import ACCUMULATION, MICRO_BATCH, WithLoss, Widths, new_network

    imported = time.perf_counter() - start
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(ACCUMULATION * MICRO_BATCH, 1, 28, 28, generator=generator)
    labels = torch.randint(0, 10, (ACCUMULATION * MICRO_BATCH,), generator=generator)
    seconds, forwards = [], []
    for _ in range(2):
        # The user's own model and optimiser are made before the clock starts: the first
        # torch.optim optimiser imports torch._dynamo (~1.8 s here), with or without pipetorch.
        model = WithLoss(new_network(Widths(28)))
        runs: list[int] = []
        model.register_forward_pre_hook(lambda *_: runs.append(1))  # this process's runs
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        opts = poptorch.Options().showCompilationProgressBar(False)
        opts.Training.gradientAccumulation(ACCUMULATION)
        opts.setExecutionStrategy(poptorch.PipelinedExecution(
            poptorch.Stage("B1", "B2"), poptorch.Stage("B3", "B4")))
        if os.environ.get(READY_ENV):  # as a script that loaded its data meanwhile
            from pipetorch.parallel.host import pool

            pool.zygote().thread_count(timeout=120)  # answers once it has imported torch
        begin = time.perf_counter()
        wrapper = poptorch.trainingModel(model, opts, optimizer)
        wrapper(images, labels)
        seconds.append(time.perf_counter() - begin)
        forwards.append(len(runs))  # the steps run in the workers: these are compiling's
        wrapper.destroy()
    print(json.dumps({"import": imported, "first": seconds[0], "second": seconds[1],
                      "forwards": forwards}))


def run(setting: str, cache: str) -> dict[str, float]:
    """One fresh interpreter's seconds under `setting` (a PIPETORCH_WORKER_POOL value or
    "cached": the pool started at import, with POPTORCH_CACHE_DIR=`cache`)."""
    env = dict(os.environ, PIPETORCH_DEVICE="cpu")
    env.pop("POPTORCH_CACHE_DIR", None)
    # Python's own bytecode cache on, as on a user's machine (this one sets
    # PYTHONDONTWRITEBYTECODE, which makes every import compile its source again).
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PIPETORCH_WORKER_POOL"] = "early" if setting in ("cached", "ready") else setting
    if setting in ("cached", "ready"):
        env["POPTORCH_CACHE_DIR"] = cache
    if setting == "ready":
        env[READY_ENV] = "1"
    out = subprocess.run([sys.executable, __file__, "--one"], env=env, capture_output=True,
                         text=True, timeout=600)
    if out.returncode:
        raise SystemExit(f"the run with setting {setting!r} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="2 repeats")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        return one_run()
    repeats = 2 if args.quick else args.repeats
    results: dict[str, list[dict[str, float]]] = {"1": [], "early": [], "0": [], "cached": [],
                                                 "ready": []}
    with tempfile.TemporaryDirectory(prefix="pipetorch-startup-cache-") as cache:
        run("cached", cache)  # untimed: fills the cache
        if not os.listdir(cache):
            raise SystemExit(f"the executable cache in {cache} is empty after a first run")
        for _ in range(repeats):
            for setting in results:  # interleaved: 1, early, 0, cached, 1, early, ...
                results[setting].append(run(setting, cache))
    print(f"2-device seed CNN, trainingModel(...) to the first result, {repeats} repeats "
          "(median [min-max] s)")
    print(f"{'workers':<28} {'import':>18} {'first wrapper':>18} {'second wrapper':>18} "
          f"{'forward runs':>18}")
    for pool, name in (("1", "pool, zygote at 1st wrapper"),
                       ("early", "pool, zygote at import"), ("0", "fresh processes"),
                       ("cached", "zygote at import + cache"),
                       ("ready", "zygote ready + cache")):
        cells = []
        for key in ("import", "first", "second"):
            values = [r[key] for r in results[pool]]
            cells.append(f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]")
        runs = sorted({tuple(r["forwards"]) for r in results[pool]})
        cells.append(" or ".join("/".join(map(str, r)) for r in runs))
        print(f"{name:<28} " + " ".join(f"{c:>18}" for c in cells))


if __name__ == "__main__":
    main()
