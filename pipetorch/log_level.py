"""`poptorch.setLogLevel` and `poptorch.logger`: the volume of pipetorch's own messages."""
from __future__ import annotations

import logging
import os

__all__ = ["logger", "setLogLevel", "LOG_LEVELS"]

# The parent of every pipetorch.* module logger, so one level governs the whole library.
logger = logging.getLogger("pipetorch")

# PopTorch's level names, their legacy integers and the Python level each one means.
LOG_LEVELS: dict[str, tuple[int, int]] = {
    "TRACE": (0, logging.DEBUG),
    "DEBUG": (1, logging.DEBUG),
    "INFO": (2, logging.INFO),
    "WARN": (3, logging.WARNING),
    "ERR": (4, logging.ERROR),
    "OFF": (6, logging.CRITICAL + 1),
}


def setLogLevel(level: str | int) -> None:
    """Print messages of `level` and above: TRACE, DEBUG, INFO, WARN, ERR or OFF.

    A legacy integer (0 = TRACE ... 4 = ERR, 6 = OFF) is accepted as PopTorch accepts it.
    """
    if isinstance(level, int) and not isinstance(level, bool):
        names = [name for name, (number, _) in LOG_LEVELS.items() if number == level]
        if not names:
            raise ValueError(f"Invalid log level integer {level}: use one of "
                             f"{sorted({n for n, _ in LOG_LEVELS.values()})} or a level name")
        level = names[0]
    if level not in LOG_LEVELS:
        valid = sorted(LOG_LEVELS)
        raise ValueError(f"Unknown log level: {level}. Valid values are "
                         f"{', '.join(valid[:-1])} and {valid[-1]}")
    logger.setLevel(LOG_LEVELS[level][1])


def _from_environment() -> None:
    level = os.environ.get("POPTORCH_LOG_LEVEL")
    if level:
        setLogLevel(level)


_from_environment()
