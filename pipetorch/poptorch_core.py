"""PopTorch's compiled core by name: its error classes, which PopTorch code catches as
`poptorch.poptorch_core.Error` (the rest of that C++ module has no meaning here)."""
from __future__ import annotations

from pipetorch.errors import Error, RecoverableError, UnrecoverableError

__all__ = ["Error", "RecoverableError", "UnrecoverableError"]
