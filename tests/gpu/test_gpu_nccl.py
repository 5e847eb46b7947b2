"""Replicas on separate GPUs sum their gradients through NCCL, bucket by bucket, and train like
plain PyTorch; their traces name NCCL."""
import pytest
import torch
import torch.nn as nn

import pipetorch as poptorch
from gpu_cases import CUDA, gpus, on_gpu
from helpers.models import MnistNetwork, WithLoss, mnist_data
from test_gpu_workers import _in_workers, options, train_both, workers  # noqa: F401 (fixture)

pytestmark = [pytest.mark.slow, *CUDA]


def mnist():
    """Seed 000's CNN in 2 stages (ipus 0, 1)."""
    torch.manual_seed(0)
    stages = [poptorch.Stage("B1", "B2").ipu(0), poptorch.Stage("B3", "B4").ipu(1)]
    return WithLoss(MnistNetwork()), stages, mnist_data


def mnist_one_stage():
    model, _, make_data = mnist()
    return model, [poptorch.Stage("B1", "B2", "B3", "B4").ipu(0)], make_data


def wide():
    """One stage of an MLP whose first weight (784 x 16384 fp32, 51 MB) is over a 25 MiB
    bucket: the all-reduce slices it across two."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Flatten(), nn.Linear(784, 16384), nn.ReLU(), nn.Linear(16384, 10))
    return WithLoss(net, block=None), [], mnist_data


@pytest.mark.skipif(gpus() < 2, reason="NCCL between replicas needs two GPUs")
@pytest.mark.parametrize("build", [mnist_one_stage, wide], ids=["mnist", "wide-sliced-bucket"])
def test_two_replicas_on_two_gpus_all_reduce_through_nccl(request, monkeypatch, build):
    on_gpu(monkeypatch, gpus=2)
    model, stages, make_data = build()
    wrapper = train_both(request, model, options(stages, sharded=False, G=2, R=2), make_data,
                         G=2, R=2)
    engine = workers(wrapper)
    assert len(engine.worker_pids) == 2
    assert {t.transport for t in engine.last_trace} == {"nccl"}  # traces said "gloo"


@pytest.mark.skipif(gpus() < 4, reason="2 stages x 2 replicas on NCCL need four GPUs")
def test_two_pipelined_replicas_on_four_gpus_train_like_plain_pytorch(request, monkeypatch):
    on_gpu(monkeypatch, gpus=4)
    model, stages, make_data = mnist()
    wrapper = train_both(request, model, options(stages, sharded=False, G=3, R=2), make_data,
                         G=3, R=2)
    engine = workers(wrapper)
    assert len(engine.worker_pids) == 4
    assert {t.transport for t in engine.last_trace} == {"nccl"}

