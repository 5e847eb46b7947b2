"""PopTorch's Adam and AdamW: torch's, plus loss scaling, clipping and state dtypes."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch.optim.optimizer import ParamsT

from pipetorch.optim._common import (
    Option, PopTorchOptimizer, check_betas, check_flag, check_number,
)
from pipetorch.optim.per_param import ParamGroup

__all__ = ["Adam", "AdamW", "AdamWNoBias"]

_DOC_EXTRAS = """
    - `loss_scaling`: the executor multiplies the loss by it; `step()` divides gradients back.
    - `max_grad_norm`: clip the global gradient norm (as `clip_grad_norm_`) before the update.
    - `accum_type`: dtype gradients are rounded to before the update (the accumulator's);
      `first_order_momentum_accum_type` / `second_order_momentum_accum_type`: dtypes of
      `exp_avg` / `exp_avg_sq`. All default (None) to torch.float32 whatever the parameters'
      dtype, as in PopTorch (a float32 model is then bitwise torch); other dtypes are stored
      as asked while the math runs in float32. A float16 or bfloat16 parameter is always
      updated in float32 and rounded back to its dtype.
    - `amsgrad=True` is an error, as in PopTorch.
"""

_MOMENT_DTYPES = {"exp_avg": "first_order_momentum_accum_type",
                  "exp_avg_sq": "second_order_momentum_accum_type"}


def _check_adam_args(lr: float | torch.Tensor, betas: tuple[float, float], eps: float,
                     weight_decay: float, amsgrad: bool) -> None:
    check_number("lr", lr)
    check_betas(betas)
    check_number("eps", eps)
    check_number("weight_decay", weight_decay)
    if check_flag("amsgrad", amsgrad):
        raise ValueError("amsgrad=True is not supported by PopTorch's Adam/AdamW; pass "
                         "amsgrad=False (the default), or use torch.optim outside the executor")


def adam_direction(param: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor], *,
                   betas: tuple[float, float], eps: float,
                   bias_correction: bool) -> torch.Tensor:
    """Advance Adam's moments in `state` by `grad`; return the step m_hat / (sqrt(v_hat) + eps).

    Without bias correction m_hat = m and v_hat = v. The state uses torch's Adam keys, so
    torch's Adam can continue from it.
    """
    if not state:
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    state["step"] += 1
    beta1, beta2 = (float(beta) for beta in betas)
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step = float(state["step"])
    correction1 = 1 - beta1 ** step if bias_correction else 1.0
    correction2 = 1 - beta2 ** step if bias_correction else 1.0
    denominator = (exp_avg_sq.sqrt() / math.sqrt(correction2)).add_(eps)
    return (exp_avg / correction1).div_(denominator)


class Adam(PopTorchOptimizer, torch.optim.Adam):
    __doc__ = "`torch.optim.Adam` (same arguments, same numbers) plus PopTorch's:\n" + _DOC_EXTRAS

    _state_dtype_options = _MOMENT_DTYPES

    first_order_momentum_accum_type = Option()
    second_order_momentum_accum_type = Option()

    def __init__(self, params: ParamsT, lr: float | torch.Tensor = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False, *,
                 loss_scaling: float | None = 1.0, max_grad_norm: float | None = math.inf,
                 accum_type: torch.dtype | None = None,
                 first_order_momentum_accum_type: torch.dtype | None = None,
                 second_order_momentum_accum_type: torch.dtype | None = None,
                 **torch_kwargs: bool | None) -> None:
        _check_adam_args(lr, betas, eps, weight_decay, amsgrad)
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **torch_kwargs)
        self._install_options(
            loss_scaling=loss_scaling, max_grad_norm=max_grad_norm, accum_type=accum_type,
            first_order_momentum_accum_type=first_order_momentum_accum_type,
            second_order_momentum_accum_type=second_order_momentum_accum_type)


class AdamW(PopTorchOptimizer, torch.optim.AdamW):
    __doc__ = ("`torch.optim.AdamW` (same arguments, same numbers) plus PopTorch's:\n"
               + _DOC_EXTRAS + """    - `bias_correction=False` (per group): Adam without bias
      correction, p <- p * (1 - lr * weight_decay) - lr * m / (sqrt(v) + eps).
""")

    _state_dtype_options = _MOMENT_DTYPES

    bias_correction = Option()
    first_order_momentum_accum_type = Option()
    second_order_momentum_accum_type = Option()

    def __init__(self, params: ParamsT, lr: float | torch.Tensor = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *,
                 loss_scaling: float | None = 1.0, bias_correction: bool | None = True,
                 max_grad_norm: float | None = math.inf, accum_type: torch.dtype | None = None,
                 first_order_momentum_accum_type: torch.dtype | None = None,
                 second_order_momentum_accum_type: torch.dtype | None = None,
                 **torch_kwargs: bool | None) -> None:
        _check_adam_args(lr, betas, eps, weight_decay, amsgrad)
        # torch >= 2.6 puts decoupled_weight_decay=True in AdamW's defaults but its
        # constructor rejects it; accept it so `AdamW(groups, **opt.defaults)` works.
        if torch_kwargs.pop("decoupled_weight_decay", True) is not True:
            raise ValueError("AdamW always decouples weight decay (decoupled_weight_decay "
                             "must be True); use pipetorch.optim.Adam for L2 weight decay")
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **torch_kwargs)
        self._install_options(
            loss_scaling=loss_scaling, bias_correction=bias_correction,
            max_grad_norm=max_grad_norm, accum_type=accum_type,
            first_order_momentum_accum_type=first_order_momentum_accum_type,
            second_order_momentum_accum_type=second_order_momentum_accum_type)

    def _uses_own_update(self, group: ParamGroup) -> bool:
        return not group["bias_correction"]

    def _own_update(self, group: ParamGroup) -> None:
        for param in group["params"]:
            if param.grad is None:
                continue
            grad = -param.grad if group["maximize"] else param.grad
            direction = adam_direction(param, grad, self.state[param], betas=group["betas"],
                                       eps=group["eps"], bias_correction=False)
            param.mul_(1 - group["lr"] * group["weight_decay"])
            param.sub_(direction * group["lr"])


class AdamWNoBias(AdamW):
    """PopTorch's AdamW without bias correction (`AdamW(..., bias_correction=False)`)."""

    def __init__(self, params: ParamsT, *args: Any, bias_correction: bool = False,
                 **kwargs: Any) -> None:
        _refuse_bias_correction(type(self).__name__, bias_correction)
        super().__init__(params, *args, bias_correction=False, **kwargs)


def _refuse_bias_correction(name: str, bias_correction: bool) -> None:
    if bias_correction is not False:
        raise ValueError(f"{name} never corrects the bias, got bias_correction="
                         f"{bias_correction!r}; use the class without NoBias for that")
