"""Train a CNN in float16 with PopTorch's mixed-precision recipe, beside its float32 twin.

The half-precision chapter of the PopTorch training course (seed 002) on pipetorch. Its
recipe, all PopTorch API:

    model.half()                                       # float16 weights and activations
    images = images.half()                             # float16 inputs
    opts.Precision.setPartialsType(torch.half)         # float16 partials
    opts.Precision.enableStochasticRounding(True)      # IPU hardware rounding
    optimizer = poptorch.optim.AdamW(model.parameters(), lr=0.001, loss_scaling=1024,
                                     accum_type=torch.float16)

The loss is multiplied by `loss_scaling` before backward so that small float16 gradients do
not flush to zero, and divided back before the update. The optimiser's moments keep
PopTorch's default dtype, torch.float32, and the update is computed in float32 and rounded
to the float16 weights. Partials and stochastic rounding are IPU settings, accepted and
without effect here. PopTorch documents the recipe as costing under a point of accuracy.

    python examples/mixed_precision.py                          # 16.16 and 32.32, compared
    python examples/mixed_precision.py --precision 16.16 --epochs 3

The data is scikit-learn's bundled digits (1797 8x8 images of 10 digits, no download): 80%
to train, 20% to test. The program prints each run's loss per epoch, its test accuracy and,
with both precisions, the gap between them.
"""
from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import TensorDataset

import pipetorch as poptorch

PRECISIONS = ("16.16", "32.32")  # input dtype . model dtype, as the course names them


class Net(nn.Module):
    """Two convolutions and a linear classifier for 8x8 images."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.fc = nn.Linear(2 * width * 2 * 2, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(images)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


class ModelWithLoss(nn.Module):
    """The classifier and its loss in one module: PopTorch computes the loss on the device."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor, labels: torch.Tensor | None = None):
        out = self.model(images)
        if labels is None:
            return out
        return out, F.cross_entropy(out, labels)


def digits(seed: int) -> tuple[TensorDataset, TensorDataset]:
    """(train, test) digits as float32 images in [0, 1] of shape [1, 8, 8] and int64 labels."""
    images, labels = load_digits(return_X_y=True)
    images = torch.tensor(images, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    labels = torch.tensor(labels)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    cut = len(order) * 4 // 5
    return (TensorDataset(images[order[:cut]], labels[order[:cut]]),
            TensorDataset(images[order[cut:]], labels[order[cut:]]))


def optimiser(model: nn.Module, precision: str, lr: float) -> poptorch.optim.AdamW:
    """The recipe's AdamW for 16.16; the same AdamW without loss scaling for 32.32."""
    if precision == "16.16":
        return poptorch.optim.AdamW(model.parameters(), lr=lr, loss_scaling=1024,
                                    accum_type=torch.float16)
    return poptorch.optim.AdamW(model.parameters(), lr=lr)


def run(precision: str, args: argparse.Namespace) -> float:
    """Train one precision; returns its test accuracy in percent."""
    dtype = torch.float16 if precision == "16.16" else torch.float32
    torch.manual_seed(args.seed)
    model = ModelWithLoss(Net(args.width)).to(dtype)
    train_set, test_set = digits(args.seed)

    opts = poptorch.Options().randomSeed(args.seed).deviceIterations(args.device_iterations)
    opts.showCompilationProgressBar(False)
    if precision == "16.16":
        opts.Precision.setPartialsType(torch.half)
        opts.Precision.enableStochasticRounding(True)
    loader = poptorch.DataLoader(opts, train_set, batch_size=args.batch_size, shuffle=True)
    training_model = poptorch.trainingModel(model, opts,
                                            optimizer=optimiser(model, precision, args.lr))
    for epoch in range(1, args.epochs + 1):
        losses = [training_model(images.to(dtype), labels)[1].float().mean()
                  for images, labels in loader]
        print(f"{precision}: epoch {epoch}/{args.epochs} loss {torch.stack(losses).mean():.4f}")
    training_model.detachFromDevice()

    quiet = poptorch.Options().showCompilationProgressBar(False)
    inference_model = poptorch.inferenceModel(model, quiet)
    images, labels = test_set.tensors
    predictions = inference_model(images.to(dtype)).float().argmax(dim=1)
    inference_model.destroy()
    training_model.destroy()
    accuracy = 100.0 * float((predictions == labels).float().mean())
    print(f"{precision}: test accuracy {accuracy:.2f}% on {len(labels)} images")
    return accuracy


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", nargs="+", choices=PRECISIONS, default=list(PRECISIONS),
                        help="input.model precisions to train (default: both, compared)")
    parser.add_argument("--epochs", type=int, default=8, help="default: 8")
    parser.add_argument("--batch-size", type=int, default=16, help="default: 16")
    parser.add_argument("--device-iterations", type=int, default=4, help="default: 4")
    parser.add_argument("--lr", type=float, default=2e-3, help="AdamW's (default: 2e-3)")
    parser.add_argument("--width", type=int, default=16, help="first conv's channels (16)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    print(f"Digits: 8x8 images, 10 classes; batch {args.batch_size} x device iterations "
          f"{args.device_iterations}, {args.epochs} epochs, AdamW lr {args.lr:g}.")
    accuracies = {precision: run(precision, args) for precision in args.precision}
    if len(accuracies) == 2:
        gap = accuracies["32.32"] - accuracies["16.16"]
        print(f"Accuracy gap (32.32 minus 16.16): {gap:+.2f} points")
    return accuracies


if __name__ == "__main__":
    main()
