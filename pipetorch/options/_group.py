"""The base of Options and its groups: stored values, read-backs, freezing, copies, toDict."""
from __future__ import annotations

import copy
import difflib
import enum
import functools
import inspect
from typing import Any, Callable, ClassVar, Concatenate, ParamSpec, TypeVar

import torch

FROZEN_MESSAGE = "Can't modify frozen Options"
# Public methods that read rather than set: not offered as setters in messages or files.
_NOT_SETTERS = frozenset({"toDict", "clone", "defaultOutputMode"})
_GUARDED: set[Callable[..., object]] = set()  # what _guarded returned: never wrapped twice
P = ParamSpec("P")
R = TypeVar("R")


def _call_text(group: OptionGroup, name: str, args: tuple, kwargs: dict) -> str:
    """How the refused call reads in the user's script: `Training.gradientAccumulation(4)`."""
    prefix = group._LABEL.removeprefix("Options").lstrip(".")
    shown = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"{prefix + '.' if prefix else ''}{name}({', '.join(shown)})"


def frozen_error(group: OptionGroup, call: str) -> AttributeError:
    """PopTorch's "Can't modify frozen Options", then which call, what froze them, the fix."""
    by = group._frozen_by or "a wrapper (trainingModel / inferenceModel) or a DataLoader"
    return AttributeError(
        f"{FROZEN_MESSAGE}: {call} came after these options were given to {by}, which keeps "
        "the values it was built with. Set every option before wrapping the model or building "
        "the DataLoader, or change a copy: `opts = opts.clone()`, call the setter on it and "
        "wrap (or build the DataLoader) again with the copy")


def _guarded(name: str, setter: Callable[Concatenate[OptionGroup, P], R]
             ) -> Callable[Concatenate[OptionGroup, P], R]:
    """`setter`, refusing with the call's own text when its options are frozen."""

    @functools.wraps(setter)
    def guarded(self: OptionGroup, *args: P.args, **kwargs: P.kwargs) -> R:
        if self._is_frozen:
            raise frozen_error(self, _call_text(self, name, args, kwargs))
        return setter(self, *args, **kwargs)

    _GUARDED.add(guarded)
    return guarded


def readback(name: str, doc: str) -> property:
    """A read-only property returning the stored value `name` (containers as copies)."""

    def get(self: OptionGroup) -> Any:
        value = self._values[name]
        # A copy, so editing what was read cannot bypass validation or freezing.
        return copy.copy(value) if isinstance(value, (dict, list, set)) else value

    return property(get, doc=doc)


def plain(value: object) -> Any:
    """`value` made JSON-friendly: dtypes as strings, containers as dicts/lists, objects as repr."""
    if value is None or isinstance(value, (bool, int, float, str, enum.Enum)):
        return value  # IntEnum members serialise to JSON as their int
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [plain(v) for v in value]
    if isinstance(value, OptionGroup):
        return value.toDict()
    return repr(value)


class OptionGroup:
    """Values set through validated setters, read back as snake_case properties.

    Subclasses list their defaults in `_DEFAULTS` and their nested groups in `_SUBGROUPS`.
    Assigning a public attribute is refused: options change only through setters.
    """

    _LABEL: ClassVar[str] = "Options"
    _DEFAULTS: ClassVar[dict[str, Any]] = {}
    _SUBGROUPS: ClassVar[tuple[str, ...]] = ()
    _frozen_by = ""  # what froze the options ("poptorch.trainingModel"), named when refusing

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        # Every public method is a setter: refused, naming itself, once the options are frozen.
        for name, value in list(vars(cls).items()):
            if (not name.startswith("_") and name not in _NOT_SETTERS
                    and inspect.isfunction(value) and value not in _GUARDED):
                setattr(cls, name, _guarded(name, value))

    def __init__(self) -> None:
        self._values: dict[str, Any] = copy.deepcopy(self._DEFAULTS)
        self._is_frozen = False

    def _set(self, **values: object) -> None:
        self._check_not_frozen()
        self._values.update(values)

    def _check_not_frozen(self) -> None:
        if self._is_frozen:  # setters are guarded first; this backs up internal writers
            raise frozen_error(self, f"changing {self._LABEL}")

    def _freeze(self, *, by: str = "") -> None:
        """Refuse every later setter call, here and in the nested groups; `by` names what
        froze them (e.g. "poptorch.trainingModel") for the refusal's message."""
        self._is_frozen = True
        self._frozen_by = self._frozen_by or by
        for group in self._groups().values():
            group._freeze(by=by)

    def _groups(self) -> dict[str, OptionGroup]:
        return {name: getattr(self, name) for name in self._SUBGROUPS}

    def _export(self) -> dict[str, Any]:
        """The values toDict reports; groups with computed values override this."""
        return dict(self._values)

    def toDict(self) -> dict[str, Any]:
        """Every option of this group (and its nested groups) as a plain, JSON-friendly dict."""
        out = {name: plain(value) for name, value in self._export().items()}
        out.update({name: group.toDict() for name, group in self._groups().items()})
        return out

    @classmethod
    def _setter_names(cls) -> list[str]:
        """Public methods and nested groups: the names a user may call or walk into."""
        names = []
        for name in dir(cls):
            if name.startswith("__") or name in _NOT_SETTERS or (
                    name.startswith("_") and name not in cls._SUBGROUPS):
                continue
            if name in cls._SUBGROUPS or callable(inspect.getattr_static(cls, name)):
                names.append(name)
        return names

    @classmethod
    def _readback_names(cls) -> list[str]:
        return [n for n in dir(cls) if not n.startswith("_") and n not in cls._SUBGROUPS
                and isinstance(inspect.getattr_static(cls, n), property)]

    def _unknown(self, problem: str, name: str, *, readbacks: bool) -> AttributeError:
        valid = self._setter_names()
        candidates = valid + (self._readback_names() if readbacks else [])
        close = difflib.get_close_matches(name, candidates, n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        return AttributeError(f"{problem}.{hint} Valid setters: {', '.join(valid)}")

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup failed: the name is a typo or unknown option.
        if name.startswith("_"):
            raise AttributeError(name)
        getter = inspect.getattr_static(type(self), name, None)
        if isinstance(getter, property) and getter.fget is not None:
            # A read-back whose getter raised AttributeError: surface that error, not a typo.
            return getter.fget(self)
        raise self._unknown(f"{self._LABEL} has no option {name!r}", name, readbacks=True)

    def __setattr__(self, name: str, value: object) -> None:
        if name.startswith("_"):
            object.__setattr__(self, name, value)
            return
        raise self._unknown(f"Cannot assign {self._LABEL}.{name}: options are set by calling "
                            "setters, not by assignment", name, readbacks=False)

    def __copy__(self) -> OptionGroup:
        # A shallow copy would share the values with the original, so that setting one set
        # both: `copy.copy(opts)` is a clone, as `copy.deepcopy` and `clone()` are.
        return copy.deepcopy(self)

    def __deepcopy__(self, memo: dict) -> OptionGroup:
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            object.__setattr__(new, key, copy.deepcopy(value, memo))
        object.__setattr__(new, "_is_frozen", False)  # copies are always editable
        object.__setattr__(new, "_frozen_by", "")
        return new

    def __repr__(self) -> str:
        body = ", ".join(f"{k}={v!r}" for k, v in self.toDict().items())
        return f"{self._LABEL}({body})"
