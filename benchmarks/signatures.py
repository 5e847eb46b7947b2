"""What a new input signature costs with Options.inputSignatures("several").

    python benchmarks/signatures.py              # GPT-2 shape: 4 layers of width 128, 2 devices
    python benchmarks/signatures.py --devices 1
    python benchmarks/signatures.py --quick      # 2 layers of width 32

Trains a GPT-2 shaped model (BeginBlock on its middle layer when split over 2 devices,
gradient accumulation 4, micro-batch 2, AdamW) on calls of sequence lengths 16, 24, 16, 32,
24, and prints each call's seconds: a call with a new length pays its capture and split
(the first call also starts the workers); a repeated length runs at once. It then builds a
second wrapper with the same executable cache folder (POPTORCH_CACHE_DIR) and runs the same
calls: the captures come from the cache. A repeat includes telling the workers to switch
signatures (one round trip). Timings on a shared machine vary by tens of percent: compare
the kinds of call, not single numbers.
"""
from __future__ import annotations

import argparse
import copy
import tempfile
import time

import torch

LENGTHS, ACCUMULATION, MICRO_BATCH, VOCABULARY = (16, 24, 16, 32, 24), 4, 2, 1000


def _model(layers: int, width: int, devices: int) -> torch.nn.Module:
    import transformers

    import pipetorch as poptorch

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCABULARY, n_positions=max(LENGTHS), n_embd=width, n_layer=layers,
        n_head=max(1, width // 32), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        use_cache=False, bos_token_id=0, eos_token_id=0))
    if devices == 2:
        middle = layers // 2
        model.transformer.h[middle] = poptorch.BeginBlock(model.transformer.h[middle], ipu_id=1)
    return model


def _run(model: torch.nn.Module, cache: str, devices: int) -> list[float]:
    import pipetorch as poptorch

    opts = poptorch.Options().inputSignatures("several").showCompilationProgressBar(False)
    opts.Training.gradientAccumulation(ACCUMULATION if devices == 2 else 1)
    opts.enableExecutableCaching(cache)
    batch = MICRO_BATCH * (ACCUMULATION if devices == 2 else 1)
    wrapper = poptorch.trainingModel(
        model, opts, optimizer=poptorch.optim.AdamW(model.parameters(), lr=1e-3))
    seconds = []
    for call, length in enumerate(LENGTHS):
        ids = torch.randint(0, VOCABULARY, (batch, length),
                            generator=torch.Generator().manual_seed(call))
        start = time.perf_counter()
        wrapper(input_ids=ids, labels=ids)
        seconds.append(time.perf_counter() - start)
    wrapper.destroy()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, choices=(1, 2), default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    layers, width = (2, 32) if args.quick else (args.layers, args.width)
    model = _model(layers, width, args.devices)
    with tempfile.TemporaryDirectory() as cache:
        cold = _run(copy.deepcopy(model), cache, args.devices)
        warm = _run(copy.deepcopy(model), cache, args.devices)
    seen: set[int] = set()
    print(f"GPT-2 shape, {layers} layers of width {width}, {args.devices} device(s), "
          f"lengths {LENGTHS}")
    print(f"{'call':>4} {'length':>6} {'kind':<15} {'empty cache s':>13} {'cached s':>9}")
    for call, (length, c, w) in enumerate(zip(LENGTHS, cold, warm)):
        kind = "first call" if call == 0 else "new signature" if length not in seen else "repeat"
        seen.add(length)
        print(f"{call:>4} {length:>6} {kind:<15} {c:>13.2f} {w:>9.2f}")


if __name__ == "__main__":
    main()
