"""Is the DataLoader or the model the bottleneck? Graphcore's data-loading tutorial on pipetorch.

The experiment of PopTorch's "Efficient data loading" tutorial (tuto_data_loading.py): its
ClassificationModel trains on a random TensorDataset of 1x128x128 images (the tutorial's data is
random too) fed by a `poptorch.DataLoader` in `DataLoaderMode.Async`, whose loader process fills
a shared-memory ring buffer (the AsynchronousDataAccessor) while the model computes. It prints

    DataLoader throughput: X items/s   the loader alone: iterate it, touch each batch
    IPU throughput: X items/s          the training model, on real data from the loader, or
                                       with --synthetic-data on inputs made on the device

A loader faster than the model with synthetic data is not the bottleneck. pipetorch runs the
"IPU" part on its device (the CPU here, or a GPU: PIPETORCH_DEVICE=cuda); the line keeps the
tutorial's name so the numbers compare line for line. The model's width follows the image
size (fc1 takes 41772 features at 128x128, the tutorial's 972 at MNIST's 28x28).

    python examples/data_loading.py                      # the tutorial's sizes (650 MB of data)
    python examples/data_loading.py --synthetic-data --replicas 2
    python examples/data_loading.py --items 512 --image-size 28 --device-iterations 4
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

import pipetorch as poptorch


class ClassificationModel(nn.Module):
    """The tutorial's model: two convolutions, GroupNorm, two linear layers, NLL loss."""

    def __init__(self, image_size: int = 128) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 5, 3)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(5, 12, 5)
        self.norm = nn.GroupNorm(3, 12)
        self.fc1 = nn.Linear(fc1_features(image_size), 100)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(100, 10)
        # dim=0 as in the tutorial: it normalises over the batch, not the classes; kept so the
        # work measured is the tutorial's.
        self.log_softmax = nn.LogSoftmax(dim=0)
        self.loss = nn.NLLLoss()

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None):
        x = self.pool(self.relu(self.conv1(x)))
        x = self.norm(self.relu(self.conv2(x)))
        x = torch.flatten(x, start_dim=1)
        x = self.relu(self.fc1(x))
        x = self.log_softmax(self.fc2(x))
        if self.training:
            return x, self.loss(x, labels)
        return x


def fc1_features(image_size: int) -> int:
    """Inputs of fc1: 12 channels after conv 3x3, pool 2x2 and conv 5x5 (41772 at 128x128)."""
    side = (image_size - 2) // 2 - 4
    if side < 1:
        raise ValueError(f"--image-size {image_size} is too small for the model's convolutions "
                         "and pooling; use 12 or more")
    return 12 * side * side


def random_dataset(items: int, image_size: int, *, seed: int) -> TensorDataset:
    """The tutorial's fake data: N(0,1) images 1xSxS and labels drawn from 0..9."""
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn([items, 1, image_size, image_size], generator=generator)
    labels = torch.randint(0, 10, [items], generator=generator)
    return TensorDataset(features, labels)


class Elapsed:
    """Wall-clock seconds of a `with` block (the tutorial's `catchtime`)."""

    seconds: float = 0.0


@contextmanager
def catchtime() -> Iterator[Elapsed]:
    elapsed, start = Elapsed(), time.perf_counter()
    try:
        yield elapsed
    finally:
        elapsed.seconds = time.perf_counter() - start


def loader_throughput(training_data: poptorch.DataLoader) -> None:
    """Iterate one epoch of the loader alone, as the model would consume it."""
    items = 0
    with catchtime() as t:
        for _, labels in training_data:
            items += labels.shape[0]
    print(f"DataLoader throughput: {items / t.seconds:.2f} items/s")
    print(f"DataLoader execution time: {t.seconds:.2f} s")


def model_throughput(training_model: poptorch.PoplarExecutor,
                     training_data: poptorch.DataLoader, first_batch: Sequence[torch.Tensor],
                     *, synthetic: bool) -> None:
    """One epoch of training steps: fed by the loader, or repeating one batch when synthetic."""
    items, steps = 0, len(training_data)
    if synthetic:
        # The device makes its own inputs, so the loader stays out of the measurement, as in
        # the tutorial; stopped, its process cannot preload the next epoch beside the model.
        training_data.terminate()
    with catchtime() as t:
        if synthetic:
            for _ in range(steps):
                training_model(*first_batch)
                items += first_batch[1].shape[0]
        else:
            for data, labels in training_data:
                training_model(data, labels)
                items += labels.shape[0]
    print(f"IPU throughput: {items / t.seconds:.2f} items/s")
    print(f"{'Synthetic data' if synthetic else 'DataLoader with'} training execution time: "
          f"{t.seconds:.2f} s")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--synthetic-data", action="store_true",
                        help="measure the model on inputs made on the device "
                             "(opts.enableSyntheticData(True)) instead of the loader's")
    parser.add_argument("--replicas", type=int, default=1,
                        help="replication factor: model copies sharing each step (default: 1)")
    parser.add_argument("--device-iterations", type=int, default=50,
                        help="optimiser steps per call of the model (default: 50)")
    parser.add_argument("--batch-size", type=int, default=16,
                        help="micro-batch size (default: 16)")
    parser.add_argument("--num-workers", type=int, default=4,
                        help="worker processes of the loader (default: 4)")
    parser.add_argument("--items", type=int, default=10000,
                        help="images in the random dataset (default: 10000)")
    parser.add_argument("--image-size", type=int, default=128,
                        help="height and width of the images (default: 128)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    dataset = random_dataset(args.items, args.image_size, seed=args.seed)

    opts = poptorch.Options()
    opts.deviceIterations(args.device_iterations)
    opts.replicationFactor(args.replicas)
    opts.enableSyntheticData(args.synthetic_data)

    model = ClassificationModel(args.image_size)
    training_model = poptorch.trainingModel(
        model, opts,
        poptorch.optim.SGD(model.parameters(), lr=0.001, momentum=0.9, use_combined_accum=False))
    training_data = poptorch.DataLoader(
        opts, dataset=dataset, batch_size=args.batch_size, shuffle=True, drop_last=True,
        num_workers=args.num_workers, mode=poptorch.DataLoaderMode.Async,
        async_options={"early_preload": True})
    steps = len(training_data)
    if steps == 0:
        raise SystemExit(f"{args.items} items make no step of {training_data.combinedBatchSize} "
                         "(batch size x device iterations x replicas); raise --items or lower "
                         "the others")

    print(f"Random dataset: {args.items} images 1x{args.image_size}x{args.image_size}; "
          f"Async loader with {args.num_workers} worker(s); "
          f"{'synthetic' if args.synthetic_data else 'real'} data for the model.")
    first_batch = next(iter(training_data))
    training_model.compile(*first_batch)  # outside the timings, as the tutorial's warm-up
    print(f"Evaluating: {steps} steps of {training_data.combinedBatchSize} items "
          f"(batch size {args.batch_size} x device iterations {args.device_iterations} x "
          f"replicas {args.replicas})")
    loader_throughput(training_data)
    model_throughput(training_model, training_data, first_batch, synthetic=args.synthetic_data)
    training_model.detachFromDevice()
    training_data.terminate()


if __name__ == "__main__":
    main()
