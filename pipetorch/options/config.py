"""Options from text: dotted setter names (environment JSON) and option files, never eval'd.

A file line such as `Training.gradientAccumulation(2)` or
`TensorLocations.setOptimizerLocation(poptorch.TensorLocationSettings().useOnChipStorage(False))`
is parsed with `ast` and walked by hand: only attribute chains and calls are followed,
arguments are literals or `poptorch.` / `pipetorch.` names (enums, option and strategy
classes) or `torch.<dtype>`, and only option and partition objects may be called.
"""
from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

import pipetorch
from pipetorch.errors import ConfigError, ConfigFileError
from pipetorch.options._group import OptionGroup

__all__ = ["apply_setting", "load_file"]

# Classes and methods defined here may be called from a file; nothing else can.
_CALLABLE_HOMES = ("pipetorch.options", "pipetorch.partition")
_ARGUMENT_ROOTS = {"poptorch": pipetorch, "pipetorch": pipetorch, "torch": torch}


class _Refused(Exception):
    """A construct an option line may not use; the message says which and why."""


def _member(owner: object, name: str, shown: str) -> Any:
    """`owner.name` where `shown` is how the chain up to `owner` is written."""
    if isinstance(owner, OptionGroup):
        valid = owner._setter_names()
        if name not in valid:
            raise _Refused(f"{shown or 'Options'} has no option {name!r}; "
                           f"valid: {', '.join(valid)}")
        return getattr(owner, name)
    if name.startswith("_"):
        raise _Refused(f"private name {name!r} is not allowed")
    if owner is torch:
        value = getattr(torch, name, None)
        if not isinstance(value, torch.dtype):
            raise _Refused(f"only dtypes (torch.float16, ...) may be used from torch, not {name!r}")
        return value
    try:
        return getattr(owner, name)
    except AttributeError as err:
        raise _Refused(f"{shown} has no attribute {name!r}") from err


def _check_callable(func: object, shown: str) -> None:
    owner = type(func.__self__) if inspect.ismethod(func) else func
    if not (inspect.isclass(owner) and owner.__module__.startswith(_CALLABLE_HOMES)):
        raise _Refused(f"{shown} may not be called: only option setters, "
                       "TensorLocationSettings and execution strategies can be")


class _Walker:
    """Evaluates one parsed line: a chain rooted at the options object."""

    def __init__(self, options: OptionGroup) -> None:
        self.options = options

    def line(self, node: ast.expr) -> None:
        if not isinstance(node, ast.Call):
            raise _Refused("a line must call a setter, e.g. deviceIterations(4)")
        self._chain(node, lambda name: _member(self.options, name, ""))

    def _chain(self, node: ast.expr, root: Callable[[str], object]) -> Any:
        if isinstance(node, ast.Name):
            return root(node.id)
        if isinstance(node, ast.Attribute):
            owner = self._chain(node.value, root)
            return _member(owner, node.attr, ast.unparse(node.value))
        if isinstance(node, ast.Call):
            func = self._chain(node.func, root)
            _check_callable(func, ast.unparse(node.func))
            args = [self._argument(a) for a in node.args]
            if any(k.arg is None for k in node.keywords):
                raise _Refused("**kwargs is not allowed")
            kwargs = {k.arg: self._argument(k.value) for k in node.keywords if k.arg is not None}
            return func(*args, **kwargs)
        raise _Refused(f"{ast.unparse(node)!r} is not allowed: use literals, attribute "
                       "chains and calls only")

    def _argument(self, node: ast.expr) -> Any:
        try:
            return ast.literal_eval(node)
        except ValueError:
            return self._chain(node, self._argument_root)

    @staticmethod
    def _argument_root(name: str) -> Any:
        if name not in _ARGUMENT_ROOTS:
            raise _Refused(f"unknown name {name!r}: arguments may only use literals and "
                           f"names under {', '.join(_ARGUMENT_ROOTS)}")
        return _ARGUMENT_ROOTS[name]


def load_file(options: OptionGroup, filepath: str | Path) -> None:
    """Run each non-empty, non-`#` line of `filepath` as `options.<line>`.

    Every line is parsed before any is applied, so a syntax error changes nothing.
    """
    parsed = []
    for lineno, raw in enumerate(Path(filepath).read_text().splitlines(), start=1):
        text = raw.strip()
        if not text or text.startswith("#"):
            continue
        try:
            parsed.append((lineno, text, ast.parse(text, mode="eval").body))
        except SyntaxError as err:  # PopTorch's wording first, then the fix
            raise ConfigFileError(
                f"SyntaxError at line {lineno} of {Path(filepath).name}: {err.msg}\n> {text}\n"
                f"({filepath}, line {lineno}: {text!r} is not a valid option line; write it "
                "as e.g. deviceIterations(4))") from err
    walker = _Walker(options)
    for lineno, text, node in parsed:
        try:
            walker.line(node)
        except (_Refused, TypeError, ValueError) as err:
            raise ConfigFileError(f"{filepath}, line {lineno}: {text!r}: {err}") from err


def apply_setting(options: OptionGroup, dotted: str, args: Sequence[object],
                  source: str) -> None:
    """Call the setter named `dotted` (e.g. "Training.gradientAccumulation") with `args`."""
    target: Any = options
    shown = ""
    for name in dotted.split("."):
        if not isinstance(target, OptionGroup):
            raise ConfigError(f"{source}: {dotted!r} is not an option: {shown!r} is a setter, "
                              "not a group")
        try:
            target = _member(target, name, shown)
        except _Refused as err:
            raise ConfigError(f"{source}: unknown option {dotted!r}: {err}") from err
        shown = f"{shown}.{name}" if shown else name
    if isinstance(target, OptionGroup):
        raise ConfigError(f"{source}: {dotted!r} is a group, not a setter; name one of "
                          f"{', '.join(target._setter_names())}")
    try:
        target(*args)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{source}: {dotted}{tuple(args)!r} was refused: {err}") from err
