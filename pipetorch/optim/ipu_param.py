"""The optimiser's hyper-parameters under PopTorch's names (`state_dict()["ipu_param"]`).

Besides its state ("ipu_state"), PopTorch reads back the scalars its compiled optimiser
uses, one per parameter, under PopART's names. After a trainingModel has compiled,
`optimizer.state_dict()["ipu_param"]` holds them (None before, as "ipu_state"):

- every optimiser: `lossScaling_FLOAT`, the static `loss_scaling`;
- SGD without momentum (PopART's SGD0), per parameter p:
  `scaledLearningRate0___specific___p` = lr * (1 - dampening) / loss_scaling and
  `weightDecayScaleFactor0___specific___p` = 1 - lr * (1 - dampening) * weight_decay;
- the others `<name>___specific___p`, name one of learningRate, weightDecay and, where the
  optimiser has them, beta1, beta2, eps (Adam, AdamW, LAMB), maxWeightNorm (LAMB), alpha,
  eps, momentum (RMSprop), momentum, dampening, velocityScaling (SGD with momentum: the
  group's velocity_scaling with use_combined_accum=True; the loss scaling otherwise, as
  PopTorch's separate variant matches the two).

`load_state_dict` of a dict holding "ipu_param" sets the hyper-parameters from it (a
checkpoint's learning rate, say): at once on a compiled model, else when it compiles (until
then `state_dict()` returns what was loaded, as PopTorch does).
Names left out keep their values. Values that every parameter of a group shares become the
group's; parameters given values of their own keep them as PopTorch does (`per_param`), and
the device steps them with those values.
"""
from __future__ import annotations

from typing import Callable

import torch

from pipetorch.optim import attributes, device_link, ipu_state, per_param
from pipetorch.optim.per_param import ParamGroup

__all__: list[str] = []

LOSS_SCALING = "lossScaling_FLOAT"
_SPECIFIC = "___specific___"
_PENDING = "_pipetorch_pending_ipu_param"
_SGD0 = ("scaledLearningRate0", "weightDecayScaleFactor0")
# PopART name -> group key, per optimiser family (besides SGD without momentum).
_NAMES = {
    "SGD": {"learningRate": "lr", "weightDecay": "weight_decay", "momentum": "momentum",
            "dampening": "dampening", "velocityScaling": "velocity_scaling"},
    "Adam": {"learningRate": "lr", "weightDecay": "weight_decay", "beta1": "betas",
             "beta2": "betas", "eps": "eps"},
    "RMSprop": {"learningRate": "lr", "weightDecay": "weight_decay", "alpha": "alpha",
                "eps": "eps", "momentum": "momentum"},
}
_NAMES["AdamW"] = _NAMES["Adam"]
_NAMES["LAMB"] = {**_NAMES["Adam"], "maxWeightNorm": "max_weight_norm"}


def _family(optimizer: torch.optim.Optimizer) -> str:
    return next((cls.__name__ for cls in type(optimizer).__mro__ if cls.__name__ in _NAMES),
                "")


def _sgd0(optimizer: torch.optim.Optimizer, group: ParamGroup) -> bool:
    return _family(optimizer) == "SGD" and not float(group.get("momentum", 0.0))


def _group_values(optimizer: torch.optim.Optimizer, group: ParamGroup,
                  loss_scaling: float) -> dict[str, float]:
    """PopART name -> value for the parameters of `group`."""
    if _sgd0(optimizer, group):
        lr = float(group["lr"]) * (1.0 - float(group.get("dampening", 0.0)))
        return {"scaledLearningRate0": lr / loss_scaling,
                "weightDecayScaleFactor0": 1.0 - lr * float(group.get("weight_decay", 0.0))}
    values = {}
    for name, key in _NAMES[_family(optimizer)].items():
        if key == "betas":
            values[name] = float(group["betas"][0 if name == "beta1" else 1])
        elif key in group:
            values[name] = float(group[key])
    if _family(optimizer) == "SGD" and not group.get("use_combined_accum", False):
        # PopTorch's separate SGD variant scales its velocity by the loss scaling
        # (test_optimizer_SGD_separate_velocity_scale_matched); velocity_scaling is ignored.
        values["velocityScaling"] = loss_scaling
    return values


def describe(optimizer: torch.optim.Optimizer) -> list[str]:
    """PopTorch's debug lines for an optimiser sent to the device: the graph's (the defaults,
    the state dtypes, the loss scaling) and each param group's, under PopART's names."""
    family = _family(optimizer)
    if not family:
        return []
    loss_scaling = float(optimizer.defaults.get("loss_scaling", 1.0))
    attrs = attributes.attributes_of(optimizer)

    def const(key: str) -> str:
        """PopTorch marks a value compiled in as a constant (`variable_attrs`) "(const)"."""
        if key not in attrs._allowed_attributes:  # PopTorch's own name for the set
            # a torch optimiser scales neither loss nor velocity: a constant 1
            return " (const)" if key in ("loss_scaling", "velocity_scaling") else ""
        return " (const)" if attrs.isConstant(key) else ""

    def values(group: ParamGroup, prefix: str) -> str:
        shown = []
        for name, key in _NAMES[family].items():
            if key == "betas" and "betas" in group:
                value = float(group["betas"][0 if name == "beta1" else 1])
            elif name == "velocityScaling" and not group.get("use_combined_accum", False):
                value = loss_scaling  # PopTorch's separate SGD variant: the loss scaling
                key = "loss_scaling"
            elif key in group:
                value = float(group[key])
            else:
                continue
            label = f"{prefix}{name[0].upper()}{name[1:]}" if prefix else name
            shown.append(f"{label}={value:g}{const(key)},")
        return " ".join(shown)

    def dtype(key: str) -> str:
        return str(optimizer.defaults.get(key, torch.float32)).replace("torch.", "")

    first = "velocity_accum_type" if family == "SGD" else "first_order_momentum_accum_type"
    lines = [f"Updating graph optimizer with {family}: accumType={dtype('accum_type')}, "
             f"firstOrderMomentumAccumType={dtype(first)}, secondOrderMomentumAccumType="
             f"{dtype('second_order_momentum_accum_type')}, "
             f"{values(optimizer.defaults, 'default')} "
             f"lossScaling={loss_scaling:g}{const('loss_scaling')}"]
    lines += [f"Updating group {index} optimizer with {family}: {values(group, '')}"
              for index, group in enumerate(optimizer.param_groups)]
    return lines


def read(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor] | None:
    """The hyper-parameters under PopTorch's names. Before a trainingModel compiled with it:
    None, or what was written (a loaded checkpoint's), as PopTorch returns it."""
    names = ipu_state.linked_names(optimizer)
    if names is None or not _family(optimizer):
        pending = optimizer.__dict__.get(_PENDING)
        return None if pending is None else dict(pending)
    ipu_state.sync(optimizer)
    as_loaded = ipu_state.loaded(optimizer, "ipu_param")
    if as_loaded is not None:  # read back as loaded until the model runs, as in PopTorch
        return as_loaded
    loss_scaling = float(optimizer.defaults.get("loss_scaling", 1.0))
    params: dict[str, torch.Tensor] = {LOSS_SCALING: torch.tensor(loss_scaling)}
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) in names:
                own = {**group, **per_param.own(optimizer, param)}
                for name, value in _group_values(optimizer, own, loss_scaling).items():
                    params[f"{name}{_SPECIFIC}{names[id(param)]}"] = torch.tensor(value)
    return params


def write(optimizer: torch.optim.Optimizer, params: dict[str, torch.Tensor | float]) -> None:
    """Set the hyper-parameters from PopTorch's names: now if compiled, else at compile."""
    if not isinstance(params, dict) or not all(isinstance(k, str) for k in params):
        raise TypeError("ipu_param must be a dict of PopTorch names (such as "
                        f"'learningRate___specific___fc.weight') to scalars, got "
                        f"{type(params).__name__}")
    if ipu_state.linked_names(optimizer) is None:
        optimizer.__dict__[_PENDING] = {**optimizer.__dict__.get(_PENDING, {}), **params}
        return
    ipu_state.sync(optimizer)
    _apply(optimizer, params)
    device_link.push(optimizer)


def apply_pending(optimizer: torch.optim.Optimizer) -> bool:
    """When linked: the hyper-parameters written before (`link` calls this).
    Returns whether there were any."""
    pending = optimizer.__dict__.pop(_PENDING, None)
    if pending:
        _apply(optimizer, pending)
    return bool(pending)


def _apply(optimizer: torch.optim.Optimizer, params: dict[str, torch.Tensor | float]) -> None:
    names = ipu_state.linked_names(optimizer)
    assert names is not None
    group_of = {names[id(p)]: index for index, g in enumerate(optimizer.param_groups)
                for p in g["params"] if id(p) in names}
    loss_scaling = float(optimizer.defaults.get("loss_scaling", 1.0))
    if LOSS_SCALING in params and not _same(loss_scaling, params[LOSS_SCALING]):
        optimizer.loss_scaling = float(params[LOSS_SCALING])  # type: ignore[attr-defined]  # a plain torch optimiser gets it
        loss_scaling = float(params[LOSS_SCALING])
    given: dict[str, dict[str, float]] = {}
    for key, value in ipu_state.poptorch_keys(params, group_of).items():
        if key == LOSS_SCALING:
            continue
        name, _, param_name = key.partition(_SPECIFIC)
        index = group_of.get(param_name)
        group = optimizer.param_groups[index] if index is not None else None
        known = (_SGD0 if group is not None and _sgd0(optimizer, group)
                 else tuple(_NAMES.get(_family(optimizer), ())))
        if index is None or name not in known:
            raise ValueError(f"ipu_param names a value this optimiser does not hold: {key!r}; "
                             f"it holds {sorted(known)} of parameters {sorted(group_of)[:6]} "
                             f"(and {LOSS_SCALING!r})")
        given.setdefault(param_name, {})[name] = float(value)
    for group in optimizer.param_groups:
        wanted = {}
        for param in group["params"]:
            if id(param) not in names:
                continue
            values = {k: v for k, v in group.items() if k != "params"}
            values.update(per_param.own(optimizer, param))
            current = _group_values(optimizer, values, loss_scaling)
            # The names hold float32 scalars: a value that reads back unchanged keeps the
            # one held (a checkpoint's lr 0.01 must not become 0.009999999776).
            changed = {name: value for name, value in given.get(names[id(param)], {}).items()
                       if name not in current or not _same(current[name], value)}
            if changed:
                _set_group(optimizer, values, changed)
            wanted[param] = values
        per_param.settle(optimizer, group, wanted)


def _same(current: float, value: torch.Tensor | float) -> bool:
    """Whether `value` is `current` as a float32 scalar holds it."""
    as_float32 = torch.tensor([float(current), float(value)], dtype=torch.float32)
    return bool(as_float32[0] == as_float32[1])


def _set_group(optimizer: torch.optim.Optimizer, group: ParamGroup,
               values: dict[str, float]) -> None:
    if _sgd0(optimizer, group):
        kept = 1.0 - float(group.get("dampening", 0.0))
        if "scaledLearningRate0" in values and kept:
            loss_scaling = float(optimizer.defaults.get("loss_scaling", 1.0))
            group["lr"] = values["scaledLearningRate0"] * loss_scaling / kept
        lr = float(group["lr"]) * kept
        if "weightDecayScaleFactor0" in values and lr:
            group["weight_decay"] = (1.0 - values["weightDecayScaleFactor0"]) / lr
        return
    table = _NAMES[_family(optimizer)]
    for name, value in values.items():
        key = table[name]
        if key == "betas":
            betas = list(group["betas"])
            betas[0 if name == "beta1" else 1] = value
            group["betas"] = tuple(betas)
        else:
            group[key] = value


def link(optimizer: torch.optim.Optimizer, model: torch.nn.Module, *,
         sync: Callable[[], None], push: Callable[[], None]) -> None:
    """Tie `optimizer` to its compiled model (the executor calls this), then apply the state
    and hyper-parameters written before, and send them to the device if it runs."""
    state_written = ipu_state.link(optimizer, model, sync=sync, push=push)
    if apply_pending(optimizer) or state_written:
        device_link.push(optimizer)  # setOptimizer of an optimiser holding a checkpoint's state
