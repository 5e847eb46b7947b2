"""Which optimiser attributes are constant or variable (PopTorch's `variable_attrs`).

On an IPU a constant attribute is compiled into the program, so changing it later with
`setOptimizer` is an error; a variable one is a tensor the host may update. pipetorch keeps
the rule so scripts behave as on PopTorch: by default `lr` is variable and every other
hyper-parameter is constant while it holds PopTorch's default value (momentum 0,
weight_decay 0 ...), variable otherwise, or when it was passed to a pipetorch optimiser's
constructor (as PopTorch: `SGD(params, lr=0.1, loss_scaling=1.0)` may change loss_scaling
later). `markAsConstant` / `markAsVariable` change that before the model is compiled.
"""
from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass, field
from typing import Callable, Concatenate, Iterable, ParamSpec

import torch

__all__ = ["VariableAttributes"]

P = ParamSpec("P")

logger = logging.getLogger(__name__)

# Hyper-parameter -> the value that leaves it constant by default (None: never constant).
_CONSTANT_WHEN = {
    "lr": None, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0,
    "velocity_scaling": 1.0, "eps": 1e-8, "max_weight_norm": 65500.0, "alpha": "always",
    "betas": (0.9, 0.999), "loss_scaling": 1.0, "amsgrad": False,
}
# What a group without the key means: a plain torch optimiser scales neither loss nor velocity.
_WHEN_ABSENT = {"loss_scaling": 1.0, "velocity_scaling": 1.0}
_ADAMW_WEIGHT_DECAY = 1e-2  # AdamW's (and LAMB's) default, constant when kept
# Keys of a group or optimiser that are not hyper-parameters PopTorch reads.
_KNOWN_GROUP_KEYS = {"params", "foreach", "maximize", "capturable",
                     "differentiable", "fused", "nesterov", "amsgrad", "centered",
                     "decoupled_weight_decay", "bias_correction", "use_combined_accum",
                     "use_tf_variant", "max_grad_norm", "accum_type", "velocity_accum_type",
                     "first_order_momentum_accum_type", "second_order_momentum_accum_type",
                     "name", "param_names"}


class VariableAttributes:
    """`optimizer.variable_attrs`: `isConstant(name)`, `markAsConstant(name)`,
    `markAsVariable(name)` for the optimiser's numeric hyper-parameters."""

    def __init__(self, variable_attributes: Iterable[str],
                 allowed_attributes: Iterable[str]) -> None:
        self._variable, self._allowed = set(variable_attributes), set(allowed_attributes)

    # PopTorch's own names for the two sets (scripts and PopTorch's tests reach for them).
    @property
    def _variable_attributes(self) -> set[str]:
        return self._variable

    @_variable_attributes.setter
    def _variable_attributes(self, names: Iterable[str]) -> None:
        self._variable = set(names)

    @property
    def _allowed_attributes(self) -> set[str]:
        return self._allowed

    def _check(self, attr: str) -> None:
        if attr not in self._allowed:
            raise ValueError(f"Unknown optimizer attribute {attr!r}: variable_attrs knows "
                             f"{sorted(self._allowed)}")

    def isConstant(self, attr: str) -> bool:
        self._check(attr)
        return attr not in self._variable

    def markAsConstant(self, attr: str) -> None:
        self._check(attr)
        self._variable.discard(attr)

    def markAsVariable(self, attr: str) -> None:
        self._check(attr)
        self._variable.add(attr)

    def __repr__(self) -> str:
        return f"VariableAttributes(variable={sorted(self._variable)})"


#: Where a constructor call leaves the names of the arguments it passed.
EXPLICIT_ARGS = "_pipetorch_explicit_args"


def _passed(signature: inspect.Signature, args: tuple, kwargs: dict) -> set[str] | None:
    """The arguments a constructor call names (None values do not count, as in PopTorch),
    or None when positional values go to `*args` and only an inner constructor can tell."""
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return set()  # the constructor raises its own error for this call
    names: set[str] = set()
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                return None
        elif kind is inspect.Parameter.VAR_KEYWORD:
            names |= {key for key, item in value.items() if item is not None}
        elif value is not None:
            names.add(name)
    return names - {"self", "params"}


def recording_explicit_args(init: Callable[Concatenate[torch.optim.Optimizer, P], None]
                            ) -> Callable[Concatenate[torch.optim.Optimizer, P], None]:
    """`init`, noting which arguments the outermost constructor call passed."""
    signature = inspect.signature(init)

    @functools.wraps(init)
    def __init__(self: torch.optim.Optimizer, *args: P.args, **kwargs: P.kwargs) -> None:
        if EXPLICIT_ARGS not in self.__dict__:
            passed = _passed(signature, (self, *args), kwargs)
            if passed is not None:
                self.__dict__[EXPLICIT_ARGS] = passed
        init(self, *args, **kwargs)

    __init__._pipetorch_records = True  # type: ignore[attr-defined]  # a mark on the function
    return __init__


def default_attributes(optimizer: torch.optim.Optimizer, *,
                       explicit: Iterable[str] = ()) -> VariableAttributes:
    """PopTorch's default constness for `optimizer`'s current values; `explicit` names the
    arguments its constructor was given (variable whatever their value)."""
    from pipetorch.optim import scaling

    names = {name for group in optimizer.param_groups for name in group
             if name in _CONSTANT_WHEN}
    if "loss_scaling" in optimizer.defaults:
        names.add("loss_scaling")
    variable = set()
    for name in names:
        constant_value = _CONSTANT_WHEN[name]
        if name == "weight_decay" and any(c.__name__ in ("AdamW", "LAMB")
                                          for c in type(optimizer).__mro__):
            constant_value = _ADAMW_WEIGHT_DECAY
        values = [group.get(name, optimizer.defaults.get(name)) for group in optimizer.param_groups]
        if constant_value is None or name in explicit or (
                constant_value != "always" and any(_value(v) != constant_value for v in values)):
            variable.add(name)
    if scaling.is_automatic(optimizer):
        variable.add("loss_scaling")  # automatic loss scaling updates it
    return VariableAttributes(variable, names)


def _value(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return float(value)
    if isinstance(value, (tuple, list)):
        return tuple(_value(v) for v in value)
    return value


def attributes_of(optimizer: torch.optim.Optimizer) -> VariableAttributes:
    """`optimizer.variable_attrs` when it has one (pipetorch's optimisers), else the default."""
    found = getattr(optimizer, "variable_attrs", None)
    return found if isinstance(found, VariableAttributes) else default_attributes(optimizer)


@dataclass
class Compiled:
    """What the compiled program fixed: constant values, and the attributes it knows."""

    constants: dict[tuple[int, str], object]
    group_keys: list[set[str]]
    optimizer_keys: set[str]
    relaxed: bool = False  # Options.relaxOptimizerAttributesChecks: debug lines, not warnings
    warned: set[str] = field(default_factory=set)


def record(optimizer: torch.optim.Optimizer, *, automatic_loss_scaling: bool = False,
           relaxed: bool = False) -> Compiled:
    """Note, at compile time, the constants and the attribute names `optimizer` has."""
    attrs = attributes_of(optimizer)
    if automatic_loss_scaling and "loss_scaling" in optimizer.defaults:
        attrs.markAsVariable("loss_scaling")  # as PopTorch: the scale must be able to change
    constants = {(index, name): _value(group[name])
                 for index, group in enumerate(optimizer.param_groups)
                 for name in group if name in _CONSTANT_WHEN and attrs.isConstant(name)}
    return Compiled(constants, [set(g) for g in optimizer.param_groups], _public(optimizer),
                    relaxed)


def _public(optimizer: torch.optim.Optimizer) -> set[str]:
    return {k for k in vars(optimizer) if not k.startswith("_")
            and k not in ("defaults", "state", "param_groups", "variable_attrs")}


def check_replacement(compiled: Compiled, optimizer: torch.optim.Optimizer) -> None:
    """setOptimizer: refuse a changed constant; warn (once) about attributes PopTorch ignores."""
    for (index, name), value in compiled.constants.items():
        new = _value(optimizer.param_groups[index].get(name, _WHEN_ABSENT.get(name)))
        if new != value:
            raise ValueError(
                f"Optimizer attribute {name!r} of param group {index} is constant: it was "
                f"{value!r} when the model was compiled and setOptimizer got {new!r}. Constant "
                "attributes are compiled in; call optimizer.variable_attrs.markAsVariable("
                f"{name!r}) before the first call, or build a new trainingModel")
    kind = type(optimizer).__name__
    messages = [f"Ignoring unexpected optimizer attribute in {kind} optimizer: "
                f"{sorted(_public(optimizer) - compiled.optimizer_keys)}"]
    messages += [f"Ignoring unexpected group {index} attribute in {kind} optimizer: "
                 f"{sorted(set(group) - known - _KNOWN_GROUP_KEYS)}"
                 for index, (group, known) in enumerate(zip(optimizer.param_groups,
                                                            compiled.group_keys, strict=False))]
    for message in messages:
        if not message.endswith("[]") and message not in compiled.warned:
            compiled.warned.add(message)
            logger.log(logging.DEBUG if compiled.relaxed else logging.WARNING, message)
