"""The "IPU optimization" hands-on session's main.py as PopTorch users wrote it.

Unmodified PopTorch: it imports `poptorch`, never pipetorch. Run it on pipetorch with

    pipetorch run examples/poptorch_style/resnet_optimisation.py --batch-size 16 \
        --precision 16.16 --gradient-accumulation 8 --device-iterations 4 --eight-bit-io \
        --async-dataloader

A ResNet (torchvision's resnet18 when installed, else the ResNet of
examples/resnet_optimisation.py) pipelined over 2 IPUs from the middle of layer3, trained on
CIFAR-10's python batches from --data-dir, else on generated stand-in images.
"""
import argparse
import os
import sys

import poptorch
import torch
from tqdm import tqdm

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from cifar_data import (  # noqa: E402 - the data helpers live in examples/
    IMAGENET_STATISTICS, CifarImages, generated_images, normalize, read_cifar,
)


class ModelWithNormalization(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, dtype: torch.dtype):
        super().__init__()
        self.model = model
        self.dtype = dtype
        self.register_buffer("mean", torch.tensor(IMAGENET_STATISTICS["mean"]), persistent=False)
        self.register_buffer("std", torch.tensor(IMAGENET_STATISTICS["std"]), persistent=False)

    def forward(self, img):
        img = img.to(self.dtype)
        return self.model(normalize(img, self.mean.to(self.dtype), self.std.to(self.dtype)))


class ToDtype(torch.nn.Module):
    # 16.32: fp16 images, fp32 model. The IPU upcasts them; plain torch wants it spelt out.
    def __init__(self, dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, img):
        return img.to(self.dtype)


class ModelWithLoss(torch.nn.Module):
    def __init__(self, model, criterion):
        super().__init__()
        self.model = model
        self.criterion = criterion

    def forward(self, img, labels):
        output = self.model(img)
        return output, self.criterion(output, labels)


def get_model():
    try:
        import torchvision
        model = torchvision.models.resnet18(num_classes=10)
    except ImportError:
        from resnet_optimisation import ResNet
        model = ResNet(width=args.width, blocks=2)
    middle = len(model.layer3) // 2
    model.layer3[middle] = poptorch.BeginBlock(model.layer3[middle], ipu_id=1)
    return model


def accuracy(output, labels):
    labels = labels[-output.size(0):]
    return (output.argmax(dim=1) == labels).float().mean().item() * 100


parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--precision", choices=["16.16", "16.32", "32.32"], default="16.16")
parser.add_argument("--gradient-accumulation", type=int, default=3)
parser.add_argument("--device-iterations", type=int, default=1)
parser.add_argument("--eight-bit-io", action="store_true")
parser.add_argument("--async-dataloader", action="store_true")
parser.add_argument("--replicas", type=int, default=1)
parser.add_argument("--epochs", type=int, default=5)
parser.add_argument("--data-dir", default=None)
parser.add_argument("--dataset-size", type=int, default=2048)
parser.add_argument("--width", type=int, default=16)
args = parser.parse_args()
print(args)

input_dtype = torch.float16 if args.precision[:2] == "16" else torch.float32
model_dtype = torch.float16 if args.precision[-2:] == "16" else torch.float32

if args.data_dir:
    images, labels = read_cifar(args.data_dir, "train", max_items=args.dataset_size)
else:
    images, labels = generated_images(args.dataset_size, seed=0)
train_dataset = CifarImages(images, labels, flip=True,
                            dtype=None if args.eight_bit_io else input_dtype)

opts = poptorch.Options()
opts.deviceIterations(args.device_iterations)
opts.replicationFactor(args.replicas)
opts.Training.gradientAccumulation(args.gradient_accumulation)
if args.replicas > 1:
    opts.broadcastBuffers(False)

mode = poptorch.DataLoaderMode.Async if args.async_dataloader else poptorch.DataLoaderMode.Sync
train_dataloader = poptorch.DataLoader(opts,
                                       train_dataset,
                                       batch_size=args.batch_size,
                                       shuffle=True,
                                       mode=mode)

model = get_model()
if input_dtype != model_dtype:
    model = torch.nn.Sequential(ToDtype(model_dtype), model)
if args.eight_bit_io:
    model = ModelWithNormalization(model, dtype=input_dtype)
model = ModelWithLoss(model, torch.nn.CrossEntropyLoss()).to(model_dtype)

if args.precision[-3:] == ".16":
    optimizer = poptorch.optim.AdamW(model.parameters(), lr=0.001,
                                     loss_scaling=1000,
                                     accum_type=torch.float16,
                                     first_order_momentum_accum_type=torch.float16,
                                     second_order_momentum_accum_type=torch.float32)
else:
    optimizer = poptorch.optim.AdamW(model.parameters(), lr=0.001)

poptorch_model = poptorch.trainingModel(model, opts, optimizer)

for epoch in range(1, args.epochs + 1):
    losses, accs = [], []
    bar = tqdm(train_dataloader, desc=f"[Epoch {epoch:02d}]")
    for img, label in bar:
        output, loss = poptorch_model(img, label)
        losses.append(loss.float().mean().item())
        accs.append(accuracy(output, label))
        bar.set_postfix({"loss": losses[-1], "acc": accs[-1]})
    bar.close()
    print(f"[Epoch {epoch:02d}] loss: {sum(losses) / len(losses):.3f}, "
          f"acc: {sum(accs) / len(accs):.1f}")

poptorch_model.detachFromDevice()
if args.async_dataloader:
    train_dataloader.terminate()
