"""Peak resident memory of a big pipelined model against plain PyTorch, phase by phase.

    python benchmarks/memory.py                       # GPT-2 shapes 12 and 24 layers, fp32
    python benchmarks/memory.py --layers 12 --width 1024 --dtype float16
    python benchmarks/memory.py --layers 36 --width 1280   # GPT-2 large's shape
    python benchmarks/memory.py --quick               # 4 layers of width 256 (a smoke run)
    python benchmarks/memory.py --layers 24 --apart   # and workers holding their own copies
    python benchmarks/memory.py --plan                # poptorch.plan against every worker's
                                                      # VmHWM and the step (plan_configs.py)
    python benchmarks/memory.py --plan --only gpt2-tied llama   # some of its rows
    python benchmarks/memory.py --sharding            # optimiser state sharded over replicas
    python benchmarks/memory.py --sharding --plan     # and each worker beside the plan

Each setting runs in a fresh interpreter that samples, every 0.1 s, the resident memory
(RSS, and Pss: shared pages counted once over the tree) of itself and of every process below it (the stage workers and the worker pool's
zygote), and keeps the peaks of each phase: wrap, compile, each training call, the copy to
the host (a touch of a weight), optimizer.state_dict(), destroy. The model is GPT-2's shape
(vocabulary 50257, sequence 64, micro-batch 1, AdamW, gradient accumulation 4), split with
BeginBlock on its middle layer over 2 devices; plain PyTorch trains the same model in one
process. Settings alternate (plain, pipetorch, plain, ...) with `--repeats`, and the table
gives medians and the ratio of each pipetorch column to plain PyTorch's whole-tree peak, all
from this one run. On a GPU (PIPETORCH_DEVICE=cuda) the rows also give each device's
torch.cuda.max_memory_allocated against plain PyTorch on one GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SEQUENCE, ACCUMULATION, CALLS, VOCABULARY = 64, 4, 2, 50257
GB = 1e9


def _model(layers: int, width: int, dtype: str, *, meta: bool = False):  # noqa: ANN202
    import torch
    import transformers

    config = transformers.GPT2Config(
        vocab_size=VOCABULARY, n_positions=SEQUENCE, n_embd=width, n_layer=layers,
        n_head=max(1, width // 64), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        use_cache=False)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    return model.to(getattr(torch, dtype))


def _weights_file(layers: int, width: int, dtype: str, kind: str = "initial") -> str:
    folder = os.environ.get("MEMORY_BENCHMARK_FOLDER", "/tmp")
    return os.path.join(folder, f"gpt2-{layers}x{width}-{dtype}-{kind}.safetensors")


def _save_weights(layers: int, width: int, dtype: str) -> None:
    """The plain model's initial weights, for the mapped setting (in a child, untimed)."""
    from safetensors.torch import save_model

    save_model(_model(layers, width, dtype), _weights_file(layers, width, dtype))


def _inputs(call: int):  # noqa: ANN202
    import torch

    ids = torch.randint(0, VOCABULARY, (ACCUMULATION, SEQUENCE),
                        generator=torch.Generator().manual_seed(call))
    return {"input_ids": ids, "labels": ids}


def _cuda_peaks() -> dict[str, int]:
    import torch

    if not torch.cuda.is_available():
        return {}
    return {f"cuda:{d}": torch.cuda.max_memory_allocated(d)
            for d in range(torch.cuda.device_count())}


def _schedule(opts) -> None:  # noqa: ANN001
    """The pipelined schedule the parent asked for (--schedule), through the environment."""
    opts.Training.pipelineSchedule(os.environ.get("MEMORY_BENCHMARK_SCHEDULE", "1f1b"))


def child(setting: str, layers: int, width: int, dtype: str) -> None:
    """One setting in this fresh interpreter; prints its peaks as JSON."""
    sys.path.insert(0, os.path.dirname(HERE))
    from tree_memory import TreeSampler

    with TreeSampler(interval=0.1) as sampler:
        import torch

        sampler.phase("model")
        if setting == "mapped":  # built without weights, mapped from the saved file
            import pipetorch as poptorch

            with poptorch.empty_weights():
                model = _model(layers, width, dtype)
            poptorch.map_weights(model, _weights_file(layers, width, dtype),
                                 output=_weights_file(layers, width, dtype, "trained"))
        else:
            model = _model(layers, width, dtype)
        params = sum(p.numel() for p in model.parameters())
        device = os.environ.get("PIPETORCH_DEVICE", "cpu")
        extra: dict = {}
        if setting == "plain":
            model.to(device)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            for call in range(CALLS):
                sampler.phase(f"call {call + 1}")
                batch = {k: v.to(device) for k, v in _inputs(call).items()}
                for m in range(ACCUMULATION):
                    out = model(**{k: v[m:m + 1] for k, v in batch.items()})
                    (out.loss / ACCUMULATION).backward()
                optimizer.step()
                optimizer.zero_grad()
            sampler.phase("host copy")
            float(next(model.parameters()).sum())
            sampler.phase("optimizer.state_dict()")
            optimizer.state_dict()
            extra["cuda"] = _cuda_peaks()
        else:
            import pipetorch as poptorch

            layer = model.transformer.h
            layer[layers // 2] = poptorch.BeginBlock(layer[layers // 2], ipu_id=1)
            opts = poptorch.Options().showCompilationProgressBar(False)
            opts.Training.gradientAccumulation(ACCUMULATION)
            _schedule(opts)
            if dtype == "float16":
                optimizer = poptorch.optim.AdamW(model.parameters(), lr=1e-4, loss_scaling=128.0)
            else:
                optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            sampler.phase("wrap")
            wrapper = poptorch.trainingModel(model, opts, optimizer)
            sampler.phase("compile")
            wrapper.compile(**_inputs(0))
            extra["seconds"] = []
            for call in range(CALLS):
                sampler.phase(f"call {call + 1}")
                start = time.perf_counter()
                wrapper(**_inputs(call))
                extra["seconds"].append(time.perf_counter() - start)
            sampler.phase("host copy")
            float(next(model.parameters()).sum())
            sampler.phase("optimizer.state_dict()")
            optimizer.state_dict()
            extra["cuda"] = dict(wrapper._compiled.engine.peak_memory)  # stage -> bytes
            sampler.phase("destroy")
            wrapper.destroy()
        sampler.phase("end")
    peaks = sampler.peaks
    print(json.dumps({"params": params, "tree": peaks.tree, "tree_pss": peaks.tree_pss,
                      "root": peaks.root,
                      "processes": {k: list(v.values()) for k, v in peaks.processes.items()},
                      **extra}))


# --sharding: an MLP whose AdamW state dominates, 2 stages x 2 replicas, sharding off and on
MLP_LAYERS, MLP_WIDTH, MLP_ROWS, MLP_CALLS = 8, 4096, 4, 4


def _mlp(layers: int, width: int):  # noqa: ANN202 - torch is imported by the caller
    """The sharding rows' MLP, split with BeginBlock on its middle layer."""
    import torch
    import torch.nn as nn

    import pipetorch as poptorch

    class Mlp(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            # a ModuleList, the layer list poptorch.plan(measure_here=True) times piece by piece
            self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.ReLU())
                                        for _ in range(layers))
            self.layers[layers // 2] = poptorch.BeginBlock(self.layers[layers // 2], ipu_id=1)

        def forward(self, x: torch.Tensor, target: torch.Tensor) -> tuple:
            for layer in self.layers:
                x = layer(x)
            return x, nn.functional.mse_loss(x, target)

    return Mlp()


def sharding_child(setting: str, layers: int, width: int) -> None:
    """One MLP run, its optimiser state sharded over the replicas ("on") or not ("off"):
    prints the whole tree's peaks, each worker's (by stage, replica-major) and each training
    call's seconds (after a warm-up) as JSON."""
    import time

    sys.path.insert(0, os.path.dirname(HERE))
    import torch

    import pipetorch as poptorch
    from tree_memory import TreeSampler

    with TreeSampler(interval=0.1) as sampler:
        sampler.phase("model")
        torch.manual_seed(0)
        model = _mlp(layers, width)
        opts = poptorch.Options().replicationFactor(2).showCompilationProgressBar(False)
        opts.Training.gradientAccumulation(ACCUMULATION)
        opts.TensorLocations.setOptimizerLocation(
            poptorch.TensorLocationSettings().useReplicatedTensorSharding(setting == "on"))
        optimizer = poptorch.optim.AdamW(model.parameters(), lr=1e-4)
        x = torch.randn(2 * ACCUMULATION * MLP_ROWS, width, generator=torch.Generator()
                        .manual_seed(0))
        sampler.phase("wrap")
        wrapper = poptorch.trainingModel(model, opts, optimizer)
        sampler.phase("compile")
        wrapper.compile(x, x)
        pids = wrapper._compiled.engine.worker_pids  # replica-major: stage s of replica r
        seconds = []
        for call in range(MLP_CALLS):
            sampler.phase(f"call {call + 1}")
            start = time.perf_counter()
            wrapper(x, x)
            seconds.append(time.perf_counter() - start)
        sampler.phase("optimizer.state_dict()")
        optimizer.state_dict()
        sampler.phase("destroy")
        wrapper.destroy()
        sampler.phase("end")
    peaks = sampler.peaks
    training = [k for k in peaks.processes if k not in _READING]  # as the plan prices them
    workers = [max(peaks.processes[k].get(pid, 0) for k in training) for pid in pids]
    print(json.dumps({"tree": peaks.tree, "tree_pss": peaks.tree_pss, "seconds": seconds[1:],
                      "root": peaks.root, "workers": workers}))


def _sharding_plan(args: argparse.Namespace, setting: str, runs: list[dict]) -> list[str]:
    """`poptorch.plan`'s predicted step and per-worker peak (each piece measured here) beside
    the quickest call after the first and each stage's measured workers (medians over the
    repeats; both replicas)."""
    import torch

    import pipetorch as poptorch

    layers = args.layers[0] if args.layers else MLP_LAYERS
    with torch.device("meta"):
        model = _mlp(layers, args.width)
    x = torch.zeros(MLP_ROWS, args.width, device="meta")
    found = poptorch.plan(model, ((x, x), {}), devices=4, replicas=2,
                          accumulation=ACCUMULATION, split=[f"layers.{layers // 2}"],
                          sharded=setting == "on", schedule="1f1b", measure_here=True)
    measured = [statistics.median(w) for w in zip(*(r["workers"] for r in runs))]
    quickest = statistics.median(min(r["seconds"]) for r in runs)  # as the GPT-2 rows
    lines = [f"  sharding {setting}, step: predicted {found.step_seconds:.2f} s, measured "
             f"{quickest:.2f} s ({found.step_seconds / quickest - 1:+.0%})"]
    for stage, peak in found.peaks.items():
        mine = measured[stage::2]  # the stage's worker in each replica
        lines.append(f"  sharding {setting}, stage {stage}: predicted {peak / GB:.2f} GB, "
                     f"measured " + ", ".join(f"{m / GB:.2f} GB ({peak / m - 1:+.0%})"
                                              for m in mine))
    return lines


def sharding_report(args: argparse.Namespace) -> None:
    """Sharding off and on, interleaved (off, on, off, on, ...): whole-tree peaks and call
    times, medians over the repeats, and the ratios on / off."""
    rows: dict[str, list[dict]] = {"off": [], "on": []}
    for _ in range(args.repeats):
        for setting in rows:
            command = [sys.executable, __file__, "--sharding-child", setting,
                       "--layers", str(args.layers[0] if args.layers else MLP_LAYERS),
                       "--width", str(args.width)]
            done = subprocess.run(command, env={**os.environ, "PIPETORCH_DEVICE": "cpu"},
                                  capture_output=True, text=True, timeout=3600)
            if done.returncode != 0:
                print(f"sharding {setting}: failed", done.stderr.strip().splitlines()[-3:])
                return
            rows[setting].append(json.loads(done.stdout.strip().splitlines()[-1]))

    def median(setting: str, key: str, reading: bool) -> float:
        return statistics.median(_peak(r[key], reading=reading) for r in rows[setting])

    seconds = {s: statistics.median(t for r in runs for t in r["seconds"])
               for s, runs in rows.items()}
    print(f"\nMLP {args.layers[0] if args.layers else MLP_LAYERS} x "
          f"{args.width}, AdamW, 2 stages x 2 replicas, "
          f"GA {ACCUMULATION}; medians of {args.repeats} (off/on interleaved)")
    print("| useReplicatedTensorSharding | whole tree, RSS | whole tree, Pss | whole tree with "
          "optimizer.state_dict() | training call |")
    print("|---|---|---|---|---|")
    for setting in rows:
        cells = [f"{median(setting, k, reading) / GB:.2f} GB "
                 f"({median(setting, k, reading) / median('off', k, reading):.2f}x)"
                 for k, reading in (("tree", False), ("tree_pss", False), ("tree", True))]
        print(f"| {setting} | " + " | ".join(cells) + f" | {seconds[setting]:.2f} s "
              f"({seconds[setting] / seconds['off']:.2f}x) |")
    if args.plan:
        print("\nplan (1f1b) against measured, per worker (RSS over the training phases):")
        for setting, runs in rows.items():
            print("\n".join(_sharding_plan(args, setting, runs)))


# a row's name -> the child's setting and its environment
_APART = "pipetorch, PIPETORCH_SHARED_WEIGHTS=0"
_CHILDREN = {_APART: ("pipetorch", {"PIPETORCH_SHARED_WEIGHTS": "0"})}


def _run(row: str, args: argparse.Namespace) -> dict:
    setting, extra = _CHILDREN.get(row, (row, {}))
    env = {**os.environ, **extra}
    env.setdefault("PIPETORCH_DEVICE", "cpu")
    command = [sys.executable, __file__, "--child", setting, "--layers", str(args.layers),
               "--width", str(args.width), "--dtype", args.dtype]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        return {"failed": done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]}
    return json.loads(done.stdout.strip().splitlines()[-1]) if setting != "save" else {}


def _workers(found: dict) -> list[int]:
    """Each worker's peak over all phases: the larger processes below the host (the
    zygote, which holds no model, is the smallest)."""
    peaks: dict[int, int] = {}
    for sizes in found["processes"].values():
        for i, size in enumerate(sorted(sizes, reverse=True)):
            peaks[i] = max(peaks.get(i, 0), size)
    return [peaks[i] for i in sorted(peaks)][:2]


# Phases after training: the optimiser's state read on the host (twice the weights for
# Adam, in plain PyTorch as in pipetorch), then destroy().
_READING = ("optimizer.state_dict()", "destroy", "end")


def _peak(sizes: dict[str, int], *, reading: bool) -> int:
    """The peak over the training phases (wrap to the host copy), or over all of them."""
    return max(v for k, v in sizes.items() if reading or k not in _READING)


def _row(name: str, runs: list[dict], plain: dict[str, float]) -> str:
    """One setting's table row: medians over its repeats, ratios to plain PyTorch's."""
    def median(key: str, reading: bool) -> float:
        return statistics.median(_peak(r[key], reading=reading) for r in runs)

    before = statistics.median(r["root"].get("wrap", r["root"]["model"]) for r in runs)
    host = median("root", False)
    workers = [statistics.median(w) for w in zip(*(_workers(r) for r in runs))]
    cells = [f"{median(k, reading) / GB:.2f} GB ({median(k, reading) / plain[k, reading]:.2f}x)"
             for k, reading in (("tree", False), ("tree_pss", False), ("tree", True))]
    return (f"| {name} | " + " | ".join(cells) + f" | {host / GB:.2f} GB "
            f"(+{(host - before) / GB:.2f}) | "
            + (" / ".join(f"{w / GB:.2f} GB ({w / plain['tree', False]:.2f}x)"
                          for w in workers) or "-") + " |")


def report(args: argparse.Namespace) -> None:
    rows: dict[str, list[dict]] = {"plain": [], "pipetorch": []}
    if args.apart:
        rows[_APART] = []
    if args.mapped:
        rows["mapped"] = []
        _run("save", args)
    for _ in range(args.repeats):  # interleaved: plain, pipetorch, plain, ...
        for setting in rows:
            rows[setting].append(_run(setting, args))
    failed = {s: r[0]["failed"] for s, r in rows.items() if "failed" in r[0]}
    shape = f"GPT-2 shape, {args.layers} layers, width {args.width}, {args.dtype}"
    if failed:
        print(f"{shape}: failed {failed}")
        return
    plain = {(k, reading): statistics.median(_peak(r[k], reading=reading)
                                             for r in rows["plain"])
             for k in ("tree", "tree_pss") for reading in (False, True)}
    params = rows["plain"][0]["params"]
    print(f"\n{shape} ({params / 1e6:.0f}M params), AdamW, GA {ACCUMULATION}, "
          f"{CALLS} calls and a copy to the host; medians of {args.repeats}")
    print("| setting | whole tree, RSS (x plain) | whole tree, Pss (x plain) | whole tree with "
          "optimizer.state_dict() (x plain) | host (+ above its size before wrapping) | "
          "each worker (x plain) |")
    print("|---|---|---|---|---|---|")
    for name, runs in rows.items():
        print(_row(name, runs, plain))
    for name, runs in rows.items():
        if name == "plain":
            continue
        print(f"\nPhase by phase ({name}, first repeat), GB: whole tree RSS / Pss, host, "
              "largest worker")
        first = runs[0]
        for phase, size in first["tree"].items():
            worker = max(first["processes"].get(phase, [0]) or [0])
            print(f"  {phase:24s} {size / GB:6.2f} {first['tree_pss'][phase] / GB:6.2f} "
                  f"{first['root'][phase] / GB:6.2f} {worker / GB:6.2f}")
    if rows["plain"][0].get("cuda"):
        print("\nmax_memory_allocated: plain", rows["plain"][0]["cuda"], "pipetorch per stage",
              rows["pipetorch"][0]["cuda"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", choices=("plain", "pipetorch", "mapped", "save"))
    parser.add_argument("--sharding", action="store_true",
                        help="an MLP (8 x 4096, AdamW, 2 stages x 2 replicas) with its optimiser "
                             "state sharded over the replicas and not")
    parser.add_argument("--sharding-child", choices=("off", "on"))
    parser.add_argument("--layers", type=int, action="append")
    parser.add_argument("--width", type=int, default=None, help="1024; 4096 with --sharding")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16"))
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="4 layers of width 256")
    parser.add_argument("--apart", action="store_true",
                        help="also each CPU worker with its own copy of its weights "
                             "(PIPETORCH_SHARED_WEIGHTS=0)")
    parser.add_argument("--mapped", action="store_true",
                        help="also a model built without weights, mapped from a file "
                             "(poptorch.map_weights), trained weights written to a file")
    parser.add_argument("--schedule", default="1f1b", choices=("1f1b", "zero_bubble", "both"))
    parser.add_argument("--plan", action="store_true",
                        help="poptorch.plan's predicted peak of each worker and step beside "
                             "the measured, on plan_configs.py's configurations (with "
                             "--sharding: the MLP's)")
    parser.add_argument("--only", nargs="*", help="--plan: the configurations to run")
    parser.add_argument("--json", help="--plan: also write the rows as JSON to this file")
    args = parser.parse_args()
    schedules = ("1f1b", "zero_bubble") if args.schedule == "both" else (args.schedule,)
    os.environ["MEMORY_BENCHMARK_SCHEDULE"] = schedules[0]
    if args.width is None:
        args.width = MLP_WIDTH if args.sharding or args.sharding_child else 1024
    if args.child == "save":
        _save_weights(args.layers[0], args.width, args.dtype)
        return
    if args.child:
        child(args.child, args.layers[0], args.width, args.dtype)
        return
    if args.sharding_child:
        sharding_child(args.sharding_child, args.layers[0], args.width)
        return
    if args.sharding:
        sharding_report(args)
        return
    if args.plan:
        import plan_configs

        print(plan_configs.report(args.only, args.json))
        return
    if args.quick:
        args.layers, args.width = [4], 256
    for layers in args.layers or [12, 24]:
        for schedule in schedules:
            os.environ["MEMORY_BENCHMARK_SCHEDULE"] = schedule
            report(argparse.Namespace(**{**vars(args), "layers": layers, "schedule": schedule}))


if __name__ == "__main__":
    main()
