"""Train a ResNet on one device, data parallel, model parallel, or both: the multi-IPU day.

The runs of the "Multi-IPU programming" hands-on session (data parallel and model parallel
ResNet training) on pipetorch, with the session's options and the same one-line split:

    python examples/multi_device.py                                # one device
    python examples/multi_device.py --replicas 2                   # data parallel
    python examples/multi_device.py --split-at layer4              # model parallel: 2 stages
    python examples/multi_device.py --split-at layer4 --replicas 2 --gradient-accumulation 3

`--replicas N` is `opts.replicationFactor(N)`: each step trains N copies of the model on
different micro-batches and averages their gradients. `--split-at layer4` is
`model.layer4 = poptorch.BeginBlock(model.layer4, ipu_id=1)`: everything before layer4 is
stage 0, layer4 onwards (and the loss) is stage 1, pipelined (PipelinedExecution, the
default). Each logical device of each replica runs in its own worker process, with every stage
placed on it (here one stage per device; 2 devices x 2 replicas: 4 workers), and the replicas'
gradients are summed by an all-reduce before each step. The program prints the layout it runs
(stages x replicas) and which process runs each.

The model is torchvision's resnet18 when torchvision is installed (`--model auto`), else a
small ResNet of the same layout defined here. Normalisation is GroupNorm by default: it has
no running statistics, so replicas share every buffer; `--norm batch` uses BatchNorm, and with
replicas each keeps its own statistics (`opts.broadcastBuffers(False)`) in its own worker. The
images are
generated (32x32 noisy versions of 10 random patterns, the label saying which), so it runs
offline and the loss falls within an epoch or two.
"""
from __future__ import annotations

import argparse
import functools
import os
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import pipetorch as poptorch
from pipetorch.parallel.layout.placement import live_workers

CLASSES = 10
LAYERS = ("layer1", "layer2", "layer3", "layer4")
Norm = Callable[[int], nn.Module]


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with normalisation and a residual connection (torchvision's)."""

    def __init__(self, inputs: int, planes: int, stride: int, norm: Norm) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = norm(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = norm(planes)
        self.relu = nn.ReLU()
        self.downsample = None
        if stride != 1 or inputs != planes:
            self.downsample = nn.Sequential(
                nn.Conv2d(inputs, planes, 1, stride=stride, bias=False), norm(planes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


class SmallResNet(nn.Module):
    """torchvision's ResNet layout (stem, layer1..layer4, pooling, fc), one block per layer."""

    def __init__(self, *, width: int = 8, num_classes: int = CLASSES, norm: Norm) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False)
        self.bn1 = norm(width)
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.layer1 = BasicBlock(width, width, 1, norm)
        self.layer2 = BasicBlock(width, width * 2, 2, norm)
        self.layer3 = BasicBlock(width * 2, width * 4, 2, norm)
        self.layer4 = BasicBlock(width * 4, width * 8, 2, norm)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(width * 8, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class ClassifierWithLoss(nn.Module):
    """The model plus its cross-entropy loss, returned with the logits for training."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.loss = nn.CrossEntropyLoss()

    def forward(self, images: torch.Tensor, labels: torch.Tensor):
        logits = self.model(images)
        return logits, self.loss(logits, labels)


def norm_layer(kind: str) -> Norm:
    """BatchNorm2d, or GroupNorm of 4 groups (a partial, not a lambda: the model pickles)."""
    return nn.BatchNorm2d if kind == "batch" else functools.partial(nn.GroupNorm, 4)


def build_model(kind: str, norm: str, width: int) -> tuple[nn.Module, str]:
    """torchvision's resnet18 (`auto` when installed, or `resnet18`), else SmallResNet."""
    if kind in ("auto", "resnet18"):
        try:
            import torchvision
        except ImportError:
            if kind == "resnet18":
                raise SystemExit("--model resnet18 needs torchvision (pip install torchvision); "
                                 "use --model small or auto") from None
        else:
            model = torchvision.models.resnet18(num_classes=CLASSES, norm_layer=norm_layer(norm))
            return model, f"torchvision resnet18 with {norm} norm"
    model = SmallResNet(width=width, norm=norm_layer(norm))
    return model, f"small ResNet (width {width}, one block per layer) with {norm} norm"


def generated_images(items: int, image_size: int, *, seed: int) -> TensorDataset:
    """Noisy images of CLASSES smooth random patterns; the label is the pattern's index."""
    generator = torch.Generator().manual_seed(seed)
    patterns = torch.randn(CLASSES, 3, 4, 4, generator=generator)
    patterns = F.interpolate(patterns, size=(image_size, image_size), mode="bilinear",
                             align_corners=False)
    labels = torch.randint(0, CLASSES, (items,), generator=generator)
    noise = torch.randn(items, 3, image_size, image_size, generator=generator)
    return TensorDataset(patterns[labels] + noise, labels)


def layout(model: nn.Module, split_at: str | None, replicas: int) -> str:
    """What runs where: stages (with their first and last modules) x replicas."""
    names = [name for name, _ in model.named_children()]
    cut = names.index(split_at) if split_at else len(names)
    groups = [names[:cut], names[cut:]] if split_at else [names]
    stages = [f"stage {i} (ipu {i}): {group[0]} .. {group[-1]}" + (
        " + loss" if i == len(groups) - 1 else "") for i, group in enumerate(groups)]
    return (f"Device layout: {len(groups)} stage(s) x {replicas} replica(s) = "
            f"{len(groups) * replicas} logical device(s); " + "; ".join(stages))


def processes(replicas: int) -> str:
    """Which process runs each stage, from the registry the device workers write."""
    workers = sorted((w for w in live_workers() if w["host_pid"] == os.getpid()),
                     key=lambda w: (w.get("replica", 0), w["ipu"]))
    if not workers:
        return f"Processes: all stages run in this process (pid {os.getpid()})."

    def name(worker: dict) -> str:
        stages = worker["stages"]
        held = f"stage{'s' if len(stages) > 1 else ''} {','.join(map(str, stages))}"
        return f"{held} of replica {worker.get('replica', 0)}" if replicas > 1 else held

    return "Processes: " + ", ".join(
        f"{name(w)} in pid {w['pid']} on {w['device']} ({w['threads']} thread(s))"
        for w in workers) + "."


def train(training_model: poptorch.PoplarExecutor, training_data: poptorch.DataLoader,
          epochs: int) -> tuple[int, float]:
    """Train `epochs` epochs, printing loss, accuracy and images/s; returns (images, seconds)."""
    total_images, total_seconds = 0, 0.0
    for epoch in range(1, epochs + 1):
        images = correct = 0
        losses = []
        start = time.perf_counter()
        for data, labels in training_data:
            logits, loss = training_model(data, labels)  # OutputMode.All: every micro-batch
            losses.append(loss.reshape(-1))
            correct += (logits.argmax(dim=1) == labels).sum().item()
            images += labels.shape[0]
        seconds = time.perf_counter() - start
        total_images, total_seconds = total_images + images, total_seconds + seconds
        print(f"Epoch {epoch}/{epochs}: loss {torch.cat(losses).mean().item():.4f}, accuracy "
              f"{100.0 * correct / images:.2f}%, {images} images in {seconds:.2f} s, "
              f"{images / seconds:.1f} images/s")
    return total_images, total_seconds


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=1,
                        help="data parallel: replication factor (default: 1)")
    parser.add_argument("--split-at", choices=LAYERS, default=None,
                        help="model parallel: this layer starts stage 1 on ipu 1 "
                             "(default: one stage)")
    parser.add_argument("--gradient-accumulation", type=int, default=None,
                        help="micro-batches per replica per optimiser step (default: 1, or 3 "
                             "with --split-at, the least a 2-stage pipeline trains with)")
    parser.add_argument("--device-iterations", type=int, default=4,
                        help="optimiser steps per call of the model (default: 4)")
    parser.add_argument("--batch-size", type=int, default=8, help="micro-batch size (default: 8)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs (default: 3)")
    parser.add_argument("--items", type=int, default=2048,
                        help="generated training images (default: 2048)")
    parser.add_argument("--image-size", type=int, default=32,
                        help="height and width of the images (default: 32)")
    parser.add_argument("--model", choices=("auto", "resnet18", "small"), default="auto",
                        help="auto: torchvision's resnet18 when installed, else small")
    parser.add_argument("--width", type=int, default=8,
                        help="channels of the small ResNet's first layer (default: 8)")
    parser.add_argument("--norm", choices=("group", "batch"), default="group",
                        help="normalisation layers (default: group)")
    parser.add_argument("--learning-rate", type=float, default=0.05,
                        help="SGD learning rate, momentum 0.9 (default: 0.05)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    stages = 2 if args.split_at else 1
    accumulation = args.gradient_accumulation or 2 * stages - 1
    torch.manual_seed(args.seed)
    dataset = generated_images(args.items, args.image_size, seed=args.seed)

    opts = poptorch.Options().randomSeed(args.seed)
    opts.deviceIterations(args.device_iterations)
    opts.replicationFactor(args.replicas)
    opts.Training.gradientAccumulation(accumulation)
    opts.outputMode(poptorch.OutputMode.All)
    if args.norm == "batch" and args.replicas > 1:
        opts.broadcastBuffers(False)

    model, description = build_model(args.model, args.norm, args.width)
    if args.split_at:
        setattr(model, args.split_at, poptorch.BeginBlock(getattr(model, args.split_at), ipu_id=1))
    training_data = poptorch.DataLoader(opts, dataset, batch_size=args.batch_size, shuffle=True)
    if len(training_data) == 0:
        raise SystemExit(f"{args.items} images make no call of {training_data.combinedBatchSize}"
                         "; raise --items or lower the batch settings")
    print(f"Model: {description}; {args.items} generated {args.image_size}x{args.image_size} "
          f"images of {CLASSES} classes.")
    print(f"Batching: batch size {args.batch_size} x gradient accumulation {accumulation} x "
          f"replicas {args.replicas} x device iterations {args.device_iterations} = "
          f"{training_data.combinedBatchSize} images per call, {len(training_data)} calls per "
          f"epoch.")
    print(layout(model, args.split_at, args.replicas))

    training_model = poptorch.trainingModel(
        ClassifierWithLoss(model), opts,
        poptorch.optim.SGD(model.parameters(), lr=args.learning_rate, momentum=0.9))
    training_model.compile(*next(iter(training_data)))
    print(processes(args.replicas))
    images, seconds = train(training_model, training_data, args.epochs)
    training_model.destroy()
    print(f"Trained {images} images in {seconds:.2f} s: {images / seconds:.1f} images/s on "
          f"{stages} stage(s) x {args.replicas} replica(s).")


if __name__ == "__main__":
    main()
