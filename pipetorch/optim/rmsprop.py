"""PopTorch's RMSprop: torch.optim.RMSprop or TensorFlow's variant, plus PopTorch's extras."""
from __future__ import annotations

import math

import torch
from torch.optim.optimizer import ParamsT

from pipetorch.optim._common import Option, PopTorchOptimizer, check_flag, check_number
from pipetorch.optim.per_param import ParamGroup

__all__ = ["RMSprop"]


class RMSprop(PopTorchOptimizer, torch.optim.RMSprop):
    """`torch.optim.RMSprop` (same arguments, same numbers) with PopTorch's extra arguments.

    - `loss_scaling`: the executor multiplies the loss by it; `step()` divides gradients back.
    - `max_grad_norm` (extension: PopTorch's RMSprop lacks it): global-norm clipping.
    - `accum_type`: dtype gradients are rounded to before the update;
      `first_order_momentum_accum_type`: dtype of `momentum_buffer` and `grad_avg`;
      `second_order_momentum_accum_type`: dtype of `square_avg`. All default (None) to
      torch.float32, as in PopTorch; float16/bfloat16 parameters are updated in float32.
    - `use_tf_variant=True` (per group): TensorFlow's RMSprop. With g the gradient
      (+ weight_decay * p), a = alpha:

          square_avg <- a * square_avg + (1 - a) * g^2        (square_avg starts at ONES)
          grad_avg   <- a * grad_avg + (1 - a) * g             (centered only, starts at 0)
          denom      =  sqrt(square_avg - grad_avg^2 + eps)    (eps INSIDE the sqrt)
          momentum > 0: buf <- momentum * buf + lr * g / denom;  p <- p - buf
          otherwise:    p <- p - lr * g / denom

      torch instead starts square_avg at zeros, uses sqrt(...) + eps and keeps lr out of buf.
    """

    _state_dtype_options = {"square_avg": "second_order_momentum_accum_type",
                            "momentum_buffer": "first_order_momentum_accum_type",
                            "grad_avg": "first_order_momentum_accum_type"}

    first_order_momentum_accum_type = Option()
    second_order_momentum_accum_type = Option()
    use_tf_variant = Option()

    def __init__(self, params: ParamsT, lr: float | torch.Tensor = 1e-2,
                 alpha: float = 0.99, eps: float = 1e-8, weight_decay: float = 0.0,
                 momentum: float = 0.0, centered: bool = False, *,
                 loss_scaling: float | None = 1.0, max_grad_norm: float | None = math.inf,
                 accum_type: torch.dtype | None = None,
                 first_order_momentum_accum_type: torch.dtype | None = None,
                 second_order_momentum_accum_type: torch.dtype | None = None,
                 use_tf_variant: bool | None = False, **torch_kwargs: bool | None) -> None:
        check_number("lr", lr)
        check_number("alpha", alpha)
        check_number("eps", eps)
        check_number("weight_decay", weight_decay)
        check_number("momentum", momentum)
        check_flag("centered", centered)
        super().__init__(params, lr, alpha, eps, weight_decay, momentum, centered,
                         **torch_kwargs)
        self._install_options(
            loss_scaling=loss_scaling, max_grad_norm=max_grad_norm, accum_type=accum_type,
            first_order_momentum_accum_type=first_order_momentum_accum_type,
            second_order_momentum_accum_type=second_order_momentum_accum_type,
            use_tf_variant=use_tf_variant)

    def _complete_state(self, group: ParamGroup, state: dict) -> None:
        # momentum (or centered) set by setOptimizer after steps without it: as PopTorch's
        # variable momentum, the buffer starts at zero (torch's step would miss the key)
        like = state["square_avg"]
        if group["momentum"] > 0:
            state.setdefault("momentum_buffer", torch.zeros_like(like))
        if group["centered"]:
            state.setdefault("grad_avg", torch.zeros_like(like))

    def _uses_own_update(self, group: ParamGroup) -> bool:
        return group["use_tf_variant"]

    def _own_update(self, group: ParamGroup) -> None:
        alpha, lr, momentum = group["alpha"], group["lr"], group["momentum"]
        for param in group["params"]:
            if param.grad is None:
                continue
            state = self.state[param]
            if not state:  # the same keys as torch's RMSprop, so either can continue
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["square_avg"] = torch.ones_like(param, memory_format=torch.preserve_format)
            state["step"] += 1
            grad = -param.grad if group["maximize"] else param.grad
            if group["weight_decay"] != 0:
                grad = grad.add(param, alpha=group["weight_decay"])
            square_avg = state["square_avg"].mul_(alpha).addcmul_(grad, grad, value=1 - alpha)
            variance = square_avg
            if group["centered"]:
                grad_avg = state.setdefault("grad_avg", torch.zeros_like(param))
                grad_avg.lerp_(grad, 1 - alpha)
                variance = square_avg.addcmul(grad_avg, grad_avg, value=-1)
            scaled = grad / variance.add(group["eps"]).sqrt_()
            if momentum > 0:
                buf = state.setdefault("momentum_buffer", torch.zeros_like(param))
                param.sub_(buf.mul_(momentum).add_(scaled * lr))
            else:
                param.sub_(scaled * lr)
