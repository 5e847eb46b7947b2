"""Model annotations: `Block` scopes, `BeginBlock` hooks and the recorder that sees them run."""
from __future__ import annotations

import functools
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Callable, Generic, Iterator, ParamSpec, TypeVar

import torch.nn as nn

from pipetorch.errors import ConfigError

__all__ = ["Block", "BeginBlock", "BlockFunction", "removeBlocks"]

P = ParamSpec("P")
R = TypeVar("R")
M = TypeVar("M", bound=nn.Module)

_BEGIN_ATTR = "_pipetorch_begin_block"


@dataclass(frozen=True)
class BlockInfo:
    """A block as seen while `forward` ran: its id, its device (if given) and its order."""

    user_id: str
    ipu_id: int | None
    order: int


class BlockRecorder:
    """Tracks which block is active while a model's forward runs (one per capture)."""

    def __init__(self) -> None:
        self.blocks: dict[str, BlockInfo] = {}
        self._scopes: list[str] = []
        self._floating: str | None = None  # started by BeginBlock / Block.start, no scope
        self.last_ended: str | None = None
        self.ops_before_blocks = False  # set by whoever watches ops (the capture's guard)
        self.on_change: Callable[[], None] | None = None  # told when the active block changes

    @property
    def used(self) -> bool:
        """True once any block has started."""
        return bool(self.blocks)

    def current(self) -> str | None:
        """The id of the block that owns ops running now, or None."""
        return self._scopes[-1] if self._scopes else self._floating

    def begin(self, user_id: str, ipu_id: int | None, *, scoped: bool) -> None:
        known = self.blocks.get(user_id)
        if known is None:
            self.blocks[user_id] = BlockInfo(user_id, ipu_id, len(self.blocks))
        elif ipu_id is not None and known.ipu_id not in (None, ipu_id):
            raise ValueError(
                f"Block {user_id!r} is placed on ipu_id {known.ipu_id} and again on ipu_id "
                f"{ipu_id}; a block lives on one device: use another user_id for the second part"
            )
        elif ipu_id is not None and known.ipu_id is None:
            self.blocks[user_id] = BlockInfo(user_id, ipu_id, known.order)
        if scoped:
            self._scopes.append(user_id)
        else:
            self._floating = user_id
        self._changed()

    def end(self) -> None:
        self.last_ended = self._scopes.pop()
        # A scope's end closes every block: ops after it need a new block (PopTorch's rule).
        self._floating = None
        self._changed()

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def ordered(self) -> list[BlockInfo]:
        """Blocks in the order forward first entered them."""
        return sorted(self.blocks.values(), key=lambda b: b.order)


class _State(threading.local):
    def __init__(self) -> None:
        self.recorder: BlockRecorder | None = None
        self.auto_id = 0


_state = _State()


@contextmanager
def recording() -> Iterator[BlockRecorder]:
    """Record the blocks that a forward pass enters (used by the executor's capture)."""
    previous, _state.recorder = _state.recorder, BlockRecorder()
    _state.auto_id = 0
    try:
        yield _state.recorder
    finally:
        _state.recorder = previous


def active_recorder() -> BlockRecorder | None:
    """The recorder of the capture in progress, if any."""
    return _state.recorder


def _resolve_ids(user_id: str | None, ipu_id: int | None) -> tuple[str, int | None]:
    if ipu_id is not None and (isinstance(ipu_id, bool) or not isinstance(ipu_id, int) or ipu_id < 0):
        raise ValueError(f"ipu_id must be an int >= 0, got {ipu_id!r}")
    if user_id is None:
        user_id = str(_state.auto_id)
        _state.auto_id += 1
    elif not isinstance(user_id, (str, int)):
        raise TypeError(f"Block user_id must be a str, got {type(user_id).__name__} ({user_id!r})")
    return str(user_id), ipu_id


class Block:
    """`with Block("B1"):` or `with Block(ipu_id=1):` puts the ops inside on one block.

    Blocks are grouped into stages by the execution strategy; blocks with the same
    `user_id` are one block. Outside a pipetorch capture a Block does nothing.
    """

    def __init__(self, user_id: str | None = None, ipu_id: int | None = None) -> None:
        self._user_id, self._ipu_id = _resolve_ids(user_id, ipu_id)

    @property
    def user_id(self) -> str:
        return self._user_id

    @property
    def ipu_id(self) -> int | None:
        return self._ipu_id

    @staticmethod
    def useAutoId() -> None:
        """Number blocks created without a user_id 0, 1, 2, ... from here on."""
        _state.auto_id = 0

    @staticmethod
    def start(user_id: str | None = None, ipu_id: int | None = None) -> None:
        """Start a block that lasts until the next block starts (no `with` needed)."""
        uid, iid = _resolve_ids(user_id, ipu_id)
        if _state.recorder is not None:
            _state.recorder.begin(uid, iid, scoped=False)

    def __enter__(self) -> "Block":
        if _state.recorder is not None:
            _state.recorder.begin(self._user_id, self._ipu_id, scoped=True)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if _state.recorder is not None:
            _state.recorder.end()


class _BlockHook:
    """The forward pre-hook BeginBlock adds; prints as PopTorch prints it (see module_repr)."""

    def __init__(self, user_id: str, ipu_id: int | None, *, given: str | None = None) -> None:
        self.user_id, self.ipu_id = user_id, ipu_id
        self.given = given  # the user_id the user passed: None for an automatic one

    def __call__(self, module: nn.Module, args: tuple[object, ...]) -> None:
        if _state.recorder is not None:
            _state.recorder.begin(self.user_id, self.ipu_id, scoped=False)

    def __repr__(self) -> str:
        return f"BeginBlock(user_id={getattr(self, 'given', self.user_id)}, ipu_id={self.ipu_id})"


class _BeginBlockFunction(nn.Module, Generic[P, R]):
    """What BeginBlock returns for a function (PopTorch returns a module too): calling it
    starts the block, then calls the function. A module, so a model holding one pickles."""

    def __init__(self, func: Callable[P, R], ids: tuple[str, int | None],
                 given: str | None) -> None:
        super().__init__()
        self.func, self.ids, self.given = func, ids, given
        functools.update_wrapper(self, func, updated=())  # its __name__, __doc__, __wrapped__

    def forward(self, *args: P.args, **kwargs: P.kwargs) -> R:
        if _state.recorder is not None:
            _state.recorder.begin(*self.ids, scoped=False)
        return self.func(*args, **kwargs)

    @property
    def _user_id(self) -> str | None:
        """The user_id given to BeginBlock (PopTorch's attribute name)."""
        return self.given

    @property
    def _ipu_id(self) -> int | None:
        """The ipu_id given to BeginBlock (PopTorch's attribute name)."""
        return self.ids[1]

    def extra_repr(self) -> str:
        name = getattr(self.func, "__qualname__", repr(self.func))
        return f"{name}, user_id={self.given}, ipu_id={self.ids[1]}"


def BeginBlock(layer_to_call: M, user_id: str | None = None, ipu_id: int | None = None) -> M:
    """Start a block when `layer_to_call` runs; it lasts until the next block starts.

    Returns the same module, so `model.layer4 = BeginBlock(model.layer4, ipu_id=1)` works.
    A plain function is accepted as PopTorch accepts it: the returned module starts the
    block, then calls it. The block id is `user_id`, or the next automatic one (printed as
    `BeginBlock(user_id=None, ipu_id=1)`, as PopTorch prints it before compiling).
    """
    if not isinstance(layer_to_call, nn.Module):
        if not callable(layer_to_call):
            raise TypeError(
                f"BeginBlock expects an nn.Module or a function, got "
                f"{type(layer_to_call).__name__} ({layer_to_call!r}); pass the layer to call")
        ids = _resolve_ids(user_id, ipu_id)
        return _BeginBlockFunction(layer_to_call, ids, user_id)
    if hasattr(layer_to_call, _BEGIN_ATTR):
        uid, iid = getattr(layer_to_call, _BEGIN_ATTR)[0]
        raise ConfigError(  # PopTorch's sentence first
            f"This module has already been assigned to a block: {type(layer_to_call).__name__} "
            f"already begins block {uid!r} (ipu_id={iid}); a module can begin only one "
            "block: call removeBlocks(module) first to change it")
    ids = _resolve_ids(user_id, ipu_id)
    handle = layer_to_call.register_forward_pre_hook(_BlockHook(*ids, given=user_id))
    # Keep the hook's id, not the handle: a deepcopy of the model must remove its own hook.
    object.__setattr__(layer_to_call, _BEGIN_ATTR, (ids, handle.id))
    return layer_to_call


def BlockFunction(user_id: str | None = None,
                  ipu_id: int | None = None) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorator: every call of the function runs inside `Block(user_id, ipu_id)`."""

    def decorate(func: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(func)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            with Block(user_id, ipu_id):
                return func(*args, **kwargs)

        return wrapper

    return decorate


def removeBlocks(module: nn.Module) -> nn.Module:
    """Remove every BeginBlock annotation from `module` and its children."""
    for child in module.modules():
        marker = child.__dict__.pop(_BEGIN_ATTR, None)
        if marker is not None:
            child._forward_pre_hooks.pop(marker[1], None)
    return module


def begin_blocks(module: nn.Module) -> dict[str, tuple[str, int | None]]:
    """BeginBlock annotations in `module`: qualified submodule name -> (user_id, ipu_id)."""
    return {
        name: child.__dict__[_BEGIN_ATTR][0]
        for name, child in module.named_modules()
        if _BEGIN_ATTR in child.__dict__
    }
