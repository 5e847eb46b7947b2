"""The options as PopTorch's core reads them when a model compiles, in its DEBUG words.

PopTorch logs each option its core receives ("poptorch.Options set device_iterations to
value 2", "poptorch.Options added FINAL to dotChecks", "poptorch.Options set
engineOptions[debug.allowOutOfMemory] to true"); scripts and PopTorch's tests read them
back to check which options took effect. `lines` gives them from `Options.toDict()`.
"""
from __future__ import annotations

import logging

__all__: list[str] = []

logger = logging.getLogger("pipetorch.options")

# PopTorch's ExecutionMode numbers (Pipelined, Sharded, Phased)
_EXECUTION_MODES = {"Pipelined": 0, "Sharded": 1, "SerialPhased": 2, "ParallelPhased": 2}
_SYNTHETIC_RANDOM_NORMAL = 2  # PopART's SyntheticDataMode.RandomNormal (enableSyntheticData)


def _text(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def lines(options: dict[str, object]) -> list[str]:
    """PopTorch's lines for the core options and the PopART options (`_Popart.set`)."""
    strategy = str(options.get("execution_strategy", "Pipelined"))
    values: dict[str, object] = {
        "device_iterations": options.get("device_iterations", 1),
        "replication_factor": options.get("replication_factor", 1),
        "execution_mode": next((number for name, number in _EXECUTION_MODES.items()
                                if strategy.startswith(name)), 0),
        "syntheticDataMode": _SYNTHETIC_RANDOM_NORMAL if options.get("enable_synthetic_data")
        else 0,
    }
    if options.get("random_seed") is not None:
        values["random_seed"] = options["random_seed"]
    found = [f"poptorch.Options set {name} to value {_text(value)}"
             for name, value in values.items()]
    popart = options.get("_Popart", {})
    return found + popart_lines(popart.get("options", {}) if isinstance(popart, dict) else {})


def popart_lines(popart: dict[str, object]) -> list[str]:
    """A container option one line per element ("added"), a map one per key ("set k[key]")."""
    found = []
    for name, value in popart.items():
        if isinstance(value, dict):
            found += [f"poptorch.Options set {name}[{key}] to {_text(item)}"
                      for key, item in value.items()]
        elif isinstance(value, (list, tuple, set, frozenset)):
            found += [f"poptorch.Options added {_text(item)} to {name}"
                      for item in (sorted(value, key=str) if isinstance(value, (set, frozenset))
                                   else value)]
        else:
            found.append(f"poptorch.Options set {name} to value {_text(value)}")
    return found


def log(options: dict[str, object]) -> None:
    """Log `lines(options)` at DEBUG."""
    if logger.isEnabledFor(logging.DEBUG):
        for line in lines(options):
            logger.debug(line)
