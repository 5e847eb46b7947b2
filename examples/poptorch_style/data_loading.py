"""Graphcore's data-loading tutorial script (tuto_data_loading.py) as PopTorch users wrote it.

Unmodified PopTorch: it imports `poptorch`, never pipetorch. Run it on pipetorch with

    pipetorch run examples/poptorch_style/data_loading.py --synthetic-data --replicas 2

(`python -m pipetorch run ...` works the same). The size flags only shrink the experiment:
    pipetorch run examples/poptorch_style/data_loading.py --items 512 --image-size 28 \
        --device-iterations 4 --batch-size 8 --num-workers 1
"""
import argparse
import os
import time

import poptorch
import torch
import torch.nn as nn

executable_cache_dir = os.getenv("POPLAR_EXECUTABLE_CACHE_DIR", "/tmp/exe_cache/")


class ClassificationModel(nn.Module):
    def __init__(self, image_size=128):
        super().__init__()
        side = (image_size - 2) // 2 - 4  # 59 at 128x128: fc1 takes 12 * 59 * 59 = 41772
        self.conv1 = nn.Conv2d(1, 5, 3)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(5, 12, 5)
        self.norm = nn.GroupNorm(3, 12)
        self.fc1 = nn.Linear(12 * side * side, 100)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(100, 10)
        self.log_softmax = nn.LogSoftmax(dim=0)
        self.loss = nn.NLLLoss()

    def forward(self, x, labels=None):
        x = self.pool(self.relu(self.conv1(x)))
        x = self.norm(self.relu(self.conv2(x)))
        x = torch.flatten(x, start_dim=1)
        x = self.relu(self.fc1(x))
        x = self.log_softmax(self.fc2(x))
        if self.training:
            return x, self.loss(x, labels)
        return x


class catchtime:
    def __enter__(self):
        self.seconds = time.time()
        return self

    def __exit__(self, type, value, traceback):
        self.seconds = time.time() - self.seconds


def validate_model_performance(dataset, image_size=128, device_iterations=50, batch_size=16,
                               replicas=1, num_workers=4, synthetic_data=False):
    opts = poptorch.Options()
    opts.deviceIterations(device_iterations)
    opts.replicationFactor(replicas)
    opts.enableExecutableCaching(executable_cache_dir)
    if synthetic_data:
        opts.enableSyntheticData(True)

    model = ClassificationModel(image_size)
    training_model = poptorch.trainingModel(
        model, opts,
        poptorch.optim.SGD(model.parameters(), lr=0.001, momentum=0.9, use_combined_accum=False))

    training_data = poptorch.DataLoader(
        opts,
        dataset=dataset,
        batch_size=batch_size,
        shuffle=True,
        drop_last=True,
        num_workers=num_workers,
        mode=poptorch.DataLoaderMode.Async,
        async_options={"early_preload": True},
    )
    steps = len(training_data)
    data_batch, labels_batch = next(iter(training_data))
    training_model.compile(data_batch, labels_batch)
    print(f"Evaluating: {steps} steps of {device_iterations * batch_size * replicas} items")

    with catchtime() as t:
        for data_batch, labels_batch in training_data:
            pass

    items_per_second = (steps * device_iterations * batch_size * replicas) / t.seconds
    print(f"DataLoader throughput: {items_per_second:.2f} items/s")
    print(f"Dataloader execution time: {t.seconds:.2f} s")

    if synthetic_data:
        # With synthetic data enabled, no data is copied from the host to the IPU, so we don't
        # use the dataloader, to prevent influencing the execution time and therefore the IPU
        # throughput calculation
        with catchtime() as t:
            for _ in range(steps):
                training_model(data_batch, labels_batch)
    else:
        with catchtime() as t:
            for data, labels in training_data:
                training_model(data, labels)
            training_model.detachFromDevice()

    items_per_second = (steps * device_iterations * batch_size * replicas) / t.seconds
    print(f"IPU throughput: {items_per_second:.2f} items/s")
    print(f"Dataloader with IPU training execution time: {t.seconds:.2f} s")

    training_data.terminate()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="PopTorch data loading tutorial")
    parser.add_argument("--synthetic-data", action="store_true",
                        help="Use IPU-generated synthetic data")
    parser.add_argument("--replicas", type=int, default=1, help="IPU replication factor")
    parser.add_argument("--device-iterations", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--num-workers", type=int, default=4)
    parser.add_argument("--items", type=int, default=10000)
    parser.add_argument("--image-size", type=int, default=128)
    args = parser.parse_args()

    features = torch.randn([args.items, 1, args.image_size, args.image_size])
    labels = torch.empty([args.items], dtype=torch.long).random_(10)
    dataset = torch.utils.data.TensorDataset(features, labels)

    validate_model_performance(
        dataset,
        image_size=args.image_size,
        device_iterations=args.device_iterations,
        batch_size=args.batch_size,
        replicas=args.replicas,
        num_workers=args.num_workers,
        synthetic_data=args.synthetic_data,
    )
