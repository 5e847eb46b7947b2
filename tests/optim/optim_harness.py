"""Tiny training runs and hand-written reference optimisers for the pipetorch.optim tests."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

import pipetorch as poptorch

STEPS = 10


def make_model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).to(dtype)


def batches(dtype: torch.dtype = torch.float32,
            steps: int = STEPS) -> list[tuple[torch.Tensor, ...]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 4, generator=generator).to(dtype),
             torch.randn(6, 2, generator=generator).to(dtype)) for _ in range(steps)]


def two_groups(model: nn.Module, **second: Any) -> list[dict[str, Any]]:
    """First layer in group 0 (the defaults), last layer in group 1 with `second` overrides."""
    return [{"params": list(model[0].parameters())},
            {"params": list(model[2].parameters()), **second}]


def train(model: nn.Module, optimizer: torch.optim.Optimizer, data: list, *,
          loss_scale: float = 1.0, clip: float | None = None) -> list[torch.Tensor]:
    """Plain loop: backward of loss * loss_scale, optional clip_grad_norm_, step. Returns losses."""
    losses = []
    for x, y in data:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        (loss * loss_scale).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        losses.append(loss.detach())
    return losses


def train_rounded(model: nn.Module, optimizer: torch.optim.Optimizer, shadow: nn.Module,
                  data: list) -> list[torch.Tensor]:
    """PopTorch's update of a float16/bfloat16 `model`, written out: `optimizer` steps the
    float32 `shadow` (its state float32), which is set from the weights and gradients before
    each step and rounded back into the weights after it. No float32 master copy survives
    a step: the weights stay low precision. Returns the losses."""
    losses = []
    for x, y in data:
        model.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        with torch.no_grad():
            pairs = list(zip(model.parameters(), shadow.parameters()))
            for param, twin in pairs:
                twin.copy_(param)
                twin.grad = param.grad.float()
            optimizer.step()
            for param, twin in pairs:
                param.copy_(twin)
        losses.append(loss.detach())
    return losses


class RefLAMB(torch.optim.Optimizer):
    """LAMB written straight from the paper / PopTorch's docs, one parameter at a time."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 bias_correction=True, max_weight_norm=65500.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      bias_correction=bias_correction,
                                      max_weight_norm=max_weight_norm))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                state = self.state[p]
                t = state["t"] = state.get("t", 0) + 1
                m = state["m"] = beta1 * state.get("m", 0.0) + (1 - beta1) * p.grad
                v = state["v"] = beta2 * state.get("v", 0.0) + (1 - beta2) * p.grad ** 2
                if group["bias_correction"]:
                    m, v = m / (1 - beta1 ** t), v / (1 - beta2 ** t)
                u = m / (torch.sqrt(v) + group["eps"]) + group["weight_decay"] * p
                phi = min(p.norm().item(), group["max_weight_norm"])
                u_norm = u.norm().item()
                ratio = phi / u_norm if phi > 0 and u_norm > 0 else 1.0
                p -= group["lr"] * ratio * u


class RefAdamWNoBias(torch.optim.Optimizer):
    """AdamW without bias correction: p <- p(1 - lr wd) - lr m / (sqrt(v) + eps)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                state = self.state[p]
                m = state["m"] = beta1 * state.get("m", 0.0) + (1 - beta1) * p.grad
                v = state["v"] = beta2 * state.get("v", 0.0) + (1 - beta2) * p.grad ** 2
                p *= 1 - group["lr"] * group["weight_decay"]
                p -= group["lr"] * m / (torch.sqrt(v) + group["eps"])


class RefRMSpropTF(torch.optim.Optimizer):
    """TensorFlow's RMSprop (tf.compat.v1.train.RMSPropOptimizer): ms starts at 1, eps in sqrt."""

    def __init__(self, params, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0.0, momentum=0.0,
                 centered=False):
        super().__init__(params, dict(lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay,
                                      momentum=momentum, centered=centered))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            rho = group["alpha"]
            for p in group["params"]:
                state = self.state[p]
                g = p.grad + group["weight_decay"] * p
                ms = state["ms"] = rho * state.get("ms", 1.0) + (1 - rho) * g * g
                denominator = ms
                if group["centered"]:
                    mg = state["mg"] = rho * state.get("mg", 0.0) + (1 - rho) * g
                    denominator = ms - mg * mg
                delta = group["lr"] * g / torch.sqrt(denominator + group["eps"])
                if group["momentum"] > 0:
                    delta = state["mom"] = group["momentum"] * state.get("mom", 0.0) + delta
                p -= delta


@dataclass
class Case:
    """One optimiser configuration and what it must equal."""

    name: str
    ours: type
    reference: type
    kwargs: dict[str, Any]
    second_group: dict[str, Any] = field(default_factory=dict)
    extras: dict[str, Any] = field(default_factory=dict)  # PopTorch-only, not for `reference`
    exact: bool = True  # bitwise torch's, or only close to a hand-written reference

    def __repr__(self) -> str:
        return self.name

    def build(self, model: nn.Module, **extras: Any) -> tuple[torch.optim.Optimizer, nn.Module,
                                                               torch.optim.Optimizer]:
        """(ours on `model`, reference optimiser on a copy, that copy)."""
        twin = copy.deepcopy(model)
        ours = self.ours(two_groups(model, **self.second_group), **self.kwargs,
                         **self.extras, **extras)
        reference = self.reference(two_groups(twin, **self.second_group), **self.kwargs)
        return ours, twin, reference

    def reference_on(self, model: nn.Module) -> torch.optim.Optimizer:
        """The reference optimiser, with this case's groups, over `model`'s parameters."""
        return self.reference(two_groups(model, **self.second_group), **self.kwargs)

    def assert_equal(self, actual: Any, expected: Any, **tolerance: float) -> None:
        if self.exact and not tolerance:
            tolerance = dict(rtol=0.0, atol=0.0)
        torch.testing.assert_close(actual, expected, **tolerance)


CASES = [
    Case("SGD", poptorch.optim.SGD, torch.optim.SGD, dict(lr=0.1),
         dict(lr=0.05, weight_decay=0.1)),
    Case("SGD-momentum", poptorch.optim.SGD, torch.optim.SGD,
         dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=1e-2),
         dict(lr=0.05, dampening=0.0, nesterov=True)),
    Case("Adam", poptorch.optim.Adam, torch.optim.Adam, dict(lr=0.01, weight_decay=1e-2),
         dict(lr=0.02, betas=(0.8, 0.99))),
    Case("AdamW", poptorch.optim.AdamW, torch.optim.AdamW, dict(lr=0.01),
         dict(weight_decay=0.1, eps=1e-6)),
    Case("RMSprop", poptorch.optim.RMSprop, torch.optim.RMSprop,
         dict(lr=0.01, momentum=0.5), dict(centered=True, weight_decay=1e-2)),
    Case("AdamW-no-bias-correction", poptorch.optim.AdamW, RefAdamWNoBias, dict(lr=0.01),
         dict(weight_decay=0.1), extras=dict(bias_correction=False), exact=False),
    Case("RMSprop-tf", poptorch.optim.RMSprop, RefRMSpropTF, dict(lr=0.01),
         dict(momentum=0.5, centered=True, weight_decay=1e-2),
         extras=dict(use_tf_variant=True), exact=False),
    Case("LAMB", poptorch.optim.LAMB, RefLAMB, dict(lr=0.02, weight_decay=1e-2),
         dict(max_weight_norm=0.5, lr=0.05), exact=False),
    Case("LAMB-no-bias-correction", poptorch.optim.LAMB, RefLAMB,
         dict(lr=0.02, bias_correction=False), dict(weight_decay=0.0), exact=False),
]
TORCH_CASES = [case for case in CASES if case.exact]


def params_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def state_tensors(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every floating state tensor except step counters, keyed "param position.key"."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {f"{i}.{key}": value
            for i, param in enumerate(params)
            for key, value in optimizer.state.get(param, {}).items()
            if isinstance(value, torch.Tensor) and key != "step" and value.is_floating_point()}
