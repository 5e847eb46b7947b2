"""poptorch.Options: every setting of a wrapped model, set by chained, validated setters."""
from __future__ import annotations

import copy
import os
from typing import Any

from pipetorch.errors import ConfigError
from pipetorch.options import config, environment
from pipetorch.options.distributed import _DistributedOptions
from pipetorch.options.groups import (
    _JitOptions, _PopartOptions, _PrecisionOptions, _TrainingOptions,
)
from pipetorch.options.ipu_setters import IpuSetters
from pipetorch.options.locations import _TensorLocationOptions
from pipetorch.options.report_setters import ReportSetters
from pipetorch.options.run_setters import RunSetters

__all__ = ["Options"]


class Options(RunSetters, ReportSetters, IpuSetters):
    """All options controlling how a model is prepared and run.

    >>> opts = poptorch.Options().deviceIterations(10).replicationFactor(2).randomSeed(0)
    >>> opts.Training.gradientAccumulation(4)
    >>> opts.device_iterations, opts.Training.gradient_accumulation
    (10, 4)

    Every setter validates its value and returns the object it was called on. Values read
    back as snake_case attributes. Wrapping a model or building a DataLoader freezes the
    options; `clone()` gives an editable copy. At construction the environment variables
    POPTORCH_CACHE_DIR, POPLAR_ENGINE_OPTIONS and POPTORCH_DEFAULT_OPTIONS are applied.
    """

    _LABEL = "Options"
    _DEFAULTS = {**RunSetters._OWN_DEFAULTS, **ReportSetters._OWN_DEFAULTS,
                 **IpuSetters._OWN_DEFAULTS}
    _SUBGROUPS = ("Training", "Distributed", "TensorLocations", "Precision", "Jit", "_Popart")

    def __init__(self) -> None:
        super().__init__()
        self._training = _TrainingOptions()
        self._distributed = _DistributedOptions()
        self._tensor_locations = _TensorLocationOptions()
        self._precision = _PrecisionOptions()
        self._jit = _JitOptions()
        self._popart = _PopartOptions(training=self._training)
        self._env_profiling_dir = environment.profiling_dir()
        cache_dir = environment.cache_dir()
        if cache_dir:
            self.enableExecutableCaching(cache_dir)
        for dotted, args in environment.default_options():
            config.apply_setting(self, dotted, args, environment.DEFAULT_OPTIONS_VAR)

    @property
    def Training(self) -> _TrainingOptions:
        """Options of training: gradient accumulation, reductions, loss scaling."""
        return self._training

    @property
    def Distributed(self) -> _DistributedOptions:
        """Options of multi-process runs: this process's id and the process count."""
        return self._distributed

    @property
    def TensorLocations(self) -> _TensorLocationOptions:
        """Where activations, weights, optimiser state and accumulators live."""
        return self._tensor_locations

    @property
    def Precision(self) -> _PrecisionOptions:
        """Options of numerical precision (partials type, stochastic rounding, ...)."""
        return self._precision

    @property
    def Jit(self) -> _JitOptions:
        """Options of model capture."""
        return self._jit

    @property
    def _Popart(self) -> _PopartOptions:
        """Raw PopART options, any key (advanced; no-op here)."""
        return self._popart

    def loadFromFile(self, filepath: str | os.PathLike) -> Options:
        """Apply each non-empty, non-`#` line of `filepath` as `options.<line>`.

        For example a line `deviceIterations(4)` or `Training.gradientAccumulation(2)`.
        Lines are parsed, not executed as Python: only setter calls with literal arguments,
        `poptorch.<enum>.<member>`, `torch.<dtype>` and TensorLocationSettings / strategy
        objects are accepted. A bad line raises ConfigError naming the file and line.
        """
        self._check_not_frozen()
        config.load_file(self, os.fspath(filepath))
        return self

    def set(self, **values: object) -> Options:
        """Set options by their read-back names, as PopTorch's raw setter does:
        `opts.set(random_seed=42)`. Prefer the named setters, which check the values; this
        refuses, in PopTorch's words, a name Options does not have and a value of another
        type than the option's current one."""
        self._check_not_frozen()
        for name, value in values.items():
            if name not in self._values:
                raise ConfigError(f"Unknown option {name}: Options has no such option; its "
                                  f"options are {', '.join(sorted(self._values))}")
            current = self._values[name]
            if current is not None and type(value) is not type(current) and not (
                    isinstance(current, float) and type(value) is int):
                raise ConfigError(
                    f"Unknown value type {type(value).__name__} for option {name}: it holds "
                    f"a {type(current).__name__} ({current!r})")
        self._set(**values)
        return self

    def clone(self) -> Options:
        """An unfrozen deep copy of these options."""
        return copy.deepcopy(self)

    def _freeze(self, *, by: str = "") -> None:
        self.input_group_count  # noqa: B018  # raises if replicas and input groups disagree
        super()._freeze(by=by)

    def _export(self) -> dict[str, Any]:
        out = dict(self._values)
        out.update(execution_strategy=self.execution_strategy, profiling_dir=self.profiling_dir)
        return out
