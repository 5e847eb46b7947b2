"""Shared by the GPU tests: the `cuda` marks, a plain-PyTorch loop on the GPU, comparisons.

Every test here compares pipetorch on a GPU with plain PyTorch on the same GPU (never with
the CPU: cuDNN's TF32 convolutions and other kernels round differently), and is skipped
cleanly where torch sees no GPU. `scripts/gpu-check.sh` runs them with `-m cuda`.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.testing import assert_close

from pipetorch.optim import scaling

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CUDA = [pytest.mark.cuda, needs_cuda]
# Two processes may pick different cuDNN algorithms for the same convolution; the last bits
# then differ, and a few optimiser steps carry that further.
GPU_TOLERANCE = dict(rtol=1e-3, atol=1e-4)


def gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def on_gpu(monkeypatch: pytest.MonkeyPatch, *, gpus: int | None = None) -> None:
    """pipetorch places on the GPUs for the rest of the test (at most `gpus` of them)."""
    monkeypatch.setenv("PIPETORCH_DEVICE", "cuda")
    if gpus is not None:
        monkeypatch.setenv("PIPETORCH_NUM_DEVICES", str(gpus))


def plain_steps(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor,
                y: torch.Tensor, *, D: int, G: int, R: int = 1) -> torch.Tensor:
    """D optimiser steps of G x R micro-batches by hand on the model's device; the losses."""
    device = next(model.parameters()).device
    B = x.shape[0] // (D * G * R)
    losses = []
    for d in range(D):
        optimizer.zero_grad()
        for m in range(G * R):
            i = d * G * R + m
            _, loss = model(x[i * B:(i + 1) * B].to(device), y[i * B:(i + 1) * B].to(device))
            loss.mul(scaling.loss_scale(optimizer) / (G * R)).backward()
            losses.append(loss.detach())
        optimizer.step()
    return torch.stack(losses).cpu()


def assert_same_weights(got: nn.Module, want: nn.Module, **tolerances: float) -> None:
    """Every parameter and buffer of two models, compared on the CPU."""
    want_state = want.state_dict()
    got_state = got.state_dict()
    assert list(got_state) == list(want_state)
    for name, value in want_state.items():
        assert got_state[name].dtype == value.dtype, name
        assert_close(got_state[name].cpu(), value.cpu(), msg=lambda m, n=name: f"{n}: {m}",
                     **tolerances)
