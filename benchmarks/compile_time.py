"""Where compilation time goes for a HuggingFace BERT split over devices with BeginBlock.

    python benchmarks/compile_time.py                 # BERT, 4 layers, hidden 256, 4 devices
    python benchmarks/compile_time.py --devices 2 --hidden 64

Phases, each measured on its own: the eager probe forward (which a model split by BeginBlock
no longer runs), the torch.export capture with the probe's findings read from it, cutting the
captured graph into stages, then `trainingModel(...).compile()` as a whole (capture, split,
memory estimate, worker start-up) and the first call after it. Needs transformers.
"""
from __future__ import annotations

import argparse
import time

import torch
import transformers

import pipetorch as poptorch
from pipetorch.partition.blocks import removeBlocks
from pipetorch.partition.split import split_stages
from pipetorch.partition.probe import probe, probe_by_export


def bert(layers: int, hidden: int, devices: int, sequence: int) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=1024, hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64), intermediate_size=4 * hidden,
        max_position_embeddings=sequence)
    model = transformers.BertForQuestionAnswering(config)
    per_device = layers / devices
    for ipu in range(1, devices):  # seed 003: BeginBlock on the first layer of each device
        index = round(ipu * per_device)
        model.bert.encoder.layer[index] = poptorch.BeginBlock(model.bert.encoder.layer[index],
                                                              ipu_id=ipu)
    return model


def inputs(n: int, sequence: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(0, 1024, (n, sequence), generator=g),
            "attention_mask": torch.ones(n, sequence, dtype=torch.long),
            "token_type_ids": torch.zeros(n, sequence, dtype=torch.long),
            "start_positions": torch.randint(0, sequence, (n,), generator=g),
            "end_positions": torch.randint(0, sequence, (n,), generator=g)}


def timed(label: str, fn):
    start = time.perf_counter()
    result = fn()
    print(f"{label:<38} {time.perf_counter() - start:7.2f} s")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--sequence", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args()
    G = 2 * args.devices - 1
    micro = inputs(args.batch, args.sequence)
    model = bert(args.layers, args.hidden, args.devices, args.sequence).train()
    print(f"BERT {args.layers} layers, hidden {args.hidden}, sequence {args.sequence}, over "
          f"{args.devices} devices (micro-batch {args.batch}, G {G})")
    timed("eager probe (not run for this model)", lambda: probe(model, (), micro, training=True))
    result, traced = timed("capture (torch.export) + findings",
                           lambda: probe_by_export(model, (), micro, training=True))
    stages = poptorch.PipelinedExecution().resolve(result.blocks,
                                                   preamble=result.ops_before_blocks)
    timed("split into stages", lambda: split_stages(model, (), micro, stages, traced=traced))
    removeBlocks(model)

    fresh = bert(args.layers, args.hidden, args.devices, args.sequence).train()
    opts = poptorch.Options().showCompilationProgressBar(False)
    opts.Training.gradientAccumulation(G)
    wrapper = poptorch.trainingModel(fresh, opts,
                                     optimizer=torch.optim.SGD(fresh.parameters(), lr=0.01))
    batch = inputs(args.batch * G, args.sequence)
    start = time.perf_counter()
    timed("trainingModel(...).compile()", lambda: wrapper.compile(**batch))
    timed("first call", lambda: wrapper(**batch))
    total = time.perf_counter() - start
    print(f"{'compile + first call':<38} {total:7.2f} s "
          f"({len(wrapper._compiled.engine.worker_pids)} worker processes)")
    wrapper.destroy()


if __name__ == "__main__":
    main()
