"""Options setters of what a run reports: profiling reports, logs, the progress bar."""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from pipetorch.options import _validate as check
from pipetorch.options._group import OptionGroup, readback
from pipetorch.options.environment import DEFAULT_REPORT_DIR, ENGINE_OPTIONS_VAR

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["ReportSetters"]

logger = logging.getLogger(__name__)


class ReportSetters(OptionGroup):
    """The part of `Options` that decides where reports and logs go and what is printed."""

    _OWN_DEFAULTS: dict[str, Any] = {
        "profiling_dir": None,
        "log_dir": None,
        "model_name": None,
        "show_compilation_progress_bar": True,
        "relax_optimizer_attributes_checks": False,
        "max_repeat_logs": 4,
    }
    _env_profiling_dir: str | None = None

    log_dir = readback("log_dir", "Directory for log files, or None (working directory).")
    model_name = readback("model_name", "Name used for report subdirectories, or None.")
    show_compilation_progress_bar = readback(
        "show_compilation_progress_bar", "Show a progress bar while preparing the model.")
    relax_optimizer_attributes_checks = readback(
        "relax_optimizer_attributes_checks",
        "Log unexpected optimiser attributes at debug level instead of warning.")
    max_repeat_logs = readback(
        "max_repeat_logs", "How often one repeated log message is printed before it is muted.")

    @property
    def profiling_dir(self) -> str | None:
        """Report directory, or None: POPLAR_ENGINE_OPTIONS wins over enableProfiling."""
        return self._env_profiling_dir or self._values["profiling_dir"]

    def enableProfiling(self, profile_dir: str | os.PathLike | None = None) -> Self:
        """Write profiling reports to `profile_dir` (default "./").

        A directory requested by POPLAR_ENGINE_OPTIONS takes precedence, as in PopTorch. The
        directory must be writable or creatable (checked here: the reports are written at the
        end of the run, too late to tell).
        """
        directory = check.output_directory("enableProfiling", "profile_dir",
                                           DEFAULT_REPORT_DIR if profile_dir is None
                                           else profile_dir,
                                           holds="the profiling reports")
        if self._env_profiling_dir:
            logger.warning("Profiling directory set by %s (%s) overrides enableProfiling(%r)",
                           ENGINE_OPTIONS_VAR, self._env_profiling_dir, directory)
        self._set(profiling_dir=directory)
        return self

    def logDir(self, log_dir: str | os.PathLike) -> Self:
        """Directory for log files (default: the working directory)."""
        self._set(log_dir=check.path("logDir", "log_dir", log_dir))
        return self

    def modelName(self, name: str) -> Self:
        """Name of the model, used as the report subdirectory (default: training/inference)."""
        self._set(model_name=check.text("modelName", "name", name))
        return self

    def showCompilationProgressBar(self, show: bool = True) -> Self:
        """Show (default) or hide the progress bar while the model is prepared."""
        self._set(show_compilation_progress_bar=check.boolean(
            "showCompilationProgressBar", "show", show))
        return self

    def relaxOptimizerAttributesChecks(self, relax: bool = True) -> Self:
        """Log unexpected attributes in setOptimizer() at debug level instead of warning."""
        self._set(relax_optimizer_attributes_checks=check.boolean(
            "relaxOptimizerAttributesChecks", "relax", relax))
        return self

    def maxRepeatLogs(self, number_repeated: int | None) -> Self:
        """Print one repeated pipetorch log message at most `number_repeated` times, then
        once more saying that further repeats are muted (applied when a model is wrapped);
        None, as in PopTorch: print every repeat."""
        self._set(max_repeat_logs=None if number_repeated is None else check.integer(
            "maxRepeatLogs", "number_repeated", number_repeated, minimum=0))
        return self
