"""Train a 4-block CNN on handwritten digits as a 2-stage pipeline, then test it.

This is Graphcore's PopTorch pipelining tutorial (mnist_pipeline.py) running on pipetorch: the
same model, blocks, stages, options and training loop; only the import line differs. The data
is scikit-learn's bundled `load_digits` (1797 8x8 images, no download) upsampled to MNIST's
28x28, so the demo runs anywhere in about a minute on two CPU cores.

    python examples/mnist_pipeline.py --epochs 3 --strategy sharded
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import TensorDataset
from tqdm import tqdm

import pipetorch as poptorch

TEST_ITEMS = 320  # 1797 digits: 1477 to train on, 320 (4 inference calls of 8 x 10) to test


class ConvLayer(nn.Module):
    def __init__(self, in_channels, num_filters, kernel_size, pool_size):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, num_filters, kernel_size=kernel_size)
        self.pool = nn.MaxPool2d(kernel_size=pool_size)
        self.relu = nn.ReLU()

    def forward(self, x):
        x = self.conv(x)
        x = self.pool(x)
        x = self.relu(x)
        return x


class Network(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer1 = ConvLayer(1, 10, 5, 2)
        self.layer2 = ConvLayer(10, 20, 5, 2)
        self.layer3 = nn.Linear(320, 256)
        self.layer3_act = nn.ReLU()
        self.layer4 = nn.Linear(256, 10)

    def forward(self, x):
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


class TrainingModelWithLoss(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model
        self.loss = nn.CrossEntropyLoss()

    def forward(self, args, labels=None):
        output = self.model(args)
        if labels is None:
            return output
        with poptorch.Block("B4"):
            loss = self.loss(output, labels)
        return output, loss


def digits_datasets(*, test_items: int = TEST_ITEMS, seed: int = 0,
                    max_train_items: int | None = None) -> tuple[TensorDataset, TensorDataset]:
    """scikit-learn's digits as MNIST-like 1x28x28 tensors, split into (train, test).

    The split is a fixed permutation of `seed`; both sets are normalised with the training
    set's mean and standard deviation, as MNIST's (0.1307, 0.3081) are.
    """
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    images = F.interpolate(images, size=(28, 28), mode="bilinear", align_corners=False)
    labels = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(seed))
    test_idx, train_idx = order[:test_items], order[test_items:]
    if max_train_items is not None:
        train_idx = train_idx[:max_train_items]
    mean, std = images[train_idx].mean(), images[train_idx].std()
    images = (images - mean) / std
    return (TensorDataset(images[train_idx], labels[train_idx]),
            TensorDataset(images[test_idx], labels[test_idx]))


def accuracy(predictions: torch.Tensor, labels: torch.Tensor) -> float:
    """Percentage of right answers; predictions may cover only the last rows of labels."""
    labels = labels[-predictions.size(0):]
    return (predictions.argmax(dim=1) == labels).float().mean().item() * 100.0


def strategy(name: str):
    """Blocks B1+B2 on device 0 and B3+B4 on device 1, as a pipeline or one after the other."""
    stages = (poptorch.Stage("B1", "B2").ipu(0), poptorch.Stage("B3", "B4").ipu(1))
    if name == "pipelined":
        return poptorch.PipelinedExecution(*stages)
    return poptorch.ShardedExecution(*stages)


def train(training_model, training_data, epochs: int) -> None:
    for epoch in range(1, epochs + 1):
        print(f"Epoch {epoch}/{epochs}")
        images, rate, start = 0, 0.0, time.perf_counter()
        bar = tqdm(training_data, total=len(training_data))
        for data, labels in bar:
            preds, losses = training_model(data, labels)
            images += len(data)
            rate = images / (time.perf_counter() - start)
            mean_loss = torch.mean(losses).item()
            bar.set_description(f"Loss:{mean_loss:0.4f} | Accuracy:{accuracy(preds, labels):0.2f}%")
            bar.set_postfix_str(f"{rate:.0f} images/s")
        bar.close()
        print(f"Epoch {epoch}/{epochs}: {images} images at {rate:.0f} images/s")


def test(inference_model, test_data) -> float:
    correct = total = 0
    for data, labels in tqdm(test_data, total=len(test_data)):
        output = inference_model(data)
        correct += (output.argmax(dim=1) == labels).sum().item()
        total += len(labels)
    return 100.0 * correct / total


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=8,
                        help="micro-batch size for training (default: 8)")
    parser.add_argument("--device-iterations", type=int, default=4,
                        help="optimiser steps per call of the training model (default: 4)")
    parser.add_argument("--gradient-accumulation", type=int, default=4,
                        help="micro-batches per optimiser step; pipelined training of 2 stages "
                             "needs at least 3 (default: 4)")
    parser.add_argument("--test-batch-size", type=int, default=8,
                        help="micro-batch size for inference (default: 8)")
    parser.add_argument("--inference-iterations", type=int, default=10,
                        help="micro-batches per call of the inference model (default: 10)")
    parser.add_argument("--epochs", type=int, default=10, help="epochs to train for (default: 10)")
    parser.add_argument("--learning-rate", type=float, default=0.001,
                        help="AdamW learning rate (default: 0.001)")
    parser.add_argument("--strategy", choices=("pipelined", "sharded"), default="pipelined",
                        help="execution strategy of the 2 stages (default: pipelined)")
    parser.add_argument("--max-train-items", type=int, default=None,
                        help="train on only the first N training images (quick checks)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    train_dataset, test_dataset = digits_datasets(seed=args.seed,
                                                  max_train_items=args.max_train_items)

    train_opts = poptorch.Options().randomSeed(args.seed)
    train_opts.deviceIterations(args.device_iterations)
    train_opts.Training.gradientAccumulation(args.gradient_accumulation)
    train_opts.setExecutionStrategy(strategy(args.strategy))

    training_data = poptorch.DataLoader(train_opts, train_dataset,
                                        batch_size=args.batch_size, shuffle=True)
    inf_opts = train_opts.clone()
    inf_opts.Training.gradientAccumulation(1)
    inf_opts.deviceIterations(args.inference_iterations)
    test_data = poptorch.DataLoader(inf_opts, test_dataset, batch_size=args.test_batch_size)

    if len(training_data) == 0:
        raise SystemExit(f"{len(train_dataset)} training images make no call of "
                         f"{training_data.combinedBatchSize}; lower the batch size, device "
                         f"iterations or gradient accumulation, or raise --max-train-items")
    print(f"Digits upsampled to 28x28: {len(train_dataset)} training and {len(test_dataset)} "
          f"test images; {args.strategy} execution on 2 devices (B1+B2 | B3+B4).")
    print(f"Training: batch size {args.batch_size} x gradient accumulation "
          f"{args.gradient_accumulation} x device iterations {args.device_iterations} = "
          f"{training_data.combinedBatchSize} images per call, {len(training_data)} calls per "
          f"epoch, {args.epochs} epochs, AdamW lr {args.learning_rate}.")
    print(f"Test: batch size {args.test_batch_size} x device iterations "
          f"{args.inference_iterations} = {test_data.combinedBatchSize} images per call.")

    model = Network()
    training_model = poptorch.trainingModel(
        TrainingModelWithLoss(model), train_opts,
        optimizer=poptorch.optim.AdamW(model.parameters(), lr=args.learning_rate))
    train(training_model, training_data, args.epochs)
    training_model.detachFromDevice()  # frees the training workers; the model keeps its weights

    inference_model = poptorch.inferenceModel(model, inf_opts)
    print(f"Accuracy on test set: {test(inference_model, test_data):0.2f}%")


if __name__ == "__main__":
    main()
