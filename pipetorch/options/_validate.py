"""Checks shared by every Options setter: each returns the normalised value or raises."""
from __future__ import annotations

import enum
import numbers
import os
import re
import tempfile
from typing import Iterable, TypeVar

import torch

E = TypeVar("E", bound=enum.Enum)


def _shown(value: object) -> str:
    return f"{value!r} ({type(value).__name__})"


def type_error(setter: str, arg: str, value: object, accepted: str) -> TypeError:
    """A TypeError naming the setter, the argument, what it accepts and what it got."""
    return TypeError(f"{setter}: {arg} must be {accepted}; got {_shown(value)}")


def value_error(setter: str, arg: str, value: object, accepted: str) -> ValueError:
    """A ValueError naming the setter, the argument, what it accepts and what it got."""
    return ValueError(f"{setter}: {arg} must be {accepted}; got {_shown(value)}")


def boolean(setter: str, arg: str, value: object) -> bool:
    """`value` itself if it is a bool (1/0 are refused: they usually hide a mistake)."""
    if not isinstance(value, bool):
        raise type_error(setter, arg, value, "True or False")
    return value


def integer(setter: str, arg: str, value: object, *, minimum: int | None = None,
            maximum: int | None = None) -> int:
    """`value` as an int, within [minimum, maximum] when those are given."""
    accepted = "an int" + (f" >= {minimum}" if minimum is not None else "") + (
        f" and <= {maximum}" if maximum is not None else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise type_error(setter, arg, value, accepted)
    value = int(value)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise value_error(setter, arg, value, accepted)
    return value


def enum_member(setter: str, arg: str, value: object, enum_cls: type[E], *,
                allowed: Iterable[E] | None = None) -> E:
    """`value` if it is a member of `enum_cls` (and of `allowed` when given)."""
    members = list(enum_cls) if allowed is None else list(allowed)
    accepted = "one of " + ", ".join(f"{enum_cls.__name__}.{m.name}" for m in members)
    if not isinstance(value, enum_cls):
        raise type_error(setter, arg, value, accepted)
    if value not in members:
        raise value_error(setter, arg, value, accepted)
    return value


def text(setter: str, arg: str, value: object) -> str:
    """`value` if it is a non-empty string."""
    if not isinstance(value, str):
        raise type_error(setter, arg, value, "a non-empty str")
    if not value:
        raise value_error(setter, arg, value, "a non-empty str")
    return value


def path(setter: str, arg: str, value: object, *, optional: bool = False) -> str | None:
    """`value` as a str path (str or os.PathLike, non-empty); None passes when optional."""
    accepted = "a non-empty path (str or os.PathLike)" + (" or None" if optional else "")
    if value is None and optional:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise type_error(setter, arg, value, accepted)
    value = os.fspath(value)
    if not isinstance(value, str) or not value:
        raise value_error(setter, arg, value, accepted)
    return value


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def directory_problem(value: str) -> str | None:
    """Why `value` cannot hold files pipetorch writes (a cache, reports), or None if it can:
    a writable directory, or a path whose nearest existing ancestor is a writable directory
    (it is created when first needed).

    Permission bits are not trusted (root passes every os.access check, yet cannot create
    anything under /proc or /sys): the directory is really created and written to, and what
    this check created is removed again.
    """
    control = _CONTROL.search(value)
    if control:
        return (f"contains the control character {control.group()!r} at position "
                f"{control.start()} (a stray newline or escape in a shell variable?)")
    target = os.path.abspath(value)
    if os.path.lexists(target):
        if not os.path.exists(target):
            return "is a broken symbolic link"
        if not os.path.isdir(target):
            return "is a file, not a directory"
        return _write_problem(target, "is a directory this process cannot write to")
    parent = os.path.dirname(target)
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)  # "/" always exists: the loop ends
    if not os.path.isdir(parent):
        return f"cannot be created: {parent!r} is a file, not a directory"
    created = _created_by_makedirs(target, parent)
    try:
        os.makedirs(target)
    except OSError as error:
        return f"cannot be created under {parent!r} ({error.strerror or error})"
    try:
        return _write_problem(target, f"cannot be written to once created under {parent!r}")
    finally:
        for directory in created:
            try:
                os.rmdir(directory)
            except OSError:
                break  # something else now uses it: leave it


def _created_by_makedirs(target: str, parent: str) -> list[str]:
    """The directories makedirs(target) creates below the existing `parent`, deepest first."""
    created = []
    while target != parent:
        created.append(target)
        target = os.path.dirname(target)
    return created


def _write_problem(directory: str, problem: str) -> str | None:
    """`problem` (with the OS's reason) unless a file can be created in `directory`."""
    try:
        with tempfile.TemporaryFile(dir=directory):
            return None
    except OSError as error:
        return f"{problem} ({error.strerror or error})"


def output_directory(setter: str, arg: str, value: object, *, holds: str) -> str | None:
    """`value` as a path (or None) to a directory that can be created and written; `holds`
    says what goes there, for the message ("the executable cache")."""
    directory = path(setter, arg, value, optional=True)
    problem = None if directory is None else directory_problem(directory)
    if problem:
        raise ValueError(f"{setter}: {arg} {directory!r} {problem}. Pass a directory for "
                         f"{holds} (it is created if missing) that this process can write to")
    return directory


def strings(setter: str, arg: str, value: object) -> list[str]:
    """`value` as a list of str (from a list, tuple or set of str)."""
    accepted = "a list of str"
    if isinstance(value, str) or not isinstance(value, (list, tuple, set, frozenset)):
        raise type_error(setter, arg, value, accepted)
    for item in value:
        if not isinstance(item, str):
            raise type_error(setter, f"every item of {arg}", item, "a str")
    return list(value)


def proportion(setter: str, arg: str, value: object) -> float:
    """`value` as a float in (0, 1]."""
    accepted = "a number in (0, 1]"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise type_error(setter, arg, value, accepted)
    if not 0.0 < float(value) <= 1.0:
        raise value_error(setter, arg, value, accepted)
    return float(value)


def dtype(setter: str, arg: str, value: object, allowed: Iterable[torch.dtype]) -> torch.dtype:
    """`value` if it is one of the `allowed` torch dtypes."""
    allowed = list(allowed)
    accepted = "one of " + ", ".join(str(d) for d in allowed)
    if not isinstance(value, torch.dtype):
        raise type_error(setter, arg, value, accepted)
    if value not in allowed:
        raise value_error(setter, arg, value, accepted)
    return value
