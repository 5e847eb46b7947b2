"""The "Multi-IPU programming" hands-on session's ResNet runs as PopTorch users wrote them.

Unmodified PopTorch: it imports `poptorch`, never pipetorch. Run it on pipetorch with

    pipetorch run examples/poptorch_style/multi_device.py                     # one IPU
    pipetorch run examples/poptorch_style/multi_device.py --replicas 2        # data parallel
    pipetorch run examples/poptorch_style/multi_device.py --model-parallel    # layer4 on IPU 1
    pipetorch run examples/poptorch_style/multi_device.py --model-parallel --replicas 2 \
        --gradient-accumulation 3

The session trains torchvision's resnet50; this uses resnet18 when torchvision is installed,
else the small ResNet of examples/multi_device.py, on generated 32x32 images.
"""
import argparse
import os
import sys
import time

import poptorch
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from multi_device import build_model, generated_images  # noqa: E402 - in examples/


class ModelWithLoss(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model
        self.loss = torch.nn.CrossEntropyLoss()

    def forward(self, x, labels):
        output = self.model(x)
        return output, self.loss(output, labels)


parser = argparse.ArgumentParser()
parser.add_argument("--replicas", type=int, default=1)
parser.add_argument("--model-parallel", action="store_true")
parser.add_argument("--gradient-accumulation", type=int, default=1)
parser.add_argument("--device-iterations", type=int, default=4)
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--items", type=int, default=1024)
args = parser.parse_args()

opts = poptorch.Options().randomSeed(42)  # also seeds torch: the same model every run
opts.deviceIterations(args.device_iterations)
opts.Training.gradientAccumulation(args.gradient_accumulation)
opts.replicationFactor(args.replicas)

model, description = build_model("auto", "group", 8)
if args.model_parallel:
    model.layer4 = poptorch.BeginBlock(model.layer4, ipu_id=1)

training_data = poptorch.DataLoader(opts, dataset=generated_images(args.items, 32, seed=0),
                                    batch_size=args.batch_size, shuffle=True, drop_last=True)
poptorch_model = poptorch.trainingModel(
    ModelWithLoss(model), options=opts,
    optimizer=poptorch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
print(f"{description}: {'2 IPUs' if args.model_parallel else '1 IPU'} x {args.replicas} "
      f"replica(s), {training_data.combinedBatchSize} images per step")

for epoch in range(1, args.epochs + 1):
    start, losses = time.time(), []
    for data, labels in training_data:
        _, loss = poptorch_model(data, labels)
        losses.append(loss.mean().item())
    seconds = time.time() - start
    print(f"Epoch {epoch}: loss {sum(losses) / len(losses):.4f}, "
          f"{len(training_data) * training_data.combinedBatchSize / seconds:.1f} images/s")

poptorch_model.detachFromDevice()
