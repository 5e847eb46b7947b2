"""Named errors that pipetorch raises for user mistakes and failures on a device."""
from __future__ import annotations

__all__ = ["Error", "ConfigError", "CompileError", "DeviceError", "LoaderError",
           "OutOfMemoryError", "OptionAssertionError", "IpuOnlyError", "RecoverableError",
           "UnrecoverableError", "InputMismatchError", "InputArgumentError", "AlreadyWrappedError", "ConfigFileError", "ModelChangedError", "DeviceMismatchError", "NonFiniteError",
           "OfflineDeviceError", "BackwardError", "ZeroSizedInputError",
           "createPoptorchError"]


class Error(Exception):
    """Base class of every error pipetorch raises on purpose.

    Like PopTorch's `poptorch.Error` it carries `message`, `type` and `location`.
    """

    type = "pipetorch_error"
    location = ""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        self.message = str(args[0]) if args else ""


class RecoverableError(Error, RuntimeError):
    """A run failed but the program can go on after `recovery_action` (PopTorch's name).

    Here the action is always "FULL_RESET": call destroy() on the wrapper and wrap the model
    again; the model keeps the weights of the last completed call.
    """

    type = "recoverable_runtime_error"
    recovery_action = "FULL_RESET"


class UnrecoverableError(Error, RuntimeError):
    """A failure after which the process must be restarted (PopTorch's name)."""

    type = "unrecoverable_runtime_error"


class ConfigError(Error, ValueError):
    """Options, strategies or blocks that cannot work together."""


class ConfigFileError(ConfigError):
    """A line of an options file (Options.loadFromFile) that cannot be applied (PopTorch's
    `poptorch.ConfigFileError`)."""


class AlreadyWrappedError(ConfigError, RuntimeError):
    """A model wrapped by a live trainingModel wrapped for training again (PopTorch raises a
    RuntimeError)."""


class OptionAssertionError(ConfigError, AssertionError):
    """An option value PopTorch refuses with an assertion (caught as AssertionError there)."""


class CompileError(Error, RuntimeError):
    """The model could not be prepared for the device (capture, partitioning, loss)."""


class DeviceError(RecoverableError):
    """A device (worker) failed or stopped answering while running the model."""


class InputMismatchError(Error, ValueError):
    """A call whose inputs differ from those the wrapper was compiled for (PopTorch raises a
    `poptorch.Error` starting "Shape mismatch for x", "Data type mismatch for x", ...)."""

    type = "poptorch_py_error"


class InputArgumentError(Error, TypeError):
    """A call forward cannot take: PopTorch raises a `poptorch.Error` ("Mandatory parameter
    b missing"), Python a TypeError, so it is both."""

    type = "poptorch_py_error"


class BackwardError(Error, RuntimeError):
    """backward() called on a trainingModel's output (PopTorch 3.x raises a poptorch.Error)."""


class ZeroSizedInputError(Error, ValueError):
    """A tensor input of no elements (PopTorch: "Zero-sized tensors are unsupported")."""


class ModelChangedError(Error, RuntimeError):
    """The wrapped model's buffers were added, removed or replaced after compilation."""


class DeviceMismatchError(Error, RuntimeError):
    """The model mixed a tensor on one device with the device it runs on."""


class NonFiniteError(Error, FloatingPointError):
    """NaN or Inf in a call's inputs, loss or outputs, found by Options.checkNonFinite()."""


class LoaderError(Error, RuntimeError):
    """A data loader process failed or stopped answering."""


class OutOfMemoryError(ConfigError):
    """A configuration whose estimated memory exceeds a device's budget (raised at compile;
    planning.estimate's OverBudgetError and partition.balance's NoPlacementFits say more)."""


def createPoptorchError(msg: str) -> Error:
    """The `poptorch.Error` PopTorch raises for a failure on the Python side."""
    error = Error(f"'poptorch_py_error': {msg}")
    error.type = "poptorch_py_error"
    error.message = msg
    error.location = ""
    return error


class OfflineDeviceError(Error, AssertionError):
    """A model wrapped with ConnectionType.Never (useOfflineIpuTarget) asked to run: it may
    compile, never run (PopTorch raises an AssertionError)."""


class IpuOnlyError(Error, NotImplementedError):
    """A feature that needs an IPU (Poplar codelets, IPU cycle counters) asked for on CPU/GPU."""
