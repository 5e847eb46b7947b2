"""What every PopTorch optimiser adds to torch's: loss scaling, clipping, state dtypes."""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, TypeAlias, TypeVar

import torch
from torch.optim.optimizer import StateDict

from pipetorch.optim import (attributes, clipping, ipu_param, ipu_state, peers, per_param,
                             scaling, swap_buckets)
from pipetorch.optim.arguments import check_flag, check_number  # noqa: F401 (optimisers import them here)
from pipetorch.optim.per_param import ParamGroup

__all__: list[str] = []

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

if TYPE_CHECKING:  # at runtime the torch optimiser class comes later in the bases
    _OptimizerBase = torch.optim.Optimizer
else:
    _OptimizerBase = object

#: Dtypes an optimiser state (or gradient accumulator) may be stored in.
ACCUM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: PopTorch's dtype for every optimiser state and accumulator unless asked otherwise,
#: whatever the parameters' dtype: a `.half()` model keeps float32 moments.
DEFAULT_ACCUM_DTYPE = torch.float32
#: Parameter dtypes whose update is computed in float32 and rounded back, as on an IPU.
LOW_PRECISION = (torch.float16, torch.bfloat16)
#: PopTorch's default LAMB `max_weight_norm`: the largest float16 value.
FP16_MAX = 65500.0

#: The value of a PopTorch extra argument once validated: a scale or limit, a flag, a dtype.
OptionValue: TypeAlias = float | bool | torch.dtype
# Extra keyword argument -> (value that None stands for, kind). Kinds decide validation.
_OPTION_RULES: dict[str, tuple[OptionValue, str]] = {
    "loss_scaling": (1.0, "scale"),
    "velocity_scaling": (1.0, "scale"),
    "max_grad_norm": (math.inf, "limit"),
    "max_weight_norm": (FP16_MAX, "limit"),
    "use_combined_accum": (False, "flag"),
    "bias_correction": (True, "flag"),
    "use_tf_variant": (False, "flag"),
    "accum_type": (DEFAULT_ACCUM_DTYPE, "dtype"),
    "velocity_accum_type": (DEFAULT_ACCUM_DTYPE, "dtype"),
    "first_order_momentum_accum_type": (DEFAULT_ACCUM_DTYPE, "dtype"),
    "second_order_momentum_accum_type": (DEFAULT_ACCUM_DTYPE, "dtype"),
}


def check_betas(betas: _T) -> _T:
    """Return `betas` if it is a pair of numbers in [0, 1), else raise naming the fix."""
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise TypeError(f"betas must be a pair (beta1, beta2), got {betas!r}; "
                        f"pass e.g. betas=(0.9, 0.999)")
    for index, beta in enumerate(betas):
        check_number(f"betas[{index}]", beta, maximum=1.0)
    return betas


def _check_dtype(name: str, value: OptionValue) -> torch.dtype:
    if value in ACCUM_DTYPES:
        return value
    choices = "torch.float32, torch.float16 or torch.bfloat16 (or None for torch.float32)"
    if isinstance(value, torch.dtype):
        raise ValueError(f"{name} must be {choices}, got {value}; pass one of those")
    raise TypeError(f"{name} must be a torch.dtype: {choices}, got {value!r} "
                    f"({type(value).__name__})")


def storage_dtype(option: torch.dtype, param_dtype: torch.dtype) -> torch.dtype:
    """The dtype a state (or a gradient, for `accum_type`) is kept in for a parameter:
    the option's, except that float32, PopTorch's full precision, keeps a float64
    parameter's float64 (PopTorch has no float64; a float64 model stays torch's)."""
    if option == torch.float32 and param_dtype == torch.float64:
        return param_dtype
    return option


def normalize_option(name: str, value: OptionValue | None) -> OptionValue:
    """Validate a PopTorch extra argument; None stands for PopTorch's default."""
    default, kind = _OPTION_RULES[name]
    if value is None:
        return default
    if kind == "flag":
        return check_flag(name, value)
    if kind == "dtype":
        return _check_dtype(name, value)
    check_number(name, value, strict=True, allow_inf=kind == "limit")
    assert not isinstance(value, torch.dtype)  # check_number refused it
    return float(value)


class Option:
    """A PopTorch keyword argument read and set as an attribute (`opt.loss_scaling = 512`).

    The value lives in `defaults` and in every param group, so `state_dict()`, the rebuild
    `type(opt)(groups, **opt.defaults)` and group-by-group copies all carry it. Reads come from
    the groups because `step()` uses the groups' values.
    """

    def __set_name__(self, owner: type[PopTorchOptimizer], name: str) -> None:
        self.name = name
        owner._option_names = (*getattr(owner, "_option_names", ()), name)

    def __get__(self, obj: PopTorchOptimizer | None, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        group = obj.param_groups[0]  # a subclass in PopTorch's style may not have set it
        return group[self.name] if self.name in group else normalize_option(self.name, None)

    def __set__(self, obj: PopTorchOptimizer, value: OptionValue | None) -> None:
        value = normalize_option(self.name, value)
        obj.defaults[self.name] = value
        for group in obj.param_groups:
            group[self.name] = value


@dataclass
class _Swap:
    """One parameter during `step()`: the tensor the update sees instead, and what to restore."""

    param: torch.Tensor
    work: torch.Tensor
    grad: torch.Tensor | None  # the user's gradient, when the update sees a copy


StateFormats = dict[str, tuple[torch.dtype, float]]


class PopTorchOptimizer(scaling.LossScaled, _OptimizerBase):
    """`poptorch.optim.Optimizer`: the base of PopTorch's optimisers, placed before a torch
    optimiser class in the bases (`class AdamW(Optimizer, torch.optim.AdamW)`).

    PopTorch's style works: `Optimizer.__init__(self)` (which does nothing), then the torch
    class's `__init__`, then `self.loss_scaling = ...`; such a subclass gets loss scaling,
    `max_grad_norm` and `accum_type` with their defaults, and the state dict's "ipu_state" and
    "ipu_param". Arguments passed explicitly to a constructor (not None) are variable
    attributes, as in PopTorch (`variable_attrs`), so they may change through setOptimizer.

    `step()` runs the update on "working" parameters: the parameters themselves when nothing
    is asked for (bitwise torch), copies of their gradients when loss scaling or clipping is on
    (the user's `.grad` is never modified), or float32 stand-ins otherwise: for a float16 or
    bfloat16 parameter (always), or a state stored in another dtype or scaled. The gradient is
    rounded to `accum_type`, the state read into float32, both updated by torch's own code,
    the state cast (and scaled) back, and the parameter receives the result rounded to its
    own dtype. So a `.half()` model with the default (float32) state dtypes is updated as
    PopTorch updates it: float32 math and moments, float16 weights, no float32 master copy.
    """

    #: state key -> option naming the dtype that state is stored in
    _state_dtype_options: dict[str, str] = {}
    _option_names: tuple[str, ...] = ()

    loss_scaling = Option()
    max_grad_norm = Option()
    accum_type = Option()

    def __init__(self, *args: object, **kwargs: object) -> None:
        # PopTorch's subclasses call `Optimizer.__init__(self)` before the torch class's.
        if args or kwargs:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]  # the torch class's arguments

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is not None and not getattr(init, "_pipetorch_records", False):
            cls.__init__ = attributes.recording_explicit_args(init)  # type: ignore[method-assign,assignment]  # wraps the constructor

    def _install_options(self, **options: OptionValue | None) -> None:
        """Put the extra arguments in `defaults` and fill them into groups that lack them."""
        assert set(options) == set(self._option_names), (set(options), self._option_names)
        for name, value in options.items():
            value = normalize_option(name, value)
            self.defaults[name] = value
            for group in self.param_groups:
                group.setdefault(name, value)
        explicit = self.__dict__.pop(attributes.EXPLICIT_ARGS, set())
        self.variable_attrs = attributes.default_attributes(self, explicit=explicit)

    def state_dict(self) -> StateDict:
        """torch's state dict plus "ipu_state" and "ipu_param": the state and the
        hyper-parameters under PopTorch's names once a trainingModel has compiled with this
        optimiser (None before), see `ipu_state` and `ipu_param`."""
        ipu = ipu_state.read(self)  # syncs from the device first
        params = ipu_param.read(self)
        return {**super().state_dict(), "ipu_state": ipu, "ipu_param": params}

    def read_ipu_state(self) -> dict[str, torch.Tensor] | None:
        """The optimiser state on the device under PopTorch's names (None before compiling)."""
        return ipu_state.read(self)

    def write_ipu_state(self, state: dict[str, torch.Tensor]) -> None:
        """Set the device's optimiser state from PopTorch's names (all or some of them)."""
        ipu_state.write(self, state)

    def add_param_group(self, param_group: ParamGroup) -> None:
        for name in set(self._option_names) & set(param_group):
            param_group[name] = normalize_option(name, param_group[name])
        super().add_param_group(param_group)

    def load_state_dict(self, state_dict: StateDict) -> None:
        """torch's load_state_dict, then "ipu_state" / "ipu_param" if there (PopTorch's
        checkpoint). A plain torch optimiser's state (trained on a CPU, say) loads too, and
        reaches the device when the model compiles (PopTorch refuses it: "Only IPU optimizer
        states can be loaded onto the IPU")."""
        if not state_dict:
            raise RuntimeError("Cannot load optimizer state dictionary because it is empty.")
        state_dict = dict(state_dict)
        ipu = state_dict.pop("ipu_state", None)
        params = state_dict.pop("ipu_param", None)
        saved = _saved_tensors(self, state_dict)
        ipu_state.sync(self)  # what is loaded must win over the device
        super().load_state_dict(state_dict)
        # torch casts loaded float state to each parameter's dtype, which would round a
        # float16 model's float32 moments to float16 (small second moments to 0): put the
        # saved tensors back; below they are cast to their accumulation dtype.
        for param, key, value in saved:
            self.state[param][key] = value.to(param.device, copy=True)
        for group in self.param_groups:
            for name in self._option_names:  # a plain torch optimiser's state lacks them
                group[name] = normalize_option(name, group.get(name, self.defaults.get(name)))
            for param in group["params"]:
                if self.state.get(param):
                    _, formats = self._formats(group, param)
                    dtypes_only = {key: (dtype, 1.0) for key, (dtype, _) in formats.items()}
                    self.state[param] = _store_state(self.state[param], dtypes_only)
        ipu_state.forget_loaded(self)
        if ipu is not None:
            ipu_state.write(self, ipu)
            ipu_state.remember_loaded(self, "ipu_state", ipu)
        if params is not None:
            ipu_param.write(self, params)
            ipu_state.remember_loaded(self, "ipu_param", params)

    def _formats(self, group: ParamGroup,
                 param: torch.Tensor) -> tuple[torch.dtype, StateFormats]:
        """(dtype the gradient is rounded to, {state key: (storage dtype, scale)})."""
        formats = {key: (storage_dtype(group[option], param.dtype), 1.0)
                   for key, option in self._state_dtype_options.items()}
        return storage_dtype(group["accum_type"], param.dtype), formats

    def _uses_own_update(self, group: ParamGroup) -> bool:
        """Whether this group is updated by `_own_update` instead of the torch parent's step."""
        return False

    def _own_update(self, group: ParamGroup) -> None:
        raise AssertionError(f"{type(self).__name__} has no update of its own")

    def _global_option(self, name: str) -> float:
        values = {group[name] for group in self.param_groups}
        if len(values) > 1:
            raise ValueError(f"{name} must be the same in every param group, got "
                             f"{sorted(values)}; set it once with optimizer.{name} = value")
        return values.pop()

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """Un-scale and clip the gradients, then update as torch does (see the class doc),
        each parameter with its own hyper-parameters where it has some (`per_param`)."""
        with per_param.stepping(self):
            return self._step(closure)

    def _step(self, closure: Callable[[], float] | None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for name in self._option_names:
                group[name] = normalize_option(name, group.get(name, self.defaults.get(name)))
        self._global_option("loss_scaling")  # one value, even while a dynamic scale rules
        max_grad_norm = self._global_option("max_grad_norm")
        if scaling.is_automatic(self) and self._skip_on_overflow():
            return loss
        loss_scaling = scaling.loss_scale(self)
        fresh_grads = loss_scaling != 1.0 or max_grad_norm != math.inf
        buckets = swap_buckets.split(self.param_groups)
        coefficient = None
        if max_grad_norm != math.inf:
            coefficient = self._clip_coefficient(buckets, loss_scaling, max_grad_norm)
        for bucket in buckets:
            self._step_bucket(bucket, loss_scaling, fresh_grads, coefficient)
        if scaling.is_automatic(self):
            scaling.record_clean_step(self)
        return loss

    def _step_bucket(self, bucket: swap_buckets.Bucket, loss_scaling: float, fresh_grads: bool,
                     coefficient: torch.Tensor | None) -> None:
        """Update one bucket's parameters: swap in, un-scale, clip, update, swap out."""
        group = self.param_groups[bucket.group]
        swaps = [self._swap_in(group, param, fresh_grads) for param in bucket.params]
        originals = [g["params"] for g in self.param_groups]
        try:
            for index, g in enumerate(self.param_groups):  # the update sees this bucket only
                g["params"] = [swap.work for swap in swaps] if index == bucket.group else []
            grads = [swap.work.grad for swap in swaps if swap.work.grad is not None]
            if loss_scaling != 1.0:
                for grad in grads:
                    grad.div_(loss_scaling)
            if coefficient is not None:
                clipping.scale(grads, coefficient, local=peers.current() is None)
            self._update()
        finally:
            for g, params in zip(self.param_groups, originals, strict=True):
                g["params"] = params
            for swap in swaps:
                self._swap_out(group, swap)

    def _clip_coefficient(self, buckets: list[swap_buckets.Bucket], loss_scaling: float,
                          max_grad_norm: float) -> torch.Tensor:
        """The factor that clips the un-scaled gradients the update will see to
        `max_grad_norm`, their norm summed bucket by bucket (see `clipping`)."""
        across = peers.current()
        terms = clipping.Terms(across)
        for bucket in buckets:
            group = self.param_groups[bucket.group]
            used = [param for param in bucket.params if param.grad is not None]
            grads = [self._working_grad(group, param) for param in used]
            if loss_scaling != 1.0:
                for grad in grads:
                    grad.div_(loss_scaling)
            terms.add(grads, across.weight(group) if across is not None else 1.0)
        return terms.coefficient(max_grad_norm)

    def _skip_on_overflow(self) -> bool:
        """Automatic loss scaling: on inf/NaN gradients (on any stage or replica), drop
        every gradient, lower the scale and report the step as skipped."""
        params = [param for group in self.param_groups for param in group["params"]]
        if not scaling.overflowed(self, params):
            return False
        for param in params:
            param.grad = None
        scaling.record_overflow(self)
        logger.info("Gradients overflowed: step skipped, loss scale lowered to %g",
                    scaling.loss_scale(self))
        return True

    def __getstate__(self) -> dict[str, Any]:
        # torch pickles (and deep-copies) only defaults, state and param_groups: the dynamic
        # loss scale must travel too (to stage workers, to the device copy).
        state = super().__getstate__()
        if "variable_attrs" in self.__dict__:
            state["variable_attrs"] = self.__dict__["variable_attrs"]
        if scaling.is_automatic(self):
            state[scaling._ATTR] = getattr(self, scaling._ATTR)
        return state

    def _update(self) -> None:
        own = [group for group in self.param_groups if self._uses_own_update(group)]
        if len(own) < len(self.param_groups):
            hidden = [group["params"] for group in own]
            for group in own:
                group["params"] = []
            try:
                self._torch_step()
            finally:
                for group, params in zip(own, hidden, strict=True):
                    group["params"] = params
        for group in own:
            self._own_update(group)

    def _torch_step(self) -> None:
        """The torch parent's update, without the step hooks: once any plain instance of the
        torch class exists, torch wraps that class's `step` to run the instance's hooks, which
        `step()` (hooked itself) has run already, and would run again for every bucket."""
        function = super().step.__func__  # type: ignore[attr-defined]  # torch's step is overloaded
        if getattr(function, "hooked", False):
            function = function.__wrapped__
        function(self)

    def _work_dtypes(self, group: ParamGroup,
                     param: torch.Tensor) -> tuple[torch.dtype, torch.dtype] | None:
        """(gradient's rounding dtype, update's dtype) when `param` is updated through a
        stand-in; None when the update sees the parameter itself."""
        grad_dtype, formats = self._formats(group, param)
        assert param.grad is not None  # only parameters with a gradient are swapped in
        if (param.dtype not in LOW_PRECISION and grad_dtype == param.grad.dtype
                and all(dtype == param.dtype and scale == 1.0
                        for dtype, scale in formats.values())):
            return None
        # float32 at least: a float16 update loses small steps and overflows eps=1e-8.
        return grad_dtype, torch.promote_types(param.dtype, torch.float32)

    def _working_grad(self, group: ParamGroup, param: torch.Tensor) -> torch.Tensor:
        """A new tensor holding the gradient the update of `param` sees (before un-scaling)."""
        grad = param.grad
        assert grad is not None  # only parameters with a gradient are swapped in or clipped
        dtypes = self._work_dtypes(group, param)
        if dtypes is None:
            return grad.clone()
        grad_dtype, work_dtype = dtypes
        return grad.to(grad_dtype).to(work_dtype, copy=True)

    def _complete_state(self, group: ParamGroup, state: dict[str, Any]) -> None:
        """Add the state a hyper-parameter switched on after a first step needs (RMSprop)."""

    def _swap_in(self, group: ParamGroup, param: torch.Tensor, fresh_grad: bool) -> _Swap:
        grad = param.grad
        if grad is None:
            return _Swap(param, param, None)
        if self.state.get(param):
            self._complete_state(group, self.state[param])
        dtypes = self._work_dtypes(group, param)
        if dtypes is None:
            if fresh_grad:
                param.grad = self._working_grad(group, param)
                return _Swap(param, param, grad)
            return _Swap(param, param, None)
        work = torch.nn.Parameter(param.detach().to(dtypes[1], copy=True))
        work.grad = self._working_grad(group, param)
        state = self.state.get(param)  # left in place (and in order) until _swap_out
        if state:
            _, formats = self._formats(group, param)
            self.state[work] = _load_state(state, formats, dtypes[1])
        return _Swap(param, work, None)

    def _swap_out(self, group: ParamGroup, swap: _Swap) -> None:
        if swap.grad is not None:
            swap.param.grad = swap.grad
        if swap.work is swap.param:
            return
        swap.param.copy_(swap.work)
        state = self.state.pop(swap.work, None)
        if state:
            _, formats = self._formats(group, swap.param)
            self.state[swap.param] = _store_state(state, formats)


def _saved_tensors(optimizer: torch.optim.Optimizer, state_dict: StateDict
                   ) -> list[tuple[torch.Tensor, str, torch.Tensor]]:
    """(parameter, key, tensor) of every floating state tensor in a torch state dict, the
    parameters matched by position as torch's `load_state_dict` matches them."""
    saved_ids = [index for group in state_dict.get("param_groups", ()) for index in group["params"]]
    params = [param for group in optimizer.param_groups for param in group["params"]]
    by_index = dict(zip(saved_ids, params, strict=False))  # torch's load refuses a mismatch
    return [(by_index[index], key, value)
            for index, values in state_dict.get("state", {}).items() if index in by_index
            for key, value in values.items()
            if key != "step" and isinstance(value, torch.Tensor) and value.is_floating_point()]


def _load_state(state: dict[str, Any], formats: StateFormats,
                dtype: torch.dtype) -> dict[str, Any]:
    """The stored state as the update sees it: in `dtype`, scaling removed."""
    loaded = dict(state)
    for key, (_, scale) in formats.items():
        if isinstance(state.get(key), torch.Tensor):
            loaded[key] = state[key].to(dtype) / scale if scale != 1.0 else state[key].to(dtype)
    return loaded


def _store_state(state: dict[str, Any], formats: StateFormats) -> dict[str, Any]:
    """The updated state as it is kept: in its accumulation dtype, scaled."""
    stored = dict(state)
    for key, (dtype, scale) in formats.items():
        if isinstance(state.get(key), torch.Tensor):
            stored[key] = (state[key] * scale).to(dtype) if scale != 1.0 else state[key].to(dtype)
    return stored
