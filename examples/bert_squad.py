"""Fine-tune BERT for question answering pipelined over devices, as PopTorch's BERT tutorial does.

Seed 003's second way to pipeline ("when you import the model") and PopTorch's BERT
fine-tuning tutorial, on pipetorch:

    python examples/bert_squad.py                                  # 4 devices, 1 layer each
    python examples/bert_squad.py --layers-per-ipu 2 2             # 2 devices
    python examples/bert_squad.py --pretrained DIR --squad FILE    # a local checkpoint + SQuAD

The model is `PipelinedBertForQuestionAnswering`, a subclass of transformers'
BertForQuestionAnswering whose `parallelize` puts `poptorch.BeginBlock` on the embeddings
(ipu 0), on every encoder layer (`--layers-per-ipu` of them on each device) and on the QA
head (the last device), and registers a forward hook on each layer that returns
`poptorch.recomputationCheckpoint` of its output. Its forward marks the loss with
`poptorch.identity_loss(output.loss, reduction="none")`.

By default the model is built from a small random BertConfig and trained on generated
question/answer spans (the answer is the span of tokens that repeats the question's marker),
so it runs offline; nothing is downloaded. `--pretrained DIR` loads a local HuggingFace
checkpoint directory (config, weights and tokenizer); `--squad FILE` reads a local
SQuAD-format json (it needs `--pretrained` for the tokenizer). The optimiser is
`poptorch.optim.AdamW` with parameter groups (no weight decay on biases and LayerNorm), its
learning rate set each step by a transformers linear schedule with warm-up and pushed to the
device with `setOptimizer`. Prints the loss and sequences/s.
"""
from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence

import torch
import transformers
from torch.utils.data import TensorDataset

import pipetorch as poptorch


def layer_ipus(layers_per_ipu: Sequence[int]) -> list[int]:
    """The device of each encoder layer: `[1, 2]` -> `[0, 1, 1]`."""
    return [ipu for ipu, count in enumerate(layers_per_ipu) for _ in range(count)]


def _checkpoint_output(module: torch.nn.Module, inputs: tuple, output):
    # transformers 5.x layers return a tensor; 4.x returned a tuple whose first item it is.
    if isinstance(output, tuple):
        return (poptorch.recomputationCheckpoint(output[0]),) + output[1:]
    return poptorch.recomputationCheckpoint(output)


class PipelinedBertForQuestionAnswering(transformers.BertForQuestionAnswering):
    """BertForQuestionAnswering split over devices with BeginBlock (PopTorch's tutorial)."""

    def parallelize(self, layers_per_ipu: Sequence[int], *,
                    recompute_checkpoint_every_layer: bool = True) -> "PipelinedBertForQuestionAnswering":
        ipus = layer_ipus(layers_per_ipu)
        if len(ipus) != len(self.bert.encoder.layer):
            raise ValueError(f"--layers-per-ipu {list(layers_per_ipu)} places {len(ipus)} layers "
                             f"but the model has {len(self.bert.encoder.layer)}")
        self.bert.embeddings = poptorch.BeginBlock(self.bert.embeddings, "Embedding", ipu_id=0)
        for index, layer in enumerate(self.bert.encoder.layer):
            if recompute_checkpoint_every_layer and index != len(ipus) - 1:
                layer.register_forward_hook(_checkpoint_output)
            self.bert.encoder.layer[index] = poptorch.BeginBlock(layer, f"Encoder{index}",
                                                                 ipu_id=ipus[index])
        self.qa_outputs = poptorch.BeginBlock(self.qa_outputs, "QA Outputs", ipu_id=ipus[-1])
        return self

    def forward(self, input_ids, attention_mask, token_type_ids, start_positions=None,
                end_positions=None):
        output = super().forward(input_ids=input_ids, attention_mask=attention_mask,
                                 token_type_ids=token_type_ids, start_positions=start_positions,
                                 end_positions=end_positions)
        if start_positions is None:
            return output.start_logits, output.end_logits
        # The tutorial's order: the loss first. pipetorch, like PopTorch, trains on the final
        # loss operation's result wherever forward returns it.
        return (poptorch.identity_loss(output.loss, reduction="none"), output.start_logits,
                output.end_logits)


def generated_squad(items: int, length: int, vocab: int, *, seed: int) -> TensorDataset:
    """Token sequences `[CLS] marker q.. [SEP] context..` whose answer is the context span that
    starts with the question's marker token and ends at the next marker (learnable offline)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, vocab, (items, length), generator=g)
    question = length // 4
    ids[:, 0], ids[:, question] = 2, 3  # [CLS], [SEP]
    starts = torch.randint(question + 1, length - 4, (items,), generator=g)
    spans = torch.randint(1, 4, (items,), generator=g)
    ends = torch.minimum(starts + spans, torch.tensor(length - 1))
    rows = torch.arange(items)
    ids[rows, starts], ids[rows, ends] = ids[:, 1], 5  # the question's marker opens the answer
    types = (torch.arange(length) > question).long().expand(items, length).clone()
    mask = torch.ones(items, length, dtype=torch.long)
    return TensorDataset(ids, mask, types, starts, ends)


def squad_file(path: str, tokenizer, length: int, items: int) -> TensorDataset:
    """Question/context pairs of a local SQuAD-format json, answers as token positions."""
    with open(path) as file:
        articles = json.load(file)["data"]
    rows = []
    for paragraph in (p for a in articles for p in a["paragraphs"]):
        for qa in paragraph["qas"]:
            if not qa.get("answers") or len(rows) >= items:
                continue
            answer = qa["answers"][0]
            encoded = tokenizer(qa["question"], paragraph["context"], truncation="only_second",
                                max_length=length, padding="max_length",
                                return_offsets_mapping=True)
            first = answer["answer_start"]
            last = first + len(answer["text"])
            positions = [i for i, (s, e) in enumerate(encoded["offset_mapping"])
                         if encoded.sequence_ids()[i] == 1 and s < last and e > first]
            if positions:
                rows.append((encoded["input_ids"], encoded["attention_mask"],
                             encoded["token_type_ids"], positions[0], positions[-1]))
    if not rows:
        raise SystemExit(f"{path} holds no answerable question that fits {length} tokens")
    return TensorDataset(*(torch.tensor(column) for column in zip(*rows)))


def build_model(args: argparse.Namespace) -> PipelinedBertForQuestionAnswering:
    if args.pretrained:
        return PipelinedBertForQuestionAnswering.from_pretrained(args.pretrained)
    config = transformers.BertConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=sum(args.layers_per_ipu),
        num_attention_heads=args.heads, intermediate_size=4 * args.hidden,
        max_position_embeddings=args.sequence_length)
    return PipelinedBertForQuestionAnswering(config)


def adamw(model: torch.nn.Module, lr: float) -> poptorch.optim.AdamW:
    """The tutorial's parameter groups: no weight decay on biases and LayerNorm weights."""
    plain = [p for n, p in model.named_parameters() if "bias" in n or "LayerNorm" in n]
    decayed = [p for n, p in model.named_parameters() if not ("bias" in n or "LayerNorm" in n)]
    return poptorch.optim.AdamW([{"params": decayed, "weight_decay": 0.01},
                                 {"params": plain, "weight_decay": 0.0}], lr=lr)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers-per-ipu", type=int, nargs="+", default=[1, 1, 1, 1],
                        help="encoder layers on each device (default: 1 1 1 1)")
    parser.add_argument("--pretrained", help="a local HuggingFace checkpoint directory")
    parser.add_argument("--squad", help="a local SQuAD-format json (needs --pretrained)")
    parser.add_argument("--hidden", type=int, default=64, help="hidden size (default: 64)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (default: 4)")
    parser.add_argument("--vocab", type=int, default=512, help="vocabulary (default: 512)")
    parser.add_argument("--sequence-length", type=int, default=64, help="tokens (default: 64)")
    parser.add_argument("--items", type=int, default=1536, help="sequences (default: 1536)")
    parser.add_argument("--batch-size", type=int, default=4, help="micro-batch (default: 4)")
    parser.add_argument("--gradient-accumulation", type=int, default=None,
                        help="default: 2 x stages - 1, the least a pipeline trains with (each "
                             "block is a stage under AutoIncrement: layers + 2)")
    parser.add_argument("--device-iterations", type=int, default=2, help="default: 2")
    parser.add_argument("--epochs", type=int, default=2, help="default: 2")
    parser.add_argument("--learning-rate", type=float, default=1e-3, help="default: 1e-3")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    devices = len(args.layers_per_ipu)
    stages = sum(args.layers_per_ipu) + 2  # embeddings, every layer, the QA head
    accumulation = args.gradient_accumulation or 2 * stages - 1
    torch.manual_seed(args.seed)
    model = build_model(args).parallelize(args.layers_per_ipu).train()
    if args.squad:
        if not args.pretrained:
            raise SystemExit("--squad needs --pretrained DIR for its tokenizer")
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.pretrained)
        dataset = squad_file(args.squad, tokenizer, args.sequence_length, args.items)
    else:
        dataset = generated_squad(args.items, args.sequence_length, model.config.vocab_size,
                                  seed=args.seed)

    opts = poptorch.Options().randomSeed(args.seed)
    opts.deviceIterations(args.device_iterations)
    opts.Training.gradientAccumulation(accumulation)
    opts.outputMode(poptorch.OutputMode.Final)
    opts.setExecutionStrategy(poptorch.PipelinedExecution(poptorch.AutoStage.AutoIncrement))
    loader = poptorch.DataLoader(opts, dataset, batch_size=args.batch_size, shuffle=True,
                                 drop_last=True)
    if len(loader) == 0:
        raise SystemExit(f"{len(dataset)} sequences make no call of {loader.combinedBatchSize}; "
                         "raise --items or lower the batch settings")
    optimizer = adamw(model, args.learning_rate)
    steps = len(loader) * args.epochs * args.device_iterations
    schedule = transformers.get_linear_schedule_with_warmup(optimizer, steps // 10, steps)
    training_model = poptorch.trainingModel(model, opts, optimizer=optimizer)
    print(f"BERT: {sum(args.layers_per_ipu)} layers over {devices} devices "
          f"{args.layers_per_ipu} ({stages} stages), {len(dataset)} sequences of "
          f"{args.sequence_length}, {loader.combinedBatchSize} per call")
    start = time.perf_counter()
    training_model.compile(*next(iter(loader)))
    print(f"Compiled in {time.perf_counter() - start:.1f} s")
    for epoch in range(1, args.epochs + 1):
        start, losses, sequences = time.perf_counter(), [], 0
        for ids, mask, types, starts, ends in loader:
            loss, _, _ = training_model(ids, mask, types, starts, ends)
            for _ in range(args.device_iterations):
                schedule.step()
            training_model.setOptimizer(optimizer)  # the new learning rate
            losses.append(loss.mean().item())
            sequences += ids.shape[0]
        seconds = time.perf_counter() - start
        print(f"Epoch {epoch}: loss {sum(losses) / len(losses):.4f}, "
              f"{sequences / seconds:.1f} sequences/s")
    training_model.destroy()


if __name__ == "__main__":
    main()
