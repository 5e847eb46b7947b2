"""pipetorch against plain PyTorch on the same GPU: overhead, stages sharing a GPU, loaders, memory.

Rows (images/s: the median over timed host calls, after compile and one warm-up call; each
call ends with the device synchronised):

    overhead  seed 000's CNN (28x28, micro-batches of 40, G=10, D=10, AdamW) in plain PyTorch
              on the device (the same accumulation loop, the call's batch copied in first) and
              in pipetorch on one device (the in-process engine); the ratio is the overhead
    one GPU   the same CNN pipelined over 2 stages that share the device (2 worker processes,
              bundles through host memory with gloo), and the same 2 stages run one after
              another in this process (PIPETORCH_EXECUTION=local)
    loader    items/s of torch's DataLoader (pin_memory on a GPU) and pipetorch's Sync and
              Async DataLoader, every batch copied to the device
    memory    the compile-time estimate of the fuller device against the CUDA allocator's
              measured peak (memory.json), for the CNN and a small ResNet; and that peak
              again with the optimiser state offloaded, beside the state's size

    python benchmarks/gpu.py                        # on the first GPU
    python benchmarks/gpu.py --quick --device cpu   # a smoke test without a GPU
    python benchmarks/gpu.py --json rows.json       # the rows as JSON too (scripts/gpu-check.sh)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import pipetorch as poptorch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "examples"))
import multi_device  # noqa: E402  (examples/ is not a package)
import pipeline  # noqa: E402  (seed 000's CNN, split into blocks B1..B4)
from bench_timing import time_calls  # noqa: E402

MICRO_BATCH = 40


@dataclass(frozen=True)
class Row:
    group: str
    name: str
    value: float | None
    unit: str
    note: str = ""


@dataclass(frozen=True)
class Config:
    device: torch.device
    accumulation: int
    iterations: int
    calls: int

    @property
    def images(self) -> int:
        return self.iterations * self.accumulation * MICRO_BATCH


def device_settings(device: torch.device) -> dict[str, str]:
    """The PIPETORCH_* variables of a run on `device`. On a GPU, PIPETORCH_NUM_DEVICES=1: the
    "one GPU" rows share that GPU between their stages' workers; without it, a machine with
    2+ GPUs puts them on two GPUs over NCCL, and the rows' labels and ratios are wrong."""
    settings = {"PIPETORCH_DEVICE": str(device)}
    if device.type == "cuda":
        settings["PIPETORCH_NUM_DEVICES"] = "1"
    return settings


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({torch.get_num_threads()} threads)"


def median_rate(call: Callable[[], object], config: Config, items: int) -> float:
    def synchronised() -> None:
        call()
        synchronize(config.device)
    return items / statistics.median(time_calls(synchronised, config.calls))


def cnn() -> nn.Module:
    return pipeline.WithLoss(pipeline.new_network(pipeline.Widths(28)))


def cnn_data(config: Config) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(config.images, 1, 28, 28, generator=generator),
            torch.randint(0, 10, (config.images,), generator=generator))


def options(config: Config, strategy: Any = None) -> poptorch.Options:
    opts = poptorch.Options().deviceIterations(config.iterations)
    opts.Training.gradientAccumulation(config.accumulation)
    opts.showCompilationProgressBar(False)
    if strategy is not None:
        opts.setExecutionStrategy(strategy)
    return opts


def one_stage() -> Any:
    return poptorch.ShardedExecution(poptorch.Stage(*pipeline.BLOCKS).ipu(0))


def two_stages() -> Any:
    return poptorch.PipelinedExecution(poptorch.Stage("B1", "B2").ipu(0),
                                       poptorch.Stage("B3", "B4").ipu(1))


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=pipeline.LEARNING_RATE)


# -- throughput ------------------------------------------------------------------------------
def plain_rate(config: Config, data: tuple[torch.Tensor, torch.Tensor]) -> float:
    model = cnn().to(config.device)
    optimizer = adamw(model)
    step = config.accumulation * MICRO_BATCH

    def call() -> None:
        images, labels = (t.to(config.device, non_blocking=True) for t in data)
        for d in range(config.iterations):
            optimizer.zero_grad(set_to_none=True)
            for g in range(d * step, (d + 1) * step, MICRO_BATCH):
                _, loss = model(images[g:g + MICRO_BATCH], labels[g:g + MICRO_BATCH])
                (loss / config.accumulation).backward()
            optimizer.step()

    return median_rate(call, config, config.images)


def pipetorch_rate(config: Config, data: tuple[torch.Tensor, torch.Tensor], strategy: Any, *,
                   execution: str = "auto") -> float:
    os.environ["PIPETORCH_EXECUTION"] = execution
    try:
        model = cnn()
        training = poptorch.trainingModel(model, options(config, strategy), adamw(model))
        try:
            return median_rate(lambda: training(*data), config, config.images)
        finally:
            training.destroy()
    finally:
        os.environ.pop("PIPETORCH_EXECUTION")


def throughput_rows(config: Config) -> list[Row]:
    data = cnn_data(config)
    plain = plain_rate(config, data)
    one = pipetorch_rate(config, data, one_stage())
    pipelined = pipetorch_rate(config, data, two_stages())
    local = pipetorch_rate(config, data, two_stages(), execution="local")
    return [
        Row("overhead", "plain PyTorch, one device", plain, "images/s"),
        Row("overhead", "pipetorch, 1 device", one, "images/s"),
        Row("overhead", "pipetorch 1 device / plain PyTorch", one / plain, "ratio",
            "target >= 0.97"),
        Row("one GPU", "pipetorch, 2 stages in 2 workers sharing the device", pipelined,
            "images/s"),
        Row("one GPU", "pipetorch, 2 stages in this process (PIPETORCH_EXECUTION=local)", local,
            "images/s"),
        Row("one GPU", "2 workers / in this process", pipelined / local, "ratio"),
    ]


# -- data loading ----------------------------------------------------------------------------
def loader_rows(config: Config) -> list[Row]:
    batch, iterations = 64, 8
    items = batch * iterations * (4 if config.calls < 3 else 40)
    generator = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(items, 3, 32, 32, generator=generator),
                            torch.randint(0, 10, (items,), generator=generator))
    pin = config.device.type == "cuda"
    opts = poptorch.Options().deviceIterations(iterations)
    loaders: dict[str, Any] = {
        f"torch DataLoader (pin_memory={pin})": DataLoader(
            dataset, batch_size=batch * iterations, pin_memory=pin),
        "pipetorch DataLoader, Sync": poptorch.DataLoader(opts, dataset, batch_size=batch),
        "pipetorch DataLoader, Async": poptorch.DataLoader(
            opts, dataset, batch_size=batch, mode=poptorch.DataLoaderMode.Async),
    }
    rows = []
    for name, loader in loaders.items():
        def epoch(loader: Any = loader) -> None:
            for images, labels in loader:
                images.to(config.device, non_blocking=True)
                labels.to(config.device, non_blocking=True)
                if config.device.type == "cuda" and hasattr(loader, "release_after"):
                    # the Async loader's slot is pinned and the copies may still read it:
                    # it is refilled only once they are done
                    copied = torch.cuda.Event()
                    copied.record()
                    loader.release_after(copied)
        rows.append(Row("loader", name, median_rate(epoch, config, items), "items/s"))
        if hasattr(loader, "terminate"):
            loader.terminate()
    return rows


# -- memory ----------------------------------------------------------------------------------
def resnet() -> nn.Module:
    torch.manual_seed(0)
    model, _ = multi_device.build_model("small", "batch", 16)
    return multi_device.ClassifierWithLoss(model)


def resnet_data(config: Config) -> tuple[torch.Tensor, torch.Tensor]:
    dataset = multi_device.generated_images(config.images, 32, seed=0)
    return dataset.tensors[0], dataset.tensors[1]


def estimate(build: Callable[[], nn.Module], opts: poptorch.Options, data: tuple) -> int:
    """The compile-time estimate of the fuller device (read from the refusal under 1 byte)."""
    model = build()
    training = poptorch.trainingModel(model, opts.setMemoryBudget(1), adamw(model))
    try:
        training.compile(*data)
    except poptorch.errors.OutOfMemoryError as error:
        return max(device.total for device in error.estimate.devices.values())
    finally:
        training.destroy()
    raise AssertionError("every configuration is over a 1-byte budget")


def measured(build: Callable[[], nn.Module], opts: poptorch.Options,
             data: tuple) -> dict[str, Any]:
    """memory.json's row of the fuller device after one profiled call."""
    with tempfile.TemporaryDirectory() as folder:
        model = build()
        training = poptorch.trainingModel(model, opts.enableProfiling(folder), adamw(model))
        training(*data)
        training.destroy()  # writes the report
        report = json.loads((Path(folder) / "training" / "memory.json").read_text())
    return max(report["devices"], key=lambda d: d["measured_peak"] or d["total"])


def memory_rows(config: Config) -> list[Row]:
    rows = []
    for name, build, data, strategy in (
            ("seed CNN", cnn, cnn_data(config), one_stage()),
            ("small ResNet", resnet, resnet_data(config), None)):
        guess = estimate(build, options(config, strategy), data)
        on_device = measured(build, options(config, strategy), data)
        peak = on_device["measured_peak"]
        rows += [Row("memory", f"{name}: compile-time estimate", guess, "bytes"),
                 Row("memory", f"{name}: measured peak", peak, "bytes",
                     "" if peak else "no CUDA allocator on this device"),
                 Row("memory", f"{name}: estimate / measured", guess / peak if peak else None,
                     "ratio", "target within 15% (0.85 .. 1.15)")]
        offloaded = options(config, strategy)
        offloaded.TensorLocations.setOptimizerLocation(
            poptorch.TensorLocationSettings().useOnChipStorage(False))
        off = measured(build, offloaded, data)
        saved = peak - off["measured_peak"] if peak and off["measured_peak"] else None
        rows += [Row("memory", f"{name}: measured peak, optimiser state offloaded",
                     off["measured_peak"], "bytes"),
                 Row("memory", f"{name}: peak saved by offload / optimiser state",
                     saved / off["host_optimiser_state"] if saved is not None else None,
                     "ratio", "target >= 1")]
    return rows


# -- report ----------------------------------------------------------------------------------
def show(row: Row) -> str:
    if row.value is None:
        value = "n/a"
    elif row.unit == "ratio":
        value = f"{row.value:.3f}"
    elif row.unit == "bytes":
        value = f"{row.value / 2**20:.1f} MiB"
    else:
        value = f"{row.value:,.0f} {row.unit}"
    return f"  {row.name:<66} {value:>16}" + (f"  ({row.note})" if row.note else "")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    parser.add_argument("--quick", action="store_true", help="small batches, 2 timed calls")
    parser.add_argument("--json", type=Path, help="also write the rows to this file")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU here: run with --device cpu for a smoke test")
    os.environ.update(device_settings(device))
    config = (Config(device, accumulation=3, iterations=2, calls=2) if args.quick else
              Config(device, accumulation=10, iterations=10, calls=10))
    name = device_name(device)
    print(f"pipetorch on {name}, torch {torch.__version__}: micro-batch {MICRO_BATCH}, "
          f"G{config.accumulation} D{config.iterations}, {config.calls} timed calls")
    rows: list[Row] = []
    for title, make in (("throughput", throughput_rows), ("data loading", loader_rows),
                        ("memory", memory_rows)):
        print(f"\n== {title}")
        made = make(config)
        for row in made:
            print(show(row))
        rows += made
    if args.json:
        args.json.write_text(json.dumps({"device": name, "torch": torch.__version__,
                                         "quick": args.quick,
                                         "rows": [asdict(r) for r in rows]}, indent=1))


if __name__ == "__main__":
    main()
