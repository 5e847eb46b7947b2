"""Copies between host and GPU that do not block: stage outputs into pinned memory, and loader
slots released after their copy's CUDA event."""
import pytest
import torch

import pipetorch as poptorch
from gpu_cases import CUDA
from pipetorch.parallel.worker.host_copies import HostCopies

pytestmark = CUDA


def test_outputs_land_in_pinned_memory_once_ready():
    copies = HostCopies.for_device(torch.device("cuda"))
    big = torch.randn(1024, 1024, device="cuda")
    outputs = [copies.take(big * 2), copies.take(torch.arange(5, device="cuda")), copies.take(7)]
    copies.ready()
    assert all(o.is_pinned() for o in outputs[:2]) and outputs[2] == 7
    torch.testing.assert_close(outputs[0], (big * 2).cpu(), rtol=0, atol=0)
    torch.testing.assert_close(outputs[1], torch.arange(5))


def test_async_loader_batches_copied_non_blocking_arrive_intact():
    # the slot a non_blocking copy reads is pinned, and was refilled at the next __next__
    items = 64
    data = torch.arange(items * 256, dtype=torch.float32).view(items, 256)
    loader = poptorch.DataLoader(poptorch.Options(), torch.utils.data.TensorDataset(data),
                                 batch_size=8, mode=poptorch.DataLoaderMode.Async,
                                 async_options={"buffer_size": 2})
    try:
        copies = []
        for (batch,) in loader:
            copies.append(batch.to("cuda", non_blocking=True))
            copied = torch.cuda.Event()
            copied.record()
            loader.release_after(copied)
        torch.cuda.synchronize()
    finally:
        loader.terminate()
    torch.testing.assert_close(torch.cat(copies).cpu(), data, rtol=0, atol=0)
