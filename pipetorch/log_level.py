"""`poptorch.setLogLevel` and `poptorch.logger`: the volume of pipetorch's own messages."""
from __future__ import annotations

import logging
import os
import sys
from typing import TextIO

__all__ = ["logger", "setLogLevel", "LOG_LEVELS", "limit_repeats"]

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
    if not logger.handlers and not _prints_to_console(logging.getLogger()):
        # Like PopTorch's console logger: without one, Python prints only warnings and up.
        # A handler that only collects records (pytest's, say) does not print them.
        console = _Console()
        console.setFormatter(_Format("[%(asctime)s] [%(name)s] [%(levelname)s] %(message)s",
                                     "%H:%M:%S"))
        logger.addHandler(console)


class _Format(logging.Formatter):
    """PopTorch's console lines name the level in lower case: "[debug]", "[warning]"."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return self._style.format(logging.makeLogRecord(
            {**record.__dict__, "levelname": record.levelname.lower()}))


class _Console(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a message comes (it may be replaced later)."""

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:
        pass


def _prints_to_console(root: logging.Logger) -> bool:
    """Whether the user's logging set-up already prints to stdout or stderr."""
    return any(isinstance(h, _Console) or (isinstance(h, logging.StreamHandler)
               and getattr(h, "stream", None) in (sys.stderr, sys.stdout, sys.__stderr__,
                                                  sys.__stdout__))
               for h in root.handlers)


class RepeatFilter(logging.Filter):
    """Lets one message (logger, level, text) repeated back to back through `limit` times,
    then mutes it until another message comes (None: no limit). A message that comes again
    after others (the same event later in a run) is printed again."""

    def __init__(self, limit: int | None) -> None:
        super().__init__()
        self.limit = limit
        self._last: tuple[str, int, str] | None = None
        self._count = 0

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno, record.getMessage())
        self._count = self._count + 1 if key == self._last else 1
        self._last = key
        if self.limit is None:
            return True
        if self._count == self.limit + 1:
            note = f"repeated {self.limit} times; further repeats are muted"
            record.msg, record.args = f"{key[2]} ({note})", None
        return self._count <= self.limit + 1


_repeat_filter = RepeatFilter(4)


def limit_repeats(limit: int | None) -> None:
    """Options.maxRepeatLogs: at most `limit` copies of one message from any pipetorch logger
    (None: no limit)."""
    _repeat_filter.limit = limit
    names = [n for n in logging.root.manager.loggerDict if n.startswith("pipetorch.")]
    for lg in [logger, *(logging.getLogger(n) for n in names)]:
        if _repeat_filter not in lg.filters:
            lg.addFilter(_repeat_filter)


def _from_environment() -> None:
    level = os.environ.get("POPTORCH_LOG_LEVEL")
    if level:
        setLogLevel(level)


_from_environment()
