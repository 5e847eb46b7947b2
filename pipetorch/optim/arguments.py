"""Checks of the optimisers' arguments: numbers in range and flags, with the fix named."""
from __future__ import annotations

import math
import numbers
from typing import TypeVar

import torch

__all__: list[str] = []

_T = TypeVar("_T")


def _real(value: object) -> float | None:
    """`value` as a float if it is a real number (or a one-element tensor), else None."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        return float(value)
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return None


def check_number(name: str, value: _T, *, minimum: float = 0.0, strict: bool = False,
                 maximum: float | None = None, allow_inf: bool = False) -> _T:
    """Return `value` unchanged if it is a real number in range, else raise naming the fix."""
    low = f"> {minimum:g}" if strict else f">= {minimum:g}"
    wanted = low if maximum is None else f"{low} and < {maximum:g}"
    number = _real(value)
    if number is None:
        raise TypeError(f"{name} must be a real number {wanted}, got {value!r} "
                        f"({type(value).__name__}); pass a float such as 0.5")
    bad = (math.isnan(number) or (math.isinf(number) and not allow_inf)
           or number < minimum or (strict and number == minimum)
           or (maximum is not None and number >= maximum))
    if bad:
        finite = "" if allow_inf else " (finite)"
        raise ValueError(f"{name} must be a real number {wanted}{finite}, got {value!r}; "
                         f"pass a value {wanted}")
    return value


def check_flag(name: str, value: object) -> bool:
    """Return `value` if it is a bool, else raise TypeError naming the fix."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
    return value
