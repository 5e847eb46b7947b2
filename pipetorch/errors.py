"""Named errors that pipetorch raises for user mistakes and failures on a device."""
from __future__ import annotations

__all__ = ["Error", "ConfigError", "CompileError", "DeviceError", "LoaderError",
           "OutOfMemoryError", "OptionAssertionError", "IpuOnlyError", "createPoptorchError"]


class Error(Exception):
    """Base class of every error pipetorch raises on purpose."""


class ConfigError(Error, ValueError):
    """Options, strategies or blocks that cannot work together."""


class OptionAssertionError(ConfigError, AssertionError):
    """An option value PopTorch refuses with an assertion (caught as AssertionError there)."""


class CompileError(Error, RuntimeError):
    """The model could not be prepared for the device (capture, partitioning, loss)."""


class DeviceError(Error, RuntimeError):
    """A device (worker) failed or stopped answering while running the model."""


class LoaderError(Error, RuntimeError):
    """A data loader process failed or stopped answering."""


class OutOfMemoryError(ConfigError):
    """A configuration whose estimated memory exceeds a device's budget (raised at compile)."""


def createPoptorchError(msg: str) -> Error:
    """The `poptorch.Error` PopTorch raises for a failure on the Python side (not raised here)."""
    error = Error(f"'poptorch_py_error': {msg}")
    error.type = "poptorch_py_error"  # type: ignore[attr-defined]
    error.message = msg  # type: ignore[attr-defined]
    error.location = ""  # type: ignore[attr-defined]
    return error


class IpuOnlyError(Error, NotImplementedError):
    """A feature that needs an IPU (Poplar codelets, IPU cycle counters) asked for on CPU/GPU."""
