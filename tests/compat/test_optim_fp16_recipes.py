"""Issue 22: PopTorch's float16 training recipes train as their float32 twins do.

PopTorch keeps optimiser state in float32 unless asked and computes the update in float32,
whatever the parameters' dtype. pipetorch used to keep it in the parameters' dtype: the BERT
recipe gave NaN from the third call and the mixed-precision CNN ended at chance (10%).
"""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.testing import assert_close

import pipetorch as poptorch

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("sklearn.datasets")

# --- BERT fine-tuning: half model, loss scaling, float16 accumulator and first moment --------
BATCH, LENGTH, VOCAB, STEPS = 8, 32, 128, 16
LR, LOSS_SCALING = 3e-3, 256.0


class TinyBertQA(transformers.BertForQuestionAnswering):
    """The tutorial's forward: logits and the loss marked with identity_loss."""

    def forward(self, input_ids, attention_mask, token_type_ids, start_positions, end_positions):
        out = super().forward(input_ids=input_ids, attention_mask=attention_mask,
                              token_type_ids=token_type_ids, start_positions=start_positions,
                              end_positions=end_positions)
        return out.start_logits, out.end_logits, poptorch.identity_loss(out.loss, "none")


def tiny_bert(dtype: torch.dtype) -> TinyBertQA:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=LENGTH, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0)
    return TinyBertQA(config).train().to(dtype)


def qa_batches() -> list[tuple[torch.Tensor, ...]]:
    """Question/context sequences whose answer span opens with token 5 and closes with 6."""
    gen = torch.Generator().manual_seed(1)
    count = BATCH * STEPS
    ids = torch.randint(10, VOCAB, (count, LENGTH), generator=gen)
    starts = torch.randint(9, LENGTH - 4, (count,), generator=gen)
    ends = starts + 2
    rows = torch.arange(count)
    ids[rows, starts], ids[rows, ends] = 5, 6
    types = (torch.arange(LENGTH) > 8).long().expand(count, LENGTH).clone()
    mask = torch.ones(count, LENGTH, dtype=torch.long)
    tensors = (ids, mask, types, starts, ends)
    return [tuple(t[i * BATCH:(i + 1) * BATCH] for t in tensors) for i in range(STEPS)]


def tutorial_adamw(model: nn.Module, half: bool) -> poptorch.optim.AdamW:
    """The tutorial's optimiser; the second moment is left at its (float32) default."""
    extras = dict(loss_scaling=LOSS_SCALING, accum_type=torch.float16,
                  first_order_momentum_accum_type=torch.float16) if half else {}
    return poptorch.optim.AdamW(model.parameters(), lr=LR, eps=1e-6, weight_decay=0.0, **extras)


def train_bert(model: nn.Module, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    wrapped = poptorch.trainingModel(model, optimizer=optimizer)
    try:
        return torch.stack([wrapped(*batch)[-1].float() for batch in qa_batches()])
    finally:
        wrapped.destroy()


def test_half_bert_with_float16_first_moment_trains_as_its_float32_twin():
    half = train_bert(model := tiny_bert(torch.float16), tutorial_adamw(model, half=True))
    full = train_bert(model32 := tiny_bert(torch.float32), tutorial_adamw(model32, half=False))
    assert torch.isfinite(half).all(), half
    assert full[-1] <= full[0] / 2, full  # the task is learnable in 16 steps
    assert half[-1] <= half[0] / 2, half
    assert_close(half, full, rtol=0, atol=0.05)
    assert all(p.dtype == torch.float16 for p in model.parameters())


def test_half_bert_equals_plain_pytorch_with_the_update_written_out():
    """The same recipe by hand: scaled float16 backward, gradients rounded to float16
    (accum_type), then AdamW in float32 on float32 copies whose first moment is rounded to
    float16 after each step, and the weights rounded back to float16."""
    model = tiny_bert(torch.float16)
    reference = copy.deepcopy(model)
    losses = train_bert(model, tutorial_adamw(model, half=True))

    shadow = copy.deepcopy(reference).float()
    adamw = torch.optim.AdamW(shadow.parameters(), lr=LR, eps=1e-6, weight_decay=0.0)
    pairs = list(zip(reference.parameters(), shadow.parameters()))
    expected = []
    for batch in qa_batches():
        reference.zero_grad()
        loss = reference(*batch)[-1]
        (loss * LOSS_SCALING).backward()
        with torch.no_grad():
            for param, twin in pairs:
                twin.copy_(param)
                twin.grad = param.grad.float() / LOSS_SCALING
            adamw.step()
            for param, twin in pairs:
                param.copy_(twin)
                state = adamw.state[twin]
                state["exp_avg"] = state["exp_avg"].half().float()
        expected.append(loss.detach().float())
    assert_close(losses, torch.stack(expected), rtol=0, atol=2e-3)
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        assert_close(got, want, rtol=0, atol=2e-3, msg=name)


# --- The mixed-precision recipe: .half() CNN, half images, AdamW(accum_type=float16) ---------
class DigitsCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv1, self.conv2 = nn.Conv2d(1, 8, 3, padding=1), nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16 * 2 * 2, 10)

    def forward(self, images, labels=None):
        x = F.max_pool2d(F.relu(self.conv1(images)), 2)
        out = self.fc(F.max_pool2d(F.relu(self.conv2(x)), 2).flatten(1))
        return out if labels is None else (out, F.cross_entropy(out, labels))


def digits_accuracy(dtype: torch.dtype, *, epochs: int = 2) -> float:
    images, labels = datasets.load_digits(return_X_y=True)
    images = torch.tensor(images, dtype=torch.float32).reshape(-1, 1, 8, 8).div(16).to(dtype)
    labels = torch.tensor(labels)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    train, test = order[:1440], order[1440:]
    model = DigitsCNN().to(dtype)
    opts = poptorch.Options().randomSeed(0).deviceIterations(4)
    opts.showCompilationProgressBar(False)
    if dtype == torch.float16:
        opts.Precision.setPartialsType(torch.half)
        opts.Precision.enableStochasticRounding(True)
        optimizer = poptorch.optim.AdamW(model.parameters(), lr=4e-3, accum_type=torch.float16,
                                         loss_scaling=1024)
    else:
        optimizer = poptorch.optim.AdamW(model.parameters(), lr=4e-3)
    loader = poptorch.DataLoader(opts, torch.utils.data.TensorDataset(images[train],
                                                                      labels[train]),
                                 batch_size=16, shuffle=True)
    wrapped = poptorch.trainingModel(model, opts, optimizer=optimizer)
    for _ in range(epochs):
        for x, y in loader:
            wrapped(x, y)
    wrapped.destroy()
    predictions = model(images[test]).float().argmax(dim=1)
    return 100.0 * float((predictions == labels[test]).float().mean())


def test_mixed_precision_cnn_ends_within_two_points_of_its_float32_twin():
    half, full = digits_accuracy(torch.float16), digits_accuracy(torch.float32)
    assert full > 80.0, full  # chance is 10%
    assert abs(full - half) <= 2.0, (half, full)
