"""PopTorch's LAMB: layer-wise adaptive moments (You et al. 2019, arXiv:1904.00962)."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch.optim.optimizer import ParamsT

from pipetorch.optim._common import (
    FP16_MAX, Option, PopTorchOptimizer, check_betas, check_flag, check_number,
)
from pipetorch.optim import peers
from pipetorch.optim.adam import _refuse_bias_correction, adam_direction
from pipetorch.optim.peers import SLICED
from pipetorch.optim.per_param import ParamGroup

__all__ = ["LAMB", "LAMBNoBias"]


class LAMB(PopTorchOptimizer, torch.optim.Optimizer):
    """LAMB as PopTorch computes it, for each parameter p with gradient g at step t:

        m <- beta1 * m + (1 - beta1) * g;   v <- beta2 * v + (1 - beta2) * g^2
        u  = m_hat / (sqrt(v_hat) + eps) + weight_decay * p
             (m_hat = m / (1 - beta1^t), v_hat = v / (1 - beta2^t); m, v if not bias_correction)
        r  = min(||p||, max_weight_norm) / ||u||   (r = 1 when either norm is 0)
        p <- p - lr * r * u

    `max_weight_norm` (per group, default 65500 = float16's max; math.inf turns the clamp off)
    is PopTorch's scaling function phi. Also `loss_scaling`, `max_grad_norm` (extension),
    `accum_type`, `first_order_momentum_accum_type` (m), `second_order_momentum_accum_type` (v)
    as in the other PopTorch optimisers (default None: torch.float32, the update of a float16
    or bfloat16 parameter computed in float32).
    """

    _state_dtype_options = {"exp_avg": "first_order_momentum_accum_type",
                            "exp_avg_sq": "second_order_momentum_accum_type"}

    bias_correction = Option()
    max_weight_norm = Option()
    first_order_momentum_accum_type = Option()
    second_order_momentum_accum_type = Option()

    def __init__(self, params: ParamsT, lr: float | torch.Tensor = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, bias_correction: bool | None = True,
                 loss_scaling: float | None = 1.0, max_weight_norm: float | None = FP16_MAX,
                 max_grad_norm: float | None = math.inf, accum_type: torch.dtype | None = None,
                 first_order_momentum_accum_type: torch.dtype | None = None,
                 second_order_momentum_accum_type: torch.dtype | None = None,
                 differentiable: bool = False) -> None:
        check_number("lr", lr)
        check_betas(betas)
        check_number("eps", eps)
        check_number("weight_decay", weight_decay)
        # torch adds differentiable=False to every optimiser's defaults when it loads a state
        # dict or unpickles, so it must come back through the constructor.
        if check_flag("differentiable", differentiable):
            raise ValueError("LAMB does not support differentiable=True; pass False")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      differentiable=False))
        self._install_options(
            bias_correction=bias_correction, loss_scaling=loss_scaling,
            max_weight_norm=max_weight_norm, max_grad_norm=max_grad_norm, accum_type=accum_type,
            first_order_momentum_accum_type=first_order_momentum_accum_type,
            second_order_momentum_accum_type=second_order_momentum_accum_type)

    def _uses_own_update(self, group: ParamGroup) -> bool:
        return True

    def _own_update(self, group: ParamGroup) -> None:
        for param in group["params"]:
            if param.grad is None:
                continue
            update = adam_direction(param, param.grad, self.state[param], betas=group["betas"],
                                    eps=group["eps"], bias_correction=group["bias_correction"])
            if group["weight_decay"] != 0:
                update.add_(param, alpha=group["weight_decay"])
            weight_norm, update_norm = _norms(param, update, sliced=bool(group.get(SLICED)))
            weight_norm = weight_norm.clamp(max=group["max_weight_norm"])
            both_nonzero = (weight_norm > 0) & (update_norm > 0)
            trust = torch.where(both_nonzero, weight_norm / update_norm, 1.0)
            param.sub_(update * (trust * group["lr"]))


def _norms(param: torch.Tensor, update: torch.Tensor, *,
           sliced: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """||param|| and ||update||; for a replica's slice of a sharded weight, the norms of the
    whole weight and update: squared norms summed over the slices (one call per weight, in
    the same order on every replica)."""
    across = peers.current()
    if not sliced or across is None or across.slice_sum is None:
        return torch.linalg.vector_norm(param), torch.linalg.vector_norm(update)
    squares = torch.stack([param.detach().float().pow(2).sum(), update.float().pow(2).sum()])
    total = across.slice_sum(squares).sqrt()
    return total[0].to(param.dtype), total[1].to(update.dtype)


class LAMBNoBias(LAMB):
    """PopTorch's LAMB without bias correction (`LAMB(..., bias_correction=False)`)."""

    def __init__(self, params: ParamsT, *args: Any, bias_correction: bool = False,
                 **kwargs: Any) -> None:
        _refuse_bias_correction(type(self).__name__, bias_correction)
        super().__init__(params, *args, bias_correction=False, **kwargs)
