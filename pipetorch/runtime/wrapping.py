"""How a wrapper stands for its model, as PopTorch's does: `isinstance(wrapped, type(model))`
holds, `model.destroy()` on the user's model destroys the model's wrappers, and a model has
one live training wrapper at most."""
from __future__ import annotations

import weakref
from typing import Protocol

import torch.nn as nn

from pipetorch.errors import AlreadyWrappedError

__all__: list[str] = []


class Wrapper(Protocol):
    """What `model.destroy()` reaches: a wrapper (PoplarExecutor) of the model."""

    def destroy(self) -> None: ...


# user model -> every live wrapper of it, for `model.destroy()`.
_wrappers: "weakref.WeakKeyDictionary[nn.Module, weakref.WeakSet[Wrapper]]" = (
    weakref.WeakKeyDictionary())
# user model -> its live training wrapper: two would train diverging device copies.
_training_wrappers: "weakref.WeakKeyDictionary[nn.Module, weakref.ref[Wrapper]]" = (
    weakref.WeakKeyDictionary())
_DESTROY = "destroy"
_classes: dict[tuple[type, type], type] = {}


class DestroyHandle:
    """`model.destroy()`: destroys every live wrapper of the model. Copies and pickles of
    the model get a handle that does nothing."""

    def __init__(self, model: nn.Module | None) -> None:
        self._model = weakref.ref(model) if model is not None else (lambda: None)

    def __call__(self) -> None:
        model = self._model()
        if model is not None:
            for wrapper in list(_wrappers.get(model, ())):
                wrapper.destroy()

    def __reduce__(self) -> tuple:
        return DestroyHandle, (None,)


def register(model: nn.Module, wrapper: Wrapper) -> None:
    """`wrapper` now wraps `model`: `model.destroy()` reaches it."""
    _wrappers.setdefault(model, weakref.WeakSet()).add(wrapper)
    if not isinstance(model.__dict__.get(_DESTROY), DestroyHandle):
        object.__setattr__(model, _DESTROY, DestroyHandle(model))  # not a submodule or weight


def forget(model: nn.Module, wrapper: Wrapper) -> None:
    """`wrapper` is destroyed; with no wrapper left the model loses its `destroy`."""
    wrappers = _wrappers.get(model)
    if wrappers is None:
        return
    wrappers.discard(wrapper)
    if not wrappers and isinstance(model.__dict__.get(_DESTROY), DestroyHandle):
        del model.__dict__[_DESTROY]


def claim_for_training(model: nn.Module, wrapper: Wrapper) -> None:
    """`wrapper` trains `model`, which has no other live training wrapper."""
    other = _training_wrappers.get(model)
    if other is not None and other() is not None:
        raise AlreadyWrappedError(
            "Model has already been wrapped in 'poptorch.trainingModel'. Call "
            "model.destroy() on the model to unwrap before wrapping again (this "
            "destroys its live trainingModel, whose device copy would otherwise train "
            "apart)")
    _training_wrappers[model] = weakref.ref(wrapper)


def release_for_training(model: nn.Module, wrapper: Wrapper) -> None:
    """`wrapper`, destroyed, no longer trains `model`."""
    if _training_wrappers.get(model) is not None and _training_wrappers[model]() is wrapper:
        del _training_wrappers[model]


def wrapper_class(executor: type, model_class: type) -> type:
    """A class that is both `executor` and the model's own class (what a wrapper's
    `__class__` answers, so `isinstance(wrapped, type(model))` holds)."""
    base = model_class.__dict__.get("_pipetorch_base", model_class)  # the host-sync subclass
    if (executor, base) not in _classes:
        _classes[executor, base] = type(base.__name__, (executor, base), {
            "__module__": base.__module__, "__qualname__": base.__qualname__})
    return _classes[executor, base]
