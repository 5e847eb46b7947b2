"""Toy models used by many tests: seed 000's CNN, a small MLP, a BatchNorm net, Block-scoped
nets."""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

import pipetorch as poptorch


class ConvLayer(nn.Module):
    def __init__(self, in_channels: int, num_filters: int, kernel_size: int, pool_size: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, num_filters, kernel_size=kernel_size)
        self.pool = nn.MaxPool2d(kernel_size=pool_size)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.pool(self.conv(x)))


class MnistNetwork(nn.Module):
    """Seed 000's network, annotated with blocks B1..B4."""

    def __init__(self) -> None:
        super().__init__()
        self.layer1 = ConvLayer(1, 10, 5, 2)
        self.layer2 = ConvLayer(10, 20, 5, 2)
        self.layer3 = nn.Linear(320, 256)
        self.layer3_act = nn.ReLU()
        self.layer4 = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with poptorch.Block("B1"):
            x = self.layer1(x)
        with poptorch.Block("B2"):
            x = self.layer2(x)
        with poptorch.Block("B3"):
            x = x.view(-1, 320)
            x = self.layer3_act(self.layer3(x))
        with poptorch.Block("B4"):
            x = self.layer4(x)
        return x


class WithLoss(nn.Module):
    """Seed 000's TrainingModelWithLoss: (output, loss) when labels are given."""

    def __init__(self, model: nn.Module, block: str | None = "B4") -> None:
        super().__init__()
        self.model = model
        self.loss = nn.CrossEntropyLoss()
        self.block = block

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None):
        output = self.model(x)
        if labels is None:
            return output
        if self.block is None:
            return output, self.loss(output, labels)
        with poptorch.Block(self.block):
            loss = self.loss(output, labels)
        return output, loss


class AroundCopy(nn.Module):
    """A shallow copy of the user's model (sharing its parameter tensors), then an MSE loss:
    the loss wrapper PopTorch's own tests train while `user_model` is the user's."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.inner = copy.copy(model)
        self.loss = nn.MSELoss()

    def forward(self, x, y):
        out = self.inner(x)
        return out, self.loss(out, y)


class TinyMLP(nn.Module):
    """Two linear layers; returns (logits, loss) with labels, logits without."""

    def __init__(self, inputs: int = 6, hidden: int = 8, classes: int = 3) -> None:
        super().__init__()
        self.fc1 = nn.Linear(inputs, hidden)
        self.fc2 = nn.Linear(hidden, classes)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None):
        out = self.fc2(torch.relu(self.fc1(x)))
        if labels is None:
            return out
        return out, self.loss(out, labels)


class BatchNormNet(nn.Module):
    """A model whose forward changes buffers (BatchNorm running statistics)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, labels: torch.Tensor):
        out = self.head(torch.relu(self.bn(self.fc(x))))
        return out, nn.functional.cross_entropy(out, labels)


class Shifted(nn.Module):
    """A linear layer plus a buffer `shift` (a value scripts update on the host)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.register_buffer("shift", torch.zeros(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + self.shift


def data(n: int, *, inputs: int = 6, classes: int = 3, seed: int = 0):
    """n random feature rows and integer labels."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, inputs, generator=g), torch.randint(0, classes, (n,), generator=g)


def mnist_data(n: int, *, seed: int = 0):
    """n random 1x28x28 images and labels."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)


class ReluStages(nn.Module):
    """Stage A: h = 2 relu(x W1^T) (6 -> 8); stage B: out = h W2^T (8 -> 4), loss = out.sum()."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 8, bias=False)
        self.fc2 = nn.Linear(8, 4, bias=False)

    def forward(self, x):
        with poptorch.Block("A"):
            h = torch.relu(self.fc1(x)) * 2
        with poptorch.Block("B"):
            out = self.fc2(h)
            loss = poptorch.identity_loss(out, reduction="sum")
        return out, loss


class HeavyLastBlocks(nn.Module):
    """Blocks made the three PopTorch ways, in forward only: L1 (`with Block`), L2
    (`BlockFunction`), L3 (`Block.start`), then Heavy (`with Block`, ten layers and the loss).

    Deliberately unbalanced: Heavy costs more than L1..L3 together, so over 2 devices it
    belongs alone on the last one, the latest cut the planner can choose.
    """

    def __init__(self, inputs: int = 16, width: int = 64, classes: int = 4) -> None:
        super().__init__()
        self.l1 = nn.Linear(inputs, width)
        self.l2 = nn.Linear(width, width)
        self.l3 = nn.Linear(width, width)
        self.heavy = nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.Tanh())
                                     for _ in range(10)))
        self.head = nn.Linear(width, classes)

    @poptorch.BlockFunction("L2")
    def second(self, h: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.l2(h))

    def forward(self, x: torch.Tensor, labels: torch.Tensor):
        with poptorch.Block("L1"):
            h = torch.relu(self.l1(x))
        h = self.second(h)
        poptorch.Block.start("L3")
        h = torch.relu(self.l3(h))
        with poptorch.Block("Heavy"):
            out = self.head(self.heavy(h))
            loss = nn.functional.cross_entropy(out, labels)
        return out, loss


def regression_data(steps: int, *, inputs: int, outputs: int, seed: int, rows: int = 4):
    """`steps` batches (x, y) of `rows` rows: `inputs` features, `outputs` targets."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, inputs, generator=gen), torch.randn(rows, outputs, generator=gen))
            for _ in range(steps)]


class Regressor(nn.Module):
    """One Linear(3, 2) seeded the same every time, with an MSE loss (regression_data's
    shapes): the model of the optimiser compatibility tests."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 2)

    def forward(self, x, y):
        out = self.lin(x)
        return out, F.mse_loss(out, y)


class TokenTagger(nn.Module):
    """A token classifier of any sequence length: embedding and a layer (device 0), the head
    and the loss on device 1 when `devices` is 2; (logits, loss) with labels, logits without."""

    def __init__(self, devices: int = 1, *, vocab: int = 20, width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab)
        if devices == 2:
            poptorch.BeginBlock(self.head, ipu_id=1)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor | None = None):
        hidden = torch.tanh(self.mix(self.embed(ids)))
        # mixing along the sequence: a wrong length would change the numbers, not just shapes
        hidden = hidden + hidden.mean(dim=1, keepdim=True)
        logits = self.head(hidden)
        if labels is None:
            return logits
        return logits, nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def token_batch(n: int, length: int, *, vocab: int = 20, seed: int = 0):
    """n random token sequences of `length` and per-token labels."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, vocab, (n, length), generator=g),
            torch.randint(0, vocab, (n, length), generator=g))
