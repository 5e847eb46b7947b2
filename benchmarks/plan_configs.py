"""The configurations `memory.py --plan` checks `poptorch.plan` against: each one trained by
pipetorch on this machine, each worker's VmHWM beside its predicted peak, and the step.

    python benchmarks/plan_configs.py                  # every row, the table
    python benchmarks/plan_configs.py --only gpt2-tied llama

Each row runs in a fresh interpreter (`--child NAME`): it builds the model (transformers'
classes, random weights and random tokens: nothing is downloaded), marks the split with
BeginBlock, trains 3 calls with the row's Options (the first call's optimiser step creates
the optimiser state), reads each worker's VmHWM (/proc/PID/status) before destroy(), then plans
the same run on the meta device with `measure_here=True` (the pieces timed on this CPU, a
worker interpreter's memory measured). The step measured is the quickest call after the
first, as the plan times each piece by the least of its rounds.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

MIB = 2**20
CALLS = 3


@dataclass(frozen=True)
class Config:
    """One row: the model (`family` and its shape), the split (BeginBlock names and their
    ipu ids) and the Options the run and the plan share."""

    name: str
    family: str                      # gpt2, llama, bert, t5
    split: tuple[str, ...]           # where stages 1.. begin
    ipus: tuple[int, ...] = (1,)     # the device of each split's stage
    schedule: str = "1f1b"
    layers: int = 4
    width: int = 512
    vocab: int = 32768
    batch: int = 4                   # samples per micro-batch
    sequence: int = 128
    accumulation: int = 4
    recompute: bool = False
    offload: bool = False
    replicas: int = 1
    sharded: bool = False
    extra: dict[str, int] = field(default_factory=dict)  # the family's config keywords

    @property
    def devices(self) -> int:
        return (max(self.ipus) + 1) * self.replicas


CONFIGS = (
    Config("gpt2-tied", "gpt2", ("transformer.h.2",)),
    Config("llama", "llama", ("model.layers.2",), vocab=32000,
           extra={"num_attention_heads": 8, "num_key_value_heads": 2,
                  "intermediate_size": 1408}),
    Config("bert", "bert", ("bert.encoder.layer.2",), vocab=32000),
    Config("t5", "t5", ("decoder.block.1",), layers=3, vocab=32000),
    Config("uneven", "gpt2", ("transformer.h.1",), layers=6),
    Config("recompute", "gpt2", ("transformer.h.2",), recompute=True),
    Config("offload", "gpt2", ("transformer.h.2",), offload=True),
    Config("sharded-2-replicas", "gpt2", ("transformer.h.2",), replicas=2, sharded=True,
           batch=2),
    Config("zero-bubble", "gpt2", ("transformer.h.2",), schedule="zero_bubble"),
    Config("interleaved", "gpt2", ("transformer.h.2", "transformer.h.4", "transformer.h.6"),
           ipus=(1, 0, 1), layers=8, schedule="interleaved", accumulation=8),
)


def by_name(name: str) -> Config:
    found = [c for c in CONFIGS if c.name == name]
    if not found:
        raise ValueError(f"no configuration {name!r}; there are {[c.name for c in CONFIGS]}")
    return found[0]


def model(config: Config) -> Any:
    """The row's transformers model (random weights, dropout off)."""
    import torch
    import transformers

    torch.manual_seed(0)
    shape = {"vocab_size": config.vocab}
    if config.family == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_positions=config.sequence, n_embd=config.width, n_layer=config.layers,
            n_head=config.width // 64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            use_cache=False, tie_word_embeddings=True, **shape, **config.extra))
    if config.family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=config.width, num_hidden_layers=config.layers,
            max_position_embeddings=config.sequence, use_cache=False, **shape, **config.extra))
    if config.family == "bert":
        return transformers.BertForMaskedLM(transformers.BertConfig(
            hidden_size=config.width, num_hidden_layers=config.layers,
            num_attention_heads=config.width // 64, intermediate_size=4 * config.width,
            max_position_embeddings=config.sequence, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, **shape, **config.extra))
    if config.family == "t5":
        return transformers.T5ForConditionalGeneration(transformers.T5Config(
            d_model=config.width, d_kv=64, d_ff=4 * config.width, num_layers=config.layers,
            num_heads=config.width // 64, dropout_rate=0.0, use_cache=False,
            **shape, **config.extra))
    raise ValueError(f"unknown family {config.family!r}")


def inputs(config: Config, samples: int, seed: int = 0, *, meta: bool = False
           ) -> dict[str, Any]:
    """`samples` rows of random tokens as the family's keyword inputs (labels included)."""
    import torch

    shape = (samples, config.sequence)
    if meta:
        ids = torch.zeros(shape, dtype=torch.long, device="meta")
    else:
        ids = torch.randint(0, config.vocab, shape, generator=torch.Generator().manual_seed(seed))
    found = {"input_ids": ids, "labels": ids}
    if config.family == "t5":
        found["decoder_input_ids"] = ids
    return found


def _begin_blocks(module: Any, config: Config) -> None:
    import pipetorch as poptorch

    for name, ipu in zip(config.split, config.ipus, strict=True):
        parent, _, child = name.rpartition(".")
        holder = module.get_submodule(parent)
        holder[int(child)] = poptorch.BeginBlock(holder[int(child)], ipu_id=ipu)


def _options(config: Config) -> Any:
    import pipetorch as poptorch

    opts = poptorch.Options().showCompilationProgressBar(False)
    opts.replicationFactor(config.replicas)
    opts.Training.gradientAccumulation(config.accumulation)
    opts.Training.pipelineSchedule(config.schedule)
    opts.Training.setRecomputation(config.recompute)
    location = poptorch.TensorLocationSettings()
    if config.offload:
        location.useOnChipStorage(False)
    if config.sharded:
        location.useReplicatedTensorSharding(True)
    opts.TensorLocations.setOptimizerLocation(location)
    return opts


def timed_calls(wrapper: Any, config: Config, samples: int, calls: int) -> list[float]:
    """The seconds of each of `calls` training calls of `wrapper`, each on `samples` fresh rows
    of the row's random tokens."""
    seconds = []
    for call in range(calls):
        start = time.perf_counter()
        wrapper(**inputs(config, samples, call))
        seconds.append(time.perf_counter() - start)
    return seconds


def train(config: Config) -> dict[str, Any]:
    """Each worker's VmHWM (replica-major: device d of replica r at r * devices + d) and
    each call's seconds, from `CALLS` training calls of the row."""
    import torch

    import pipetorch as poptorch
    from pipetorch.parallel.comm.resident import peak_rss

    built = model(config)
    _begin_blocks(built, config)
    optimizer = torch.optim.AdamW(built.parameters(), lr=1e-4)
    wrapper = poptorch.trainingModel(built, _options(config), optimizer)
    samples = config.batch * config.accumulation * config.replicas
    try:
        seconds = timed_calls(wrapper, config, samples, CALLS)
        pids = wrapper._compiled.engine.worker_pids
        peaks = [peak_rss(pid) or 0 for pid in pids]
    finally:
        wrapper.destroy()
    return {"workers": peaks, "seconds": seconds,
            "params": sum(p.numel() for p in built.parameters())}


def plan(config: Config) -> dict[str, Any]:
    """The plan of the row's run: each device's peak and the model's bytes in it (all but
    the worker process's own), the step."""
    import torch

    import pipetorch as poptorch
    from pipetorch.planning.plan import Plan

    with torch.device("meta"):
        meta = model(config)
    found = poptorch.plan(meta, ((), inputs(config, config.batch, meta=True)),
                          devices=config.devices, replicas=config.replicas,
                          accumulation=config.accumulation, recompute=config.recompute,
                          offload=config.offload, sharded=config.sharded,
                          schedule=config.schedule, split=list(config.split), measure_here=True)
    assert isinstance(found, Plan)
    return {"peaks": {str(k): v for k, v in found.peaks.items()},
            "model": {str(k): v - found.overhead for k, v in found.peaks.items()},
            "step": found.step_seconds, "table": found.table()}


def child(fields: str) -> None:
    """One row (its Config's fields as JSON) in this fresh interpreter: prints its run and
    its plan as JSON."""
    given = json.loads(fields)
    config = Config(**{**given, "split": tuple(given["split"]), "ipus": tuple(given["ipus"])})
    found: dict[str, Any] = {"config": asdict(config), **train(config)}
    try:
        found["plan"] = plan(config)
    except (ValueError, NotImplementedError) as error:  # a schedule the planner lacks
        found["skipped"] = f"{type(error).__name__}: {error}"
    print(json.dumps(found))


def run(config: Config, timeout: float = 900) -> dict[str, Any]:
    """One row, in a fresh interpreter on the CPU."""
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child",
                           json.dumps(asdict(config))],
                          env={**os.environ, "PIPETORCH_DEVICE": "cpu"}, capture_output=True,
                          text=True, timeout=timeout)
    if done.returncode != 0:
        return {"config": asdict(config),
                "failed": (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _device(row: dict[str, Any], worker: int) -> str:
    """The plan's device (its peaks' key) of worker `worker` (replica-major)."""
    devices = len(row["workers"]) // row["config"]["replicas"]
    return str(worker % devices)


def lines(row: dict[str, Any]) -> list[str]:
    """The row's markdown lines: one per worker (predicted / measured peak, the error, the
    model's own bytes as a share of the measured peak), the step on the first."""
    name = row["config"]["name"]
    if "failed" in row:
        return [f"| {name} | failed: {row['failed']} | | | |"]
    if "skipped" in row:
        measured = " / ".join(f"{w / MIB:.0f}" for w in row["workers"])
        return [f"| {name} | measured {measured} MiB; not planned ({row['skipped']}) | | | |"]
    step = min(row["seconds"][1:])
    out = []
    for worker, real in enumerate(row["workers"]):
        device = _device(row, worker)
        peak, own = row["plan"]["peaks"][device], row["plan"]["model"][device]
        cells = [f"{name} w{worker}" if worker else name,
                 f"{peak / MIB:.0f} / {real / MIB:.0f} MiB", f"{peak / real - 1:+.1%}",
                 f"{own / real:.0%}",
                 f"{row['plan']['step']:.2f} / {step:.2f} s ({row['plan']['step'] / step - 1:+.0%})"
                 if worker == 0 else ""]
        out.append("| " + " | ".join(cells) + " |")
    return out


HEAD = ("| configuration | peak: predicted / measured (VmHWM) | error | model's bytes / "
        "measured | step: predicted / measured |\n|---|---|---|---|---|")


def errors(rows: list[dict[str, Any]]) -> tuple[list[float], list[float]]:
    """Every worker's peak error and every row's step error, as fractions."""
    peaks, steps = [], []
    for row in rows:
        if "plan" not in row:
            continue
        peaks += [row["plan"]["peaks"][_device(row, w)] / real - 1
                  for w, real in enumerate(row["workers"])]
        steps.append(row["plan"]["step"] / min(row["seconds"][1:]) - 1)
    return peaks, steps


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as one markdown table, and the largest peak error and the median step's."""
    peaks, steps = errors(rows)
    summary = (f"\nlargest peak error {max(map(abs, peaks)):.1%} over {len(peaks)} workers; "
               f"median step error {statistics.median(map(abs, steps)):.0%}"
               if peaks else "")
    return "\n".join([HEAD, *(line for row in rows for line in lines(row))]) + summary


def report(only: list[str] | None = None, save: str | None = None) -> str:
    """Run the rows (`only` those named, else every one) and give the dated table;
    `save`: also write the rows as JSON there."""
    start = f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, load {os.getloadavg()[0]:.1f}"
    rows = []
    for name in only or [c.name for c in CONFIGS]:
        rows.append(run(by_name(name)))
        print("\n".join(lines(rows[-1])), file=sys.stderr, flush=True)
    if save:
        with open(save, "w") as out:
            json.dump(rows, out)
    return (f"{start} to {time.strftime('%H:%M', time.gmtime())} UTC, load "
            f"{os.getloadavg()[0]:.1f}\n{table(rows)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help="one row's Config fields as JSON (internal)")
    parser.add_argument("--only", nargs="*", help="the rows to run (default: every one)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    print(report(args.only, args.json))


if __name__ == "__main__":
    main()
