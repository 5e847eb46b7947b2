"""Tokens per second of HuggingFace generate(): plain, and through pipetorch's stages.

    python benchmarks/generate.py                 # GPT-2 shape, 8 layers of width 512, 2 devices,
                                                  # 1, 4 and 16 sequences
    python benchmarks/generate.py --quick         # 2 layers of width 64, fewer tokens
    python benchmarks/generate.py --layers 12 --width 768 --new 64

Rows, all in one run, repeated in interleaved rounds (A B C ... A B C ...), medians reported:
plain HuggingFace generate() with 1 and with 2 threads, for 1 sequence and for each batch
(4 and 16 sequences by default); and pipetorch's inferenceModel over 2 devices (BeginBlock
where the layers and the vocabulary head balance the weights each device reads per token)
for 1 sequence (ShardedExecution) and for each batch (PipelinedExecution) with its lanes in
flight (`deviceIterations`: 2 and 4 by default, a row each; lanes waiting together run as
one batch). Greedy decoding of `--new` tokens after
prompts of `--prompt` tokens; the time to the first token is a generate() of one new token.
The same tokens are checked between plain and pipetorch. torch.distributed.pipelining has no
row: its schedules run a forward over a fixed micro-batch shape and keep no key/value cache
between calls, so it has no generation loop to compare with.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

VOCABULARY = 8192


def _model(layers: int, width: int, split: bool) -> torch.nn.Module:
    import transformers

    import pipetorch as poptorch

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCABULARY, n_positions=1024, n_embd=width, n_layer=layers,
        n_head=max(1, width // 64), bos_token_id=0, eos_token_id=None)).eval()
    if split:
        # balanced by weights read per token: the vocabulary head (V x W) runs in stage 1, a
        # layer reads about 12 W^2
        at = min(layers - 1, max(1, round(layers / 2 + VOCABULARY / (24 * width))))
        model.transformer.h[at] = poptorch.BeginBlock(model.transformer.h[at], ipu_id=1)
    return model


def _prompts(batch: int, length: int) -> torch.Tensor:
    return torch.randint(1, VOCABULARY, (batch, length), generator=torch.Generator().manual_seed(1))


def _seconds(generate: Callable[..., torch.Tensor], ids: torch.Tensor, new: int,
             threads: int | None) -> tuple[float, torch.Tensor]:
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        start = time.perf_counter()
        out = generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                       min_new_tokens=new, do_sample=False, pad_token_id=0)
        return time.perf_counter() - start, out
    finally:
        torch.set_num_threads(before)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, nargs="+", default=[4, 16],
                        help="sequences generated together, a group of rows each")
    parser.add_argument("--lanes", type=int, nargs="+", default=[2, 4],
                        help="lanes in flight (deviceIterations), a row each")
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.width, args.new, args.prompt, args.rounds = 2, 64, 8, 8, 2
        args.batch = [4]

    import pipetorch as poptorch

    plain = _model(args.layers, args.width, split=False)
    split = _model(args.layers, args.width, split=True)
    wrappers = {}
    for lanes in (1, *args.lanes):
        opts = poptorch.Options().deviceIterations(lanes).showCompilationProgressBar(False)
        strategy = poptorch.PipelinedExecution if lanes > 1 else poptorch.ShardedExecution
        opts.setExecutionStrategy(strategy(poptorch.AutoStage.SameAsIpu))
        wrappers[lanes] = poptorch.inferenceModel(split, opts)
    Row = tuple[Callable[..., torch.Tensor], torch.Tensor, int | None]
    groups: dict[int, dict[str, Row]] = {}  # sequences -> its rows, plain HF's two first
    for n in (1, *args.batch):
        ids, word = _prompts(n, args.prompt), "sequence" if n == 1 else "sequences"
        group = groups.setdefault(n, {
            f"plain HF, 1 thread, {n} {word}": (plain.generate, ids, 1),
            f"plain HF, 2 threads, {n} {word}": (plain.generate, ids, 2)})
        for lanes in (1,) if n == 1 else args.lanes:
            name = f"pipetorch 2 devices, {n} {word}" + (
                f", {min(lanes, n)} lanes" if n > 1 else "")
            group[name] = (wrappers[lanes].generate, ids, None)
    rows = {name: row for group in groups.values() for name, row in group.items()}
    for generate, ids, threads in rows.values():  # compile, start workers, warm up
        _seconds(generate, ids, 2, threads)
    runs: dict[str, list[float]] = {name: [] for name in rows}
    firsts: dict[str, list[float]] = {name: [] for name in rows}
    outputs: dict[str, torch.Tensor] = {}
    for _ in range(args.rounds):
        for name, (generate, ids, threads) in rows.items():
            seconds, outputs[name] = _seconds(generate, ids, args.new, threads)
            runs[name].append(seconds)
            firsts[name].append(_seconds(generate, ids, 1, threads)[0])
    for wrapper in wrappers.values():
        wrapper.destroy()

    same = all(torch.equal(outputs[next(iter(group))], outputs[name])
               for group in groups.values() for name in group if name.startswith("pipetorch"))
    print(f"GPT-2 shape: {args.layers} layers of width {args.width}, vocabulary {VOCABULARY}; "
          f"prompts of {args.prompt} tokens, {args.new} new tokens, greedy; "
          f"medians of {args.rounds} interleaved rounds; same tokens: {same}")
    print(f"{'':<48} {'tokens/s':>9} {'vs 1 thread':>11} {'vs 2 threads':>12} "
          f"{'first token ms':>14}")
    for n, group in groups.items():
        base1, base2 = (n * args.new / statistics.median(runs[name]) for name in list(group)[:2])
        for name in group:
            rate = n * args.new / statistics.median(runs[name])
            print(f"{name:<48} {rate:>9.1f} {rate / base1:>10.2f}x {rate / base2:>11.2f}x "
                  f"{1000 * statistics.median(firsts[name]):>14.1f}")


if __name__ == "__main__":
    main()
