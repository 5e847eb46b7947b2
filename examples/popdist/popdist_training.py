"""Data-parallel training over instances in PopDist's style: the shape of Graphcore's
`popdist_training.py`, for pipetorch.

    pipetorch run --num-instances 2 --num-replicas 4 examples/popdist/popdist_training.py
    torchrun --nproc-per-node 2 -m pipetorch run --num-replicas 4 \
        examples/popdist/popdist_training.py
    pipetorch run examples/popdist/popdist_training.py          # one instance, 4 replicas

Under a launcher each instance takes `popdist.poptorch.Options()` (its share of the replicas)
and reads its own contiguous block of the shuffled data; without one, the script replicates
4 times in one process. Every instance saves `checkpoint-instance-<index>.pt`; the weights
are the same in all of them. The data are random (nothing is downloaded).
"""
import argparse
import logging
import os

import torch
import torch.nn.functional as F

import poptorch
import popdist
import popdist.poptorch


class ModelWithLoss(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.model = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))

    def forward(self, x, y=None):
        logits = self.model(x)
        if y is None:
            return logits
        loss = F.nll_loss(F.log_softmax(logits, dim=1), y)
        return logits, poptorch.identity_loss(loss, reduction="none")


def dataset(size, seed):
    """Random samples whose labels a small network can learn, the same in every instance."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(size, 8, generator=generator)
    return torch.utils.data.TensorDataset(x, (x[:, :4].argmax(dim=1)))


def create_options(args, train):
    if not train:  # validation runs in one process: no popdist options
        opts = poptorch.Options()
        opts.Distributed.disable()
    elif popdist.isPopdistEnvSet():
        opts = popdist.poptorch.Options()
        # auto_distributed_partitioning with shuffle=True: one seed orders the data alike in
        # every instance (without it, the instances agree on one).
        opts.randomSeed(args.seed)
        # The replicas come from the launcher (--num-replicas): args.num_replicas is ignored.
        logging.info("Local replicas: %d of %d", popdist.getNumLocalReplicas(),
                     popdist.getNumTotalReplicas())
    else:
        opts = poptorch.Options().replicationFactor(args.num_replicas)
    opts.deviceIterations(args.device_iterations if train else 1)
    return opts.showCompilationProgressBar(False)


def load_data(args, opts, train):
    # auto_distributed_partitioning=True: instance p reads the p-th contiguous block.
    return poptorch.DataLoader(
        opts, dataset(args.train_size if train else 64, args.seed + (0 if train else 1)),
        batch_size=args.batch_size, shuffle=train, auto_distributed_partitioning=True)


def train(args):
    instance = popdist.getInstanceIndex() if popdist.isPopdistEnvSet() else 0
    torch.manual_seed(args.seed)
    opts = create_options(args, train=True)
    data = load_data(args, opts, train=True)
    model = ModelWithLoss()
    model.train()
    optimizer = poptorch.optim.SGD(model.parameters(), lr=args.learning_rate,
                                   momentum=args.momentum, use_combined_accum=True)
    training_model = poptorch.trainingModel(model, opts, optimizer=optimizer)
    for epoch in range(args.epochs):
        for x, y in data:
            _, loss = training_model(x, y)  # a loss per local replica
        log_in_single_instance(f"Epoch {epoch}: loss {float(torch.mean(loss)):.4f}")
    training_model.destroy()
    # Every instance saves its weights, identical in all of them, so they can be compared.
    os.makedirs(args.checkpoint_dir, exist_ok=True)
    torch.save(model.state_dict(),
               os.path.join(args.checkpoint_dir, f"checkpoint-instance-{instance}.pt"))
    if instance == 0:
        validate(args, model)


def validate(args, model):
    opts = create_options(args, train=False)
    model.eval()
    inference_model = poptorch.inferenceModel(model, opts)
    data = load_data(args, opts, train=False)
    correct = sum(int((inference_model(x).argmax(dim=1) == y).sum()) for x, y in data)
    inference_model.destroy()
    logging.info("Validation accuracy: %.3f", correct / len(data.dataset))


def log_in_single_instance(message):
    if not popdist.isPopdistEnvSet() or popdist.getInstanceIndex() == 0:
        logging.info(message)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--device-iterations", type=int, default=2)
    parser.add_argument("--train-size", type=int, default=64)
    parser.add_argument("--learning-rate", type=float, default=0.1)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--num-replicas", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-dir", default=".")
    train(parser.parse_args())
