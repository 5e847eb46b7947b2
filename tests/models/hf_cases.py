"""Small random HuggingFace models split with BeginBlock, and a plain-PyTorch loop to compare."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

import pipetorch as poptorch
from helpers.reference import join
from helpers.scripts import load_example

transformers = __import__("pytest").importorskip("transformers")

Inputs = dict[str, torch.Tensor]
SEQ, VOCAB = 16, 64


@dataclass
class HFCase:
    """A model annotated for `devices` devices and a maker of its keyword inputs."""

    name: str
    model: nn.Module
    devices: int
    make_inputs: Callable[[int, int], Inputs]
    loss_at: int = -1  # where a tuple output holds the loss (the BERT tutorial returns it first)


def bert_config(layers: int = 4) -> Any:
    return transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0)


def qa_inputs(n: int, seed: int) -> Inputs:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(SEQ // 2, SEQ + 1, (n,), generator=g)
    mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()  # padded rows
    return {"input_ids": torch.randint(0, VOCAB, (n, SEQ), generator=g) * mask,
            "attention_mask": mask,
            "token_type_ids": (torch.arange(SEQ)[None, :] >= SEQ // 2).long().expand(n, SEQ).clone(),
            "start_positions": torch.randint(0, SEQ // 2, (n,), generator=g),
            "end_positions": torch.randint(SEQ // 2, SEQ, (n,), generator=g)}


def bert_seed003(devices: int) -> HFCase:
    """Seed 003: `model.bert.encoder.layer[i] = poptorch.BeginBlock(layer[i], ipu_id=...)`."""
    torch.manual_seed(0)
    model = transformers.BertForQuestionAnswering(bert_config())
    starts = {2: [2], 4: [1, 2, 3]}[devices]
    for ipu, index in enumerate(starts, start=1):
        model.bert.encoder.layer[index] = poptorch.BeginBlock(model.bert.encoder.layer[index],
                                                              ipu_id=ipu)
    return HFCase(f"bert-seed003-{devices}", model, devices, qa_inputs)


def bert_tutorial(devices: int) -> HFCase:
    """PopTorch's BERT tutorial: examples/bert_squad.py's PipelinedBertForQuestionAnswering
    (BeginBlock on embeddings, every layer and the head, recomputation hooks, identity_loss)."""
    example = load_example("bert_squad")
    torch.manual_seed(0)
    model = example.PipelinedBertForQuestionAnswering(bert_config())
    layers = {2: [2, 2], 4: [1, 1, 1, 1]}[devices]
    model.parallelize(layers, recompute_checkpoint_every_layer=True)
    return HFCase(f"bert-tutorial-{devices}", model, devices, qa_inputs, loss_at=0)


def gpt2(devices: int, *, tied: bool = False, positions: int = SEQ) -> HFCase:
    """GPT2LMHeadModel with a block per group of layers; embeddings untied unless `tied`;
    sequences up to `positions` long."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=positions, n_embd=32, n_layer=4, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=tied, use_cache=False)
    model = transformers.GPT2LMHeadModel(config)
    starts = {2: [2], 4: [1, 2, 3]}[devices]
    for ipu, index in enumerate(starts, start=1):
        model.transformer.h[index] = poptorch.BeginBlock(model.transformer.h[index], ipu_id=ipu)

    def inputs(n: int, seed: int) -> Inputs:
        ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))
        return {"input_ids": ids, "labels": ids}

    return HFCase(f"gpt2-{devices}", model, devices, inputs)


def vit(devices: int) -> HFCase:
    torch.manual_seed(0)
    config = transformers.ViTConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=4,
        num_attention_heads=2, intermediate_size=64, num_labels=5, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0)
    model = transformers.ViTForImageClassification(config)
    starts = {2: [2], 4: [1, 2, 3]}[devices]
    for ipu, index in enumerate(starts, start=1):
        model.vit.layers[index] = poptorch.BeginBlock(model.vit.layers[index], ipu_id=ipu)

    def inputs(n: int, seed: int) -> Inputs:
        g = torch.Generator().manual_seed(seed)
        return {"pixel_values": torch.randn(n, 3, 16, 16, generator=g),
                "labels": torch.randint(0, 5, (n,), generator=g)}

    return HFCase(f"vit-{devices}", model, devices, inputs)


class ShapeBranching(nn.Module):
    """Python control flow on shapes and Python values: a loop over the sequence's chunks and
    a branch on the batch size, which torch.fx could not trace."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.mix, self.head = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        with poptorch.Block("embed", ipu_id=0):
            h = self.embed(x)
        with poptorch.Block("mix", ipu_id=1):
            chunks = [self.mix(h[:, i:i + 2]).tanh() for i in range(0, h.shape[1], 2)]
            h = torch.cat(chunks, dim=1).mean(dim=1)
            if h.shape[0] > 1:
                h = h - h.mean(dim=0, keepdim=True)
            logits = self.head(h)
            if labels is None:
                return {"logits": logits}
            return {"logits": logits, "loss": nn.functional.cross_entropy(logits, labels)}


def shape_branching(devices: int) -> HFCase:
    assert devices == 2
    torch.manual_seed(0)

    def inputs(n: int, seed: int) -> Inputs:
        g = torch.Generator().manual_seed(seed)
        return {"x": torch.randn(n, 6, 4, generator=g), "labels": torch.randint(0, 3, (n,), generator=g)}

    return HFCase("shape-branching-2", ShapeBranching(), 2, inputs)


BUILDERS: dict[str, Callable[[int], HFCase]] = {
    "bert-seed003": bert_seed003, "bert-tutorial": bert_tutorial, "gpt2": gpt2, "vit": vit,
    "shape-branching": shape_branching,
}


def slice_inputs(inputs: Inputs, start: int, stop: int) -> Inputs:
    return {k: v[start:stop] for k, v in inputs.items()}


def loss_of(output: Any, at: int = -1) -> torch.Tensor:
    if isinstance(output, dict) or hasattr(output, "keys"):
        return output["loss"]
    return output[at] if isinstance(output, (tuple, list)) else output


def plain_call(model: nn.Module, optimizer: torch.optim.Optimizer, inputs: Inputs, *, D: int,
               G: int, B: int, loss_at: int = -1) -> Any:
    """One host call by hand: D steps of G micro-batches; every micro-batch's output joined
    as OutputMode.All returns it (losses stacked, batched outputs concatenated)."""
    outputs = []
    for d in range(D):
        optimizer.zero_grad()
        for g in range(G):
            start = (d * G + g) * B
            output = model(**slice_inputs(inputs, start, start + B))
            (loss_of(output, loss_at) / G).backward()
            outputs.append(pytree.tree_map(lambda t: t.detach(), output))
        optimizer.step()
    return join(outputs)


def twin(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)
