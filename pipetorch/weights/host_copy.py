"""The user's model as the host copy: lazy, one-time copy back of the device's weights."""
from __future__ import annotations

import copy
import inspect
import types
import weakref
from typing import Any, Callable, SupportsIndex, TypeAlias

import torch
import torch.nn as nn

__all__: list[str] = []

_SYNC_ATTR = "_pipetorch_host_sync"
# a pending fetch: the function, or a weak reference to the wrapper's bound method
_Fetch: TypeAlias = Callable[[], None] | weakref.WeakMethod[Callable[[], None]]
_classes: dict[type, type] = {}


class HostSync:
    """Shared by every wrapper of one user model.

    A training call leaves the host copy stale and registers how to fetch the device's
    weights; the first access to the user model's parameters, buffers, state_dict or
    forward fetches them once. `generation` counts those fetches, so an inference wrapper
    on the same model knows when to upload the new weights.
    """

    def __init__(self) -> None:
        # every module whose weight accessors flush: the wrapped models and, where another
        # module runs in its place sharing its weights (PopTorch's `user_model`), the user's
        self.modules: list[nn.Module] = []
        self.generation = 0
        self.users = 0
        self._pending: _Fetch | None = None
        self._busy = False

    def mark_stale(self, fetch: Callable[[], None]) -> None:
        """The device has newer weights; `fetch` copies them into the user model.

        A wrapper's bound method is held weakly so the model does not keep its wrapper
        alive: such a cycle is only broken at interpreter exit, too late to copy safely.
        The wrapper flushes when it is deleted.
        """
        self._pending = _weak(fetch)

    def flush(self) -> None:
        """Copy the device's weights to the user model if they are newer (the pending fetch
        calls `run`)."""
        if self._pending is None or self._busy:
            return
        fetch, self._pending = _strong(self._pending), None
        if fetch is not None:  # else its wrapper is gone
            fetch()

    def run(self, copy: Callable[[], None]) -> None:
        """Copy the device's weights into the user model with `copy` now; nothing is pending
        after it."""
        self._pending = None
        self._busy = True  # the copy itself touches the model's attributes
        try:
            copy()
        finally:
            self._busy = False
        self.generation += 1


def _weak(fn: Callable[[], None]) -> _Fetch:
    return weakref.WeakMethod(fn) if inspect.ismethod(fn) else fn


def _strong(ref: _Fetch) -> Callable[[], None] | None:
    return ref() if isinstance(ref, weakref.WeakMethod) else ref


def _new_module(cls: type[nn.Module]) -> nn.Module:
    """Unpickling helper: an empty instance of the model's own class."""
    return cls.__new__(cls)


def _synced_class(cls: type[nn.Module]) -> type:
    """`cls` with the accessors that read weights flushing the pending device copy first."""
    if cls not in _classes:
        def flushing(name: str) -> Callable[..., object]:
            original = getattr(cls, name)

            def method(self: nn.Module, *args: object, **kwargs: object) -> object:
                sync = self.__dict__.get(_SYNC_ATTR)
                if sync is not None:
                    sync.flush()
                return original(self, *args, **kwargs)

            method.__name__ = name
            return method

        def __reduce_ex__(self: nn.Module, protocol: SupportsIndex
                          ) -> tuple[Callable[[type[nn.Module]], nn.Module], tuple[type[nn.Module]],
                                     dict[str, object]]:
            # Pickles and deep copies hold the fresh weights and the model's own class.
            sync = self.__dict__.get(_SYNC_ATTR)
            if sync is not None:
                sync.flush()
            state = {k: v for k, v in self.__dict__.items() if k != _SYNC_ATTR}
            return _new_module, (cls,), state

        names = ("__getattr__", "__call__", "state_dict", "named_parameters", "parameters",
                 "named_buffers", "buffers", "_apply")
        _classes[cls] = type(cls.__name__, (cls,), {n: flushing(n) for n in names} | {
            "__module__": cls.__module__, "__qualname__": cls.__qualname__,
            "_pipetorch_base": cls, "__reduce_ex__": __reduce_ex__})
    return _classes[cls]


def attach(model: nn.Module, shown: nn.Module | None = None) -> HostSync:
    """The HostSync of `model` (and `shown`: the user's model, when `model` runs in its place
    sharing its weights), installing the flushing accessors on first use.

    Wrappers of the same weights share one HostSync, whichever was compiled first: an
    inference wrapper of the user's model must see what a training wrapper of a module
    around it (PopTorch's tests' loss wrapper) leaves stale.
    """
    roots = [model] if shown is None or shown is model else [model, shown]
    found = [r.__dict__.get(_SYNC_ATTR) for r in roots]
    sync = next((s for s in found if s is not None), None) or HostSync()
    for root in roots:
        for module in root.modules():
            if module.__dict__.get(_SYNC_ATTR) is not sync:
                _adopt(sync, module)
    sync.users += 1
    return sync


def _adopt(sync: HostSync, module: nn.Module) -> None:
    """Make `module`'s weight accessors flush `sync` (taking it over from another sync)."""
    object.__setattr__(module, _SYNC_ATTR, sync)
    if "_pipetorch_base" not in type(module).__dict__:
        module.__class__ = _synced_class(type(module))
    if all(module is not m for m in sync.modules):
        sync.modules.append(module)


def detach(sync: HostSync) -> None:
    """One wrapper less; the last one restores the model's own classes."""
    sync.users -= 1
    if sync.users > 0:
        return
    sync.flush()
    for module in sync.modules:
        if module.__dict__.get(_SYNC_ATTR) is sync:
            module.__dict__.pop(_SYNC_ATTR, None)
            base = type(module).__dict__.get("_pipetorch_base")
            if base is not None:
                module.__class__ = base
    sync.modules.clear()


def device_copy(model: nn.Module, device: torch.device) -> nn.Module:
    """A private copy of the model on `device`, free of host-sync machinery."""
    memo: dict[int, Any] = {}
    clone = copy.deepcopy(model, memo)  # __reduce_ex__ above strips the sync machinery
    _rebind_closures(clone, memo)
    return clone.to(device)


def _rebind_closures(clone: nn.Module, memo: dict[int, Any]) -> None:
    """Point the copy's `forward`s at the copy's submodules where they name the model's own
    submodules through a closure (a model class defined inside a function, calling the
    enclosing `base_model` rather than `self.base_model`). PopTorch runs the user's module
    objects, so such a model trains there; a copy calling the originals would train nothing.
    """
    for module in clone.modules():
        forward = type(module).forward
        cells = getattr(forward, "__closure__", None) or ()
        copied = [_copied_module(cell, memo) for cell in cells]
        if any(c is not None for c in copied):
            new_cells = tuple(cell if c is None else types.CellType(c)
                              for cell, c in zip(cells, copied, strict=True))
            rebound = types.FunctionType(forward.__code__, forward.__globals__,
                                         forward.__name__, forward.__defaults__, new_cells)
            rebound.__kwdefaults__ = forward.__kwdefaults__
            object.__setattr__(module, "forward", types.MethodType(rebound, module))


def _copied_module(cell: types.CellType, memo: dict[int, Any]) -> nn.Module | None:
    """The copy of the module a closure cell holds, when that module was copied with the
    model (a submodule of it); None otherwise."""
    try:
        held_value = cell.cell_contents
    except ValueError:  # an empty cell
        return None
    twin = memo.get(id(held_value)) if isinstance(held_value, nn.Module) else None
    return twin if twin is not held_value else None


@torch.no_grad()
def copy_state(source: nn.Module, target: nn.Module) -> None:
    """Copy parameters and buffers in place, keeping the target's tensor objects (nothing to
    do when the engine's host copy is the user's model itself)."""
    if source is target:
        return
    src: dict[str, torch.Tensor] = dict(source.named_parameters(remove_duplicate=False))
    src.update(source.named_buffers(remove_duplicate=False))
    for name, tensor in [*target.named_parameters(remove_duplicate=False),
                         *target.named_buffers(remove_duplicate=False)]:
        tensor.copy_(src[name])


def held(model: nn.Module, slot: str) -> dict[str, torch.Tensor]:
    """`model`'s parameters (slot "_parameters") or buffers ("_buffers") by qualified name,
    read without the accessors that would copy the device's weights back first."""
    return {f"{prefix}.{name}" if prefix else name: t
            for prefix, module in model.named_modules()
            for name, t in module.__dict__[slot].items() if t is not None}
