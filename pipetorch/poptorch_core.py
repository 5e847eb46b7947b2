"""PopTorch's compiled core by name: its error classes, which PopTorch code catches as
`poptorch.poptorch_core.Error`, `_validateOptions`, `isCompilingWithDispatcher` and the
error-handling test hook `_throwTestError` (the rest of that C++ module has no meaning here)."""
from __future__ import annotations

import enum

from pipetorch.errors import ConfigError, Error, RecoverableError, UnrecoverableError
from pipetorch.options import Options, popart_names, session_log
from pipetorch.partition import blocks

__all__ = ["Error", "RecoverableError", "UnrecoverableError", "TestErrorType"]


def _validateOptions(options: dict[str, object]) -> None:
    """Check `Options.toDict()` as PopTorch's core does when a model compiles: an option name
    Options does not have, or a PopART option (`_Popart.set`) PopART does not have or of a
    value type PopTorch cannot pass, raises a ConfigError in PopTorch's words."""
    if not isinstance(options, dict):
        raise TypeError(f"_validateOptions takes Options.toDict(), got {type(options).__name__}")
    known = Options().toDict()
    for name in options:
        if name not in known:
            raise ConfigError(f"Unknown option {name}: Options.toDict() has no such key "
                              f"(it has {', '.join(sorted(known))})")
    popart = options.get("_Popart", {})
    popart_names.check(popart.get("options", {}) if isinstance(popart, dict) else {})
    session_log.log(options)  # what PopTorch's core logs as it reads them


def isCompilingWithDispatcher() -> bool:
    """Whether a model is being captured for compiling now (PopTorch: its dispatcher is
    active), so False again once compile() returned or raised."""
    return blocks.active_recorder() is not None


class TestErrorType(enum.Enum):
    """The failures `_throwTestError` raises, one per component PopTorch reports errors of."""

    __test__ = False  # not a pytest test class, whatever its name
    Poptorch = 0
    Popart = 1
    PopartInternal = 2
    Poplibs = 3
    PoplarUnrecoverable = 4
    PoplarUnknown = 5
    PoplarRecoverableFullReset = 6
    PoplarLinkError = 7


# TestErrorType -> (error class, PopTorch's `type`, message); PopTorch's link error appends the
# linker's output to the message.
_TEST_ERRORS: dict[TestErrorType, tuple[type[Error], str, str]] = {
    TestErrorType.Poptorch: (Error, "poptorch_cpp_error", "This is a PopTorch error"),
    TestErrorType.Popart: (Error, "popart_exception", "This is a Popart error"),
    TestErrorType.PopartInternal: (Error, "popart_internal_exception", "This is a Popart error"),
    TestErrorType.Poplibs: (Error, "poplibs_exception", "This is a Poplibs error"),
    TestErrorType.PoplarUnrecoverable: (UnrecoverableError, "poplar_unrecoverable_runtime_error",
                                        "This is not recoverable"),
    TestErrorType.PoplarUnknown: (UnrecoverableError, "poplar_unknown_runtime_error",
                                  "Don't know what happened"),
    TestErrorType.PoplarRecoverableFullReset: (RecoverableError,
                                               "poplar_recoverable_runtime_error", "Reboot needed"),
    TestErrorType.PoplarLinkError: (Error, "poplar_link_error",
                                    "Link error: Library -lfoo not found\ncheck path"),
}


def _throwTestError(error_type: TestErrorType) -> None:
    """Raise the error a failure of `error_type` surfaces as, as PopTorch's core does for its
    error-handling tests: `message` without context, `location` the two nested contexts
    ("throwTestError::topLevel", "throwTestError::bottomLevel"), `str()` both."""
    if not isinstance(error_type, TestErrorType):
        raise TypeError(f"_throwTestError takes a poptorch_core.TestErrorType, got {error_type!r}")
    cls, kind, message = _TEST_ERRORS[error_type]
    location = "  [0] throwTestError::topLevel\n  [1] throwTestError::bottomLevel"
    error = cls(f"'{kind}': {message}\nError raised in:\n{location}")
    error.message, error.location, error.type = message, location, kind
    raise error
