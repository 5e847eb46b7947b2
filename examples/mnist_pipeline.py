"""Train a 4-block CNN on handwritten digits as a 2-stage pipeline, then test it.

This is Graphcore's PopTorch pipelining tutorial (mnist_pipeline.py) running on pipetorch: the
same model, blocks, stages, options and training loop; only the import line differs. The data
is either scikit-learn's bundled `load_digits` (1797 8x8 images upsampled to MNIST's 28x28; the
default, no download, about a minute on two CPU cores) or MNIST's IDX files from --data-dir
(fetched there only with --download).

    python examples/mnist_pipeline.py --epochs 3 --strategy sharded
    python examples/mnist_pipeline.py --dataset mnist --data-dir mnist_data --download
"""
from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn as nn
from torch.utils.data import TensorDataset
from tqdm import tqdm

import pipetorch as poptorch
from mnist_data import (
    MIRRORS, DataError, digits_datasets, download_mnist, missing_mnist_files, mnist_datasets,
)

# The seed's settings, made for MNIST's 60000 images: 40 x 10 x 10 = 4000 images per call.
SEED_SETTINGS = {"batch_size": 40, "gradient_accumulation": 10, "device_iterations": 10,
                 "inference_iterations": 100, "epochs": 3}
# For the 1477 training / 320 test digits: 128 images per call (11 calls), 80 per test call,
# and more epochs since each sees 40x fewer images; this reaches ~97.8% on the test digits.
DIGITS_SETTINGS = {"batch_size": 8, "gradient_accumulation": 4, "device_iterations": 4,
                   "inference_iterations": 10, "epochs": 10}
DEFAULT_DATA_DIR = "mnist_data"  # the seed's folder; torchvision's MNIST/raw under it works too


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


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    seed, digits = SEED_SETTINGS, DIGITS_SETTINGS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", choices=("digits", "mnist"), default="digits",
                        help="digits: scikit-learn's bundled 8x8 digits upsampled to 28x28 "
                             "(no download); mnist: MNIST's IDX files from --data-dir "
                             "(default: digits)")
    parser.add_argument("--data-dir", default=None,
                        help=f"folder of the MNIST IDX files, plain or .gz (default: "
                             f"{DEFAULT_DATA_DIR}); --dataset mnist only")
    parser.add_argument("--download", action="store_true",
                        help="fetch the MNIST files missing from --data-dir (--dataset mnist)")
    for flag, name, text in (
            ("--batch-size", "batch_size", "micro-batch size for training"),
            ("--device-iterations", "device_iterations",
             "optimiser steps per call of the training model"),
            ("--gradient-accumulation", "gradient_accumulation",
             "micro-batches per optimiser step; pipelined training of 2 stages needs at "
             "least 3"),
            ("--inference-iterations", "inference_iterations",
             "micro-batches per call of the inference model"),
            ("--epochs", "epochs", "epochs to train for")):
        parser.add_argument(flag, type=positive_int, default=None,
                            help=f"{text} (default: {seed[name]} for mnist, {digits[name]} for "
                                 "digits)")
    parser.add_argument("--test-batch-size", type=positive_int, default=8,
                        help="micro-batch size for inference (default: 8)")
    parser.add_argument("--learning-rate", type=float, default=0.001,
                        help="AdamW learning rate (default: 0.001)")
    parser.add_argument("--strategy", choices=("pipelined", "sharded"), default="pipelined",
                        help="execution strategy of the 2 stages (default: pipelined)")
    parser.add_argument("--debug", action="store_true", help="log pipetorch at DEBUG level")
    parser.add_argument("--profile", action="store_true",
                        help="write an execution trace and memory report (see --profile-dir)")
    parser.add_argument("--profile-dir", default="profile",
                        help="where --profile writes its reports (default: ./profile)")
    parser.add_argument("--max-train-items", type=positive_int, default=None,
                        help="train on only the first N training images (quick checks)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    args = parser.parse_args(argv)
    if args.dataset == "digits" and (args.download or args.data_dir is not None):
        parser.error("--data-dir and --download read MNIST's files: add --dataset mnist "
                     "(the digits are bundled with scikit-learn)")
    return args


def fill_settings(args: argparse.Namespace) -> str | None:
    """Give the settings left out their defaults; say which were chosen for the digits, and why."""
    defaults = DIGITS_SETTINGS if args.dataset == "digits" else SEED_SETTINGS
    chosen = []
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
            if value != SEED_SETTINGS[name]:
                chosen.append(f"--{name.replace('_', '-')} {value}")
    if not chosen:
        return None
    s = SEED_SETTINGS
    return (f"Settings chosen for the digits: {' '.join(chosen)}, since the seed's MNIST "
            f"settings ({s['batch_size']} x {s['gradient_accumulation']} x "
            f"{s['device_iterations']} = "
            f"{s['batch_size'] * s['gradient_accumulation'] * s['device_iterations']} images "
            f"per training call, 8 x {s['inference_iterations']} per test call, {s['epochs']} "
            f"epochs) are too big for 1797 images; pass these flags to choose others.")


def load_data(args: argparse.Namespace) -> tuple[TensorDataset, TensorDataset, str]:
    """(train, test, a description) of the chosen dataset; SystemExit with the fix if absent."""
    if args.dataset == "digits":
        train_set, test_set = digits_datasets(seed=args.seed, max_train_items=args.max_train_items)
        return train_set, test_set, "Digits upsampled to 28x28"
    data_dir = Path(args.data_dir or DEFAULT_DATA_DIR)
    try:
        if args.download:
            download_mnist(data_dir)
        missing = missing_mnist_files(data_dir)
        if missing:
            raise SystemExit(
                f"--dataset mnist reads MNIST's IDX files (plain or .gz) from {data_dir.resolve()}"
                f" (or its MNIST/raw folder), which lacks {', '.join(missing)}. Pass --download "
                f"to fetch them from {MIRRORS[0]}, point --data-dir at them, or use --dataset "
                "digits (bundled with scikit-learn, no download).")
        train_set, test_set = mnist_datasets(data_dir, max_train_items=args.max_train_items)
    except DataError as err:
        raise SystemExit(str(err)) from None
    return train_set, test_set, f"MNIST from {data_dir}"


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.debug:
        logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s: %(message)s")
        logging.getLogger("pipetorch").setLevel(logging.DEBUG)
    chosen = fill_settings(args)
    torch.manual_seed(args.seed)
    train_dataset, test_dataset, description = load_data(args)

    train_opts = poptorch.Options().randomSeed(args.seed)
    train_opts.deviceIterations(args.device_iterations)
    train_opts.Training.gradientAccumulation(args.gradient_accumulation)
    train_opts.setExecutionStrategy(strategy(args.strategy))
    if args.profile:
        train_opts.enableProfiling(args.profile_dir)

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
    if len(test_data) == 0:
        raise SystemExit(f"{len(test_dataset)} test images make no call of "
                         f"{test_data.combinedBatchSize}; lower --test-batch-size or "
                         f"--inference-iterations")
    print(f"{description}: {len(train_dataset)} training and {len(test_dataset)} test images; "
          f"{args.strategy} execution on 2 devices (B1+B2 | B3+B4).")
    print(f"Training: batch size {args.batch_size} x gradient accumulation "
          f"{args.gradient_accumulation} x device iterations {args.device_iterations} = "
          f"{training_data.combinedBatchSize} images per call, {len(training_data)} calls per "
          f"epoch, {args.epochs} epochs, AdamW lr {args.learning_rate}.")
    if chosen:
        print(chosen)
    print(f"Test: batch size {args.test_batch_size} x device iterations "
          f"{args.inference_iterations} = {test_data.combinedBatchSize} images per call, "
          f"{len(test_data)} calls ({len(test_data) * test_data.combinedBatchSize} images).")

    model = Network()
    training_model = poptorch.trainingModel(
        TrainingModelWithLoss(model), train_opts,
        optimizer=poptorch.optim.AdamW(model.parameters(), lr=args.learning_rate))
    # Compiling up front (starting the stage workers) keeps it out of the epochs' throughput.
    start, call = time.perf_counter(), training_data.combinedBatchSize
    training_model.compile(torch.zeros(call, 1, 28, 28), torch.zeros(call, dtype=torch.long))
    print(f"Training model compiled in {time.perf_counter() - start:.1f} s "
          "(not counted in the throughput).")
    if args.profile:
        print(f"Profiling: reports go to {args.profile_dir}/training/report.html and "
              f"{args.profile_dir}/inference/report.html (summary: pipetorch report "
              f"{args.profile_dir}/training)")
    else:
        print("Run with --profile for an execution trace and memory report of each device.")
    train(training_model, training_data, args.epochs)
    training_model.detachFromDevice()  # frees the training workers; the model keeps its weights

    inference_model = poptorch.inferenceModel(model, inf_opts)
    result = test(inference_model, test_data)
    inference_model.detachFromDevice()  # writes the inference report when profiling
    print(f"Accuracy on test set: {result:0.2f}%")


if __name__ == "__main__":
    main()
