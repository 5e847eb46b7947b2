"""PopTorch's Options object and TensorLocationSettings."""
from __future__ import annotations

from pipetorch.errors import ConfigFileError  # noqa: F401  (poptorch.options.ConfigFileError)
from pipetorch.options.locations import TensorLocationSettings
from pipetorch.options.distributed import _DistributedOptions  # noqa: F401  (PopTorch's names)
from pipetorch.options.groups import (  # noqa: F401
    _JitOptions, _PopartOptions, _PrecisionOptions, _TrainingOptions,
)
from pipetorch.options.locations import _TensorLocationOptions  # noqa: F401
from pipetorch.options.options import Options

__all__ = ["Options", "TensorLocationSettings"]
