"""PopTorch's compiled core by name: its error classes, which PopTorch code catches as
`poptorch.poptorch_core.Error`, `_validateOptions` and `isCompilingWithDispatcher` (the
rest of that C++ module has no meaning here)."""
from __future__ import annotations

from pipetorch.errors import ConfigError, Error, RecoverableError, UnrecoverableError
from pipetorch.options import Options, popart_names
from pipetorch.partition import blocks

__all__ = ["Error", "RecoverableError", "UnrecoverableError"]


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


def isCompilingWithDispatcher() -> bool:
    """Whether a model is being captured for compiling now (PopTorch: its dispatcher is
    active), so False again once compile() returned or raised."""
    return blocks.active_recorder() is not None
