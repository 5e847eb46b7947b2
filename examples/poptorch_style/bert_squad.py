"""PopTorch's BERT fine-tuning (seed 003 / the BERT tutorial) as PopTorch users wrote it.

Unmodified PopTorch: it imports `poptorch`, never pipetorch. Run it on pipetorch with

    pipetorch run examples/poptorch_style/bert_squad.py
    pipetorch run examples/poptorch_style/bert_squad.py --layers-per-ipu 1 1

A small random BertConfig and generated question/answer spans (examples/bert_squad.py's),
so it runs offline.
"""
import argparse
import os
import sys
import time

import poptorch
import torch
import transformers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bert_squad import generated_squad  # noqa: E402 - in examples/


class PipelinedBertForQuestionAnswering(transformers.BertForQuestionAnswering):
    def parallelize(self, layers_per_ipu):
        layer_ipu = [ipu for ipu, n in enumerate(layers_per_ipu) for _ in range(n)]
        self.bert.embeddings = poptorch.BeginBlock(self.bert.embeddings, "Embedding", ipu_id=0)
        for index, layer in enumerate(self.bert.encoder.layer):
            if index != len(layer_ipu) - 1:
                layer.register_forward_hook(
                    lambda module, inputs, output: poptorch.recomputationCheckpoint(output))
            self.bert.encoder.layer[index] = poptorch.BeginBlock(layer, f"Encoder{index}",
                                                                 ipu_id=layer_ipu[index])
        self.qa_outputs = poptorch.BeginBlock(self.qa_outputs, "QA Outputs",
                                              ipu_id=layer_ipu[-1])
        return self

    def forward(self, input_ids, attention_mask, token_type_ids, start_positions=None,
                end_positions=None):
        output = super().forward(input_ids=input_ids, attention_mask=attention_mask,
                                 token_type_ids=token_type_ids, start_positions=start_positions,
                                 end_positions=end_positions)
        if self.training:
            final_loss = poptorch.identity_loss(output.loss, reduction="none")
            return output.start_logits, output.end_logits, final_loss
        return output.start_logits, output.end_logits


parser = argparse.ArgumentParser()
parser.add_argument("--layers-per-ipu", type=int, nargs="+", default=[1, 1, 1, 1])
parser.add_argument("--batch-size", type=int, default=2)
parser.add_argument("--items", type=int, default=448)
parser.add_argument("--epochs", type=int, default=1)
args = parser.parse_args()

config = transformers.BertConfig(vocab_size=512, hidden_size=64, num_attention_heads=4,
                                 num_hidden_layers=sum(args.layers_per_ipu),
                                 intermediate_size=256, max_position_embeddings=64)
model = PipelinedBertForQuestionAnswering(config).parallelize(args.layers_per_ipu).train()

opts = poptorch.Options().randomSeed(42)
opts.deviceIterations(1)
opts.Training.gradientAccumulation(2 * (sum(args.layers_per_ipu) + 2) - 1)
opts.outputMode(poptorch.OutputMode.Final)
opts.setExecutionStrategy(poptorch.PipelinedExecution(poptorch.AutoStage.AutoIncrement))

no_decay = [p for n, p in model.named_parameters() if "bias" in n or "LayerNorm" in n]
decay = [p for n, p in model.named_parameters() if not ("bias" in n or "LayerNorm" in n)]
optimizer = poptorch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                                  {"params": no_decay, "weight_decay": 0.0}], lr=1e-3)
train_dataloader = poptorch.DataLoader(opts, generated_squad(args.items, 64, 512, seed=0),
                                       batch_size=args.batch_size, shuffle=True, drop_last=True)
scheduler = transformers.get_linear_schedule_with_warmup(
    optimizer, 2, len(train_dataloader) * args.epochs)
training_model = poptorch.trainingModel(model, opts, optimizer)

for epoch in range(1, args.epochs + 1):
    start, losses = time.time(), []
    for input_ids, attention_mask, token_type_ids, start_positions, end_positions in train_dataloader:
        _, _, loss = training_model(input_ids, attention_mask, token_type_ids, start_positions,
                                    end_positions)
        scheduler.step()
        training_model.setOptimizer(optimizer)
        losses.append(loss.mean().item())
    seconds = time.time() - start
    print(f"Epoch {epoch}: loss {sum(losses) / len(losses):.4f}, "
          f"{len(train_dataloader) * train_dataloader.combinedBatchSize / seconds:.1f} sequences/s")
training_model.detachFromDevice()
