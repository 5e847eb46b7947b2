"""Train a ResNet pipelined over 2 devices on CIFAR-10, one optimisation at a time: the seed's day.

Graphcore's "IPU optimization" hands-on session on pipetorch: a ResNet split over 2 devices
with `poptorch.BeginBlock` on a block of layer3, trained on CIFAR-10, then made faster step by
step with the session's flags:

    python examples/resnet_optimisation.py --batch-size 16 --precision 32.32 --gradient-accumulation 3 --epochs 1
    python examples/resnet_optimisation.py --batch-size 16 --precision 16.16 --gradient-accumulation 8
    python examples/resnet_optimisation.py --batch-size 16 --precision 16.16 --gradient-accumulation 8 \
        --device-iterations 4 --eight-bit-io --async-dataloader

--precision IN.MODEL: 16.16 is `model.half()` fed fp16 images (AdamW with loss scaling 1000 and
fp16 accumulators, as the seed; --auto-loss-scaling when gradients overflow); 16.32 feeds fp16 images to the fp32 model (PopTorch upcasts
them; here the model casts them); 32.32 is fp32 throughout. --eight-bit-io sends the images as
uint8 and normalises them inside the model (4x fewer bytes than fp32 per call);
--async-dataloader loads the next batches in a separate process (DataLoaderMode.Async).

Data: CIFAR-10's python batches from --data-dir (the folder extracted from
cifar-10-python.tar.gz; nothing is downloaded), else generated 32x32 images of 10 classes
(a smooth pattern per class plus noise), which it says. The model is a ResNet-18-shaped net
defined here (--width, --blocks, small enough for a CPU), or torchvision's resnet18 with
--torchvision when torchvision is installed.
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import torch
import torch.nn as nn
from tqdm import tqdm

import pipetorch as poptorch
from cifar_data import (
    CLASSES, IMAGENET_STATISTICS, CifarImages, DataError, generated_images, normalize,
    read_cifar, resize,
)
from multi_device import BasicBlock

PRECISIONS = ("16.16", "16.32", "32.32")


class ResNet(nn.Module):
    """torchvision's ResNet layout (stem, layer1..layer4 of BasicBlocks, pooling, fc)."""

    def __init__(self, *, width: int = 16, blocks: int = 2, num_classes: int = len(CLASSES),
                 ) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        channels = [width, width, 2 * width, 4 * width, 8 * width]
        for i in range(1, 5):
            layer = [BasicBlock(channels[i - 1] if b == 0 else channels[i], channels[i],
                                2 if i > 1 and b == 0 else 1, nn.BatchNorm2d)
                     for b in range(blocks)]
            setattr(self, f"layer{i}", nn.Sequential(*layer))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class ModelWithNormalization(nn.Module):
    """8-bit I/O: uint8 images in, cast to `dtype` and normalised on the device (the seed's)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.model, self.dtype = model, dtype
        # Buffers, so they travel with the model to its device; not saved in checkpoints.
        self.register_buffer("mean", torch.tensor(IMAGENET_STATISTICS["mean"]), persistent=False)
        self.register_buffer("std", torch.tensor(IMAGENET_STATISTICS["std"]), persistent=False)

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        img = img.to(self.dtype)
        return self.model(normalize(img, self.mean.to(self.dtype), self.std.to(self.dtype)))


class CastInputs(nn.Module):
    """16.32: fp16 images into an fp32 model; PopTorch upcasts them implicitly, torch needs it said."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        # A dtype, not a look at the weights: those may live in the other stage.
        self.model, self.dtype = model, dtype

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        return self.model(img.to(self.dtype))


class ModelWithLoss(nn.Module):
    """The classifier and its criterion: returns (logits, loss) as PopTorch training expects."""

    def __init__(self, model: nn.Module, criterion: nn.Module) -> None:
        super().__init__()
        self.model, self.criterion = model, criterion

    def forward(self, images: torch.Tensor, labels: torch.Tensor):
        output = self.model(images)
        return output, self.criterion(output, labels)


def build_resnet(args: argparse.Namespace) -> tuple[nn.Module, str]:
    """torchvision's resnet18 with --torchvision when installed, else the ResNet defined here."""
    own = (f"ResNet of torchvision's layout defined here (width {args.width}, {args.blocks} "
           f"block(s) per layer)")
    if args.torchvision:
        try:
            import torchvision
        except ImportError:
            return (ResNet(width=args.width, blocks=args.blocks),
                    f"{own}: --torchvision needs torchvision, which is not installed "
                    "(pip install torchvision)")
        return torchvision.models.resnet18(num_classes=len(CLASSES)), "torchvision resnet18"
    return ResNet(width=args.width, blocks=args.blocks), own


def split(resnet: nn.Module, name: str | None) -> str:
    """`BeginBlock` at block `name` (default: the middle of layer3): it and all after on ipu 1."""
    name = name or f"layer3.{len(resnet.layer3) // 2}"
    parent_name, _, child = name.rpartition(".")
    try:
        parent = resnet.get_submodule(parent_name)
        block = parent.get_submodule(child)
    except AttributeError:
        blocks = [f"layer{i}.{b}" for i in range(1, 5) for b in range(len(getattr(resnet, f"layer{i}")))]
        raise SystemExit(f"--split-at {name}: the model has no such block; choose one of "
                         f"{', '.join(blocks)}") from None
    setattr(parent, child, poptorch.BeginBlock(block, ipu_id=1))  # the seed's one-line split
    return name


def load_images(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor, str]:
    """uint8 training images, their labels, and where they came from."""
    if args.data_dir is None:
        images, labels = generated_images(args.dataset_size or 2048, seed=args.seed)
        source = (f"{len(labels)} generated 32x32 images of {len(CLASSES)} classes (no "
                  "--data-dir: a stand-in for CIFAR-10, one pattern per class plus noise)")
    else:
        try:
            images, labels = read_cifar(args.data_dir, "train", max_items=args.dataset_size)
        except DataError as err:
            raise SystemExit(str(err)) from None
        source = f"{len(labels)} CIFAR-10 training images from {args.data_dir}"
    if args.image_size != images.shape[-1]:
        images = resize(images, args.image_size)
        source += f", resized to {args.image_size}x{args.image_size}"
    return images, labels, source


def accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Percentage right; the logits may cover only the call's last micro-batch (OutputMode.Final)."""
    labels = labels[-logits.shape[0]:]
    return (logits.argmax(dim=1) == labels).float().mean().item() * 100.0


def train(training_model: poptorch.PoplarExecutor, loader: poptorch.DataLoader,
          epochs: int) -> tuple[int, float]:
    """The seed's loop: a bar per epoch, then `[Epoch NN] loss: X, acc: Y`; (images, seconds)."""
    images, seconds = 0, 0.0
    for epoch in range(1, epochs + 1):
        losses, accuracies = [], []
        start = time.perf_counter()
        bar = tqdm(loader, desc=f"[Epoch {epoch:02d}]")
        for data, labels in bar:
            # Training returns the last micro-batch's output (OutputMode.Final, as the seed).
            output, loss = training_model(data, labels)
            losses.append(loss.float().mean().item())
            accuracies.append(accuracy(output, labels))
            images += len(labels)
            bar.set_postfix({"loss": losses[-1], "acc": accuracies[-1]})
        bar.close()
        seconds += time.perf_counter() - start
        print(f"[Epoch {epoch:02d}] loss: {sum(losses) / len(losses):.3f}, "
              f"acc: {sum(accuracies) / len(accuracies):.1f}", flush=True)
    return images, seconds


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


LOSS_SCALING = 1000.0


def make_optimizer(model: nn.Module, *, half: bool, lr: float) -> torch.optim.Optimizer:
    """The seed's AdamW: for an fp16 model, with loss scaling 1000 and fp16 accumulators."""
    if not half:
        return poptorch.optim.AdamW(model.parameters(), lr=lr)
    return poptorch.optim.AdamW(model.parameters(), lr=lr, loss_scaling=LOSS_SCALING,
                                accum_type=torch.float16,
                                first_order_momentum_accum_type=torch.float16,
                                second_order_momentum_accum_type=torch.float32)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=positive_int, default=16,
                        help="micro-batch size (default: 16; the seed's IPUs took 64)")
    parser.add_argument("--precision", choices=PRECISIONS, default="32.32",
                        help="input.model float bits (default: 32.32)")
    parser.add_argument("--gradient-accumulation", type=positive_int, default=3,
                        help="micro-batches per optimiser step; a 2-stage pipeline needs 3 or "
                             "more (default: 3)")
    parser.add_argument("--device-iterations", type=positive_int, default=1,
                        help="optimiser steps per call of the model (default: 1)")
    parser.add_argument("--eight-bit-io", action="store_true",
                        help="send uint8 images; the model casts and normalises them")
    parser.add_argument("--async-dataloader", "--async-data-loader", action="store_true",
                        help="load batches in a separate process (DataLoaderMode.Async)")
    parser.add_argument("--replicas", type=positive_int, default=1,
                        help="replication factor: copies of the 2-stage pipeline (default: 1)")
    parser.add_argument("--epochs", type=positive_int, default=5, help="epochs (default: 5)")
    parser.add_argument("--auto-loss-scaling", action="store_true",
                        help="adjust the loss scaling on overflow (setAutomaticLossScaling); "
                             "for fp16 models whose gradients overflow at 1000")
    parser.add_argument("--learning-rate", type=float, default=0.001,
                        help="AdamW learning rate (default: 0.001)")
    parser.add_argument("--data-dir", default=None,
                        help="folder of CIFAR-10's python batches (cifar-10-batches-py or its "
                             "parent); default: generated images")
    parser.add_argument("--dataset-size", type=positive_int, default=None,
                        help="train on N images (default: all of CIFAR-10, or 2048 generated)")
    parser.add_argument("--image-size", type=positive_int, default=32,
                        help="resize images to this side (default: 32; the seed used 64)")
    parser.add_argument("--torchvision", action="store_true",
                        help="torchvision's resnet18 instead of the ResNet defined here")
    parser.add_argument("--width", type=positive_int, default=16,
                        help="channels of the own ResNet's first layer (default: 16)")
    parser.add_argument("--blocks", type=positive_int, default=2,
                        help="blocks per layer of the own ResNet (default: 2, ResNet-18's)")
    parser.add_argument("--split-at", default=None,
                        help="block that starts ipu 1, e.g. layer3.1 (default: middle of layer3)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    print(args)
    torch.manual_seed(args.seed)
    input_dtype = torch.float16 if args.precision[:2] == "16" else torch.float32
    model_dtype = torch.float16 if args.precision[-2:] == "16" else torch.float32

    images, labels, source = load_images(args)
    train_dataset = CifarImages(images, labels, flip=True,
                                dtype=None if args.eight_bit_io else input_dtype)
    opts = poptorch.Options().randomSeed(args.seed)
    opts.deviceIterations(args.device_iterations)
    opts.replicationFactor(args.replicas)
    opts.Training.gradientAccumulation(args.gradient_accumulation)
    if args.replicas > 1:
        opts.broadcastBuffers(False)  # each replica keeps its own BatchNorm statistics
    if args.auto_loss_scaling:
        opts.Training.setAutomaticLossScaling(True)
    mode = poptorch.DataLoaderMode.Async if args.async_dataloader else poptorch.DataLoaderMode.Sync
    loader = poptorch.DataLoader(opts, train_dataset, batch_size=args.batch_size, shuffle=True,
                                 mode=mode)
    if len(loader) == 0:
        raise SystemExit(f"{len(labels)} images make no call of {loader.combinedBatchSize}; raise "
                         "--dataset-size or lower the batch settings")

    resnet, description = build_resnet(args)
    first = split(resnet, args.split_at)
    model = resnet
    if input_dtype != model_dtype:
        model = CastInputs(model, model_dtype)
    if args.eight_bit_io:
        model = ModelWithNormalization(model, dtype=input_dtype)
    model = ModelWithLoss(model, nn.CrossEntropyLoss()).to(model_dtype)
    optimizer = make_optimizer(model, half=args.precision[-3:] == ".16", lr=args.learning_rate)

    wire = train_dataset[0][0]
    print(f"Data: {source}.")
    print(f"Model: {description}; BeginBlock at {first}: ipu 0 runs the layers before it, ipu 1 "
          f"it and the rest (pipelined).")
    print(f"Precision {args.precision}: {str(wire.dtype).removeprefix('torch.')} images to the "
          f"device{' (normalised there)' if args.eight_bit_io else ''}, "
          f"{str(model_dtype).removeprefix('torch.')} model; "
          f"{mode.name} data loader.")
    print(f"Batching: batch size {args.batch_size} x gradient accumulation "
          f"{args.gradient_accumulation} x replicas {args.replicas} x device iterations "
          f"{args.device_iterations} = {loader.combinedBatchSize} images per call "
          f"({loader.combinedBatchSize * wire.numel() * wire.element_size()} bytes of images), "
          f"{len(loader)} calls per epoch.", flush=True)

    training_model = poptorch.trainingModel(model, opts, optimizer=optimizer)
    start = time.perf_counter()
    training_model.compile(*next(iter(loader)))
    print(f"Compiled in {time.perf_counter() - start:.1f} s (not counted in the throughput).",
          flush=True)
    trained, seconds = train(training_model, loader, args.epochs)
    training_model.destroy()
    if args.async_dataloader:
        loader.terminate()
    print(f"Throughput: {trained / seconds:.1f} images/s ({trained} images in {seconds:.2f} s, "
          f"{args.epochs} epoch(s)).")


if __name__ == "__main__":
    main()
