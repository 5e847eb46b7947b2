"""PopTorch's SGD: torch.optim.SGD plus loss scaling, clipping, velocity scaling and dtypes."""
from __future__ import annotations

import logging
import math

import torch
from torch.optim.optimizer import ParamsT

from pipetorch.optim._common import (
    Option, PopTorchOptimizer, StateFormats, check_flag, check_number, storage_dtype,
)
from pipetorch.optim.per_param import ParamGroup

__all__ = ["SGD"]

logger = logging.getLogger(__name__)


class SGD(PopTorchOptimizer, torch.optim.SGD):
    """`torch.optim.SGD` (same arguments, same numbers) with PopTorch's extra arguments.

    - `loss_scaling`: the executor multiplies the loss by it; `step()` divides gradients back.
    - `max_grad_norm`: clip the global gradient norm (as `clip_grad_norm_`) before the update.
    - `use_combined_accum`: PopTorch's combined variant (one tensor holds the velocity, kept in
      the parameter's dtype and scaled by `velocity_scaling`); `accum_type` and
      `velocity_accum_type` then have no effect, as in PopTorch.
    - `velocity_scaling` (per group): the stored velocity is `velocity_scaling` times the true
      one; only the combined variant uses it (PopTorch ignores it otherwise, with a warning).
    - `accum_type`: dtype gradients are rounded to before the update (the accumulator's);
      `velocity_accum_type`: dtype of the momentum buffer. Both default (None) to
      torch.float32 whatever the parameters' dtype, as in PopTorch; a float16 or bfloat16
      parameter is always updated in float32 and rounded back to its dtype.
    """

    _state_dtype_options = {"momentum_buffer": "velocity_accum_type"}

    velocity_scaling = Option()
    use_combined_accum = Option()
    velocity_accum_type = Option()

    def __init__(self, params: ParamsT, lr: float | torch.Tensor = 1e-3,
                 momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float | torch.Tensor = 0.0, nesterov: bool = False, *,
                 loss_scaling: float | None = 1.0, max_grad_norm: float | None = math.inf,
                 velocity_scaling: float | None = 1.0, use_combined_accum: bool | None = False,
                 accum_type: torch.dtype | None = None,
                 velocity_accum_type: torch.dtype | None = None,
                 **torch_kwargs: bool | None) -> None:
        check_number("lr", lr)
        check_number("momentum", momentum)
        check_number("dampening", dampening)
        check_number("weight_decay", weight_decay)
        check_flag("nesterov", nesterov)
        super().__init__(params, lr, momentum, dampening, weight_decay, nesterov, **torch_kwargs)
        self._install_options(
            loss_scaling=loss_scaling, max_grad_norm=max_grad_norm,
            velocity_scaling=velocity_scaling, use_combined_accum=use_combined_accum,
            accum_type=accum_type, velocity_accum_type=velocity_accum_type)
        if not self.use_combined_accum and self.velocity_scaling != 1.0:
            # PopTorch's words, then the value (its own warning names none).
            logger.warning("velocity_scaling value ignored when using the separate variant "
                           "(use_combined_accum=False). In future, this will lead to an "
                           "error. Please update your code. (velocity_scaling=%s)",
                           self.velocity_scaling)

    def _formats(self, group: ParamGroup,
                 param: torch.Tensor) -> tuple[torch.dtype, StateFormats]:
        if group["use_combined_accum"]:
            return param.dtype, {"momentum_buffer": (param.dtype, group["velocity_scaling"])}
        dtype = storage_dtype(group["velocity_accum_type"], param.dtype)
        return storage_dtype(group["accum_type"], param.dtype), {"momentum_buffer": (dtype, 1.0)}
