"""Graphcore's PopTorch pipelining tutorial (mnist_pipeline.py) as PopTorch users wrote it.

Unmodified PopTorch: it imports `poptorch`, never pipetorch. Run it on pipetorch with

    pipetorch run examples/poptorch_style/mnist_pipeline.py --strategy sharded

The data is MNIST's IDX files from --data-dir when given, else scikit-learn's bundled digits
upsampled to 28x28 (no download). The defaults suit the 1477 training digits; the tutorial's
MNIST settings are --batch-size 40 --device-iterations 10 --gradient-accumulation 10
--inference-iterations 100.
"""
import argparse
import os
import sys

import poptorch
import torch
import torch.nn as nn
from tqdm import tqdm

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from mnist_data import digits_datasets, mnist_datasets  # noqa: E402 - in examples/


class ConvLayer(nn.Module):
    def __init__(self, in_channels, num_filters, kernel_size, pool_size):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, num_filters, kernel_size=kernel_size)
        self.pool = nn.MaxPool2d(kernel_size=pool_size)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(self.pool(self.conv(x)))


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


class TrainingModelWithLoss(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model
        self.loss = torch.nn.CrossEntropyLoss()

    def forward(self, args, labels=None):
        output = self.model(args)
        if labels is None:
            return output
        with poptorch.Block("B4"):
            loss = self.loss(output, labels)
        return output, loss


def accuracy(predictions, labels):
    _, ind = torch.max(predictions, 1)
    labels = labels[-predictions.size()[0]:]
    return torch.sum(torch.eq(ind, labels)).item() / labels.size()[0] * 100.0


def train(training_model, training_data):
    nr_steps = len(training_data)
    for epoch in range(1, args.epochs + 1):
        print(f"Epoch {epoch}/{args.epochs}")
        bar = tqdm(training_data, total=nr_steps)
        for data, labels in bar:
            preds, losses = training_model(data, labels)
            mean_loss = torch.mean(losses).item()
            acc = accuracy(preds, labels)
            bar.set_description(f"Loss:{mean_loss:0.4f} | Accuracy:{acc:0.2f}%")


def test(inference_model, test_data):
    nr_steps = len(test_data)
    sum_acc = 0.0
    for data, labels in tqdm(test_data, total=nr_steps):
        output = inference_model(data)
        sum_acc += accuracy(output, labels)
    print(f"Accuracy on test set: {sum_acc / len(test_data):0.2f}%")


parser = argparse.ArgumentParser(description="MNIST training in PopTorch")
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--device-iterations", type=int, default=4)
parser.add_argument("--gradient-accumulation", type=int, default=4)
parser.add_argument("--inference-iterations", type=int, default=10)
parser.add_argument("--test-batch-size", type=int, default=8)
parser.add_argument("--epochs", type=int, default=10)
parser.add_argument("--learning-rate", type=float, default=0.001)
parser.add_argument("--strategy", choices=["pipelined", "sharded"], default="pipelined")
parser.add_argument("--offload-optimiser", action="store_true")
parser.add_argument("--profile", action="store_true")
parser.add_argument("--profile-dir", default="profile")
parser.add_argument("--data-dir", default=None, help="MNIST IDX files (default: sklearn digits)")
parser.add_argument("--max-train-items", type=int, default=None)
args = parser.parse_args()

if args.data_dir:
    train_dataset, test_dataset = mnist_datasets(args.data_dir,
                                                 max_train_items=args.max_train_items)
else:
    train_dataset, test_dataset = digits_datasets(max_train_items=args.max_train_items)

train_opts = poptorch.Options()
train_opts.deviceIterations(args.device_iterations)
train_opts.Training.gradientAccumulation(args.gradient_accumulation)
if args.profile:
    train_opts.enableProfiling(args.profile_dir)
stages = (poptorch.Stage("B1", "B2").ipu(0), poptorch.Stage("B3", "B4").ipu(1))
if args.strategy == "pipelined":
    train_opts.setExecutionStrategy(poptorch.PipelinedExecution(*stages))
else:
    train_opts.setExecutionStrategy(poptorch.ShardedExecution(*stages))
if args.offload_optimiser:
    train_opts.TensorLocations.setOptimizerLocation(
        poptorch.TensorLocationSettings().useOnChipStorage(False))
# Warning: impacts performance
train_opts.outputMode(poptorch.OutputMode.All)

training_data = poptorch.DataLoader(train_opts, train_dataset, batch_size=args.batch_size,
                                    shuffle=True, mode=poptorch.DataLoaderMode.Async)

model = Network()
training_model = poptorch.trainingModel(
    TrainingModelWithLoss(model), train_opts,
    optimizer=poptorch.optim.AdamW(model.parameters(), lr=args.learning_rate))
train(training_model, training_data)
training_model.detachFromDevice()
training_data.terminate()

inf_options = train_opts.clone()
inf_options.Training.gradientAccumulation(1)
inf_options.deviceIterations(args.inference_iterations)
test_data = poptorch.DataLoader(inf_options, test_dataset, batch_size=args.test_batch_size,
                                shuffle=True, drop_last=True)
inference_model = poptorch.inferenceModel(model, inf_options)
test(inference_model, test_data)
inference_model.detachFromDevice()
