"""A wrapper's copies between the user's model and optimiser and the device's: the lazy copy
to the host, uploads, named buffers, setOptimizer and the optimiser's state when it is read."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch
import torch.nn as nn

from pipetorch.enums import ConnectionType
from pipetorch.errors import ConfigError
from pipetorch.optim import Optimizer, attributes, ipu_param, ipu_state
from pipetorch.runtime.checks import (
    check_mean_strategy_kept, check_optimizer_params, resolve_mean_strategy,
)
from pipetorch.runtime.compile import Compiled
from pipetorch.runtime.optimizer import (
    copy_hyperparameters, copy_scaling_to_host, copy_state_to_device, copy_state_to_host,
)
from pipetorch.weights import host_copy

if TYPE_CHECKING:
    from pipetorch.options import Options

__all__: list[str] = []

logger = logging.getLogger("pipetorch.runtime.executor")


class WeightCopies:
    """PoplarExecutor's weight and optimiser copies (the wrapper's attributes, below)."""

    _compiled: Compiled | None
    _sync: host_copy.HostSync | None
    _user_model: nn.Module
    _user_optimizer: torch.optim.Optimizer | None
    _options: Options
    _training: bool
    _state_stale: bool  # the device's optimiser state is newer than the user's
    _uploaded_generation: int
    _optimizer_record: attributes.Compiled | None

    def _fetch(self) -> None:
        # PopTorch's lazy copy calls the wrapper's copyWeightsToHost, which scripts and tests
        # replace to count copies (`deviceToHostCounter`).
        logger.debug("Implicit copyWeightsToHost()")
        self.copyWeightsToHost()

    def _pull(self) -> None:
        """The device's weights into the user's model (PopTorch's implicit copy to the host:
        weights only; the optimiser's state comes when the optimiser is read)."""
        assert self._compiled is not None
        engine = self._compiled.engine
        engine.pull()
        if engine.model is not self._user_model:
            host_copy.copy_state(engine.model, self._user_model)
        if engine.optimizer is not None and self._user_optimizer is not None:
            copy_scaling_to_host(engine.optimizer, self._user_optimizer)

    def _pull_optimizer_state(self) -> None:
        """The device's optimiser state into the user's optimiser, stage by stage, when the
        user reads it (state_dict(), ipu_state) after training calls."""
        compiled = self._compiled
        if compiled is None or compiled.engine.optimizer is None or self._user_optimizer is None:
            return
        if not self._state_stale:
            if isinstance(self._user_optimizer, Optimizer):  # PopTorch caches its own only
                logger.debug("Using cached optimiser state dict")
            return
        self._state_stale = False  # first: loading the state reads the optimiser again
        logger.debug("Writing optimiser state tensors from IPU to host.")
        compiled.engine.pull(optimizer_state=True)
        copy_state_to_host(compiled.engine.optimizer, self._user_optimizer)

    def _refresh_from_host(self) -> None:
        """Inference wrappers follow weights trained by another wrapper of the same model."""
        assert self._sync is not None and self._compiled is not None
        self._sync.flush()
        if self._sync.generation != self._uploaded_generation:
            host_copy.copy_state(self._user_model, self._compiled.engine.model)
            self._compiled.engine.push()
            self._uploaded_generation = self._sync.generation

    def copyWeightsToHost(self) -> None:
        """Copy the device's weights (and optimiser state) into the user's model now."""
        if self._compiled is not None and self._sync is not None:
            self._sync.run(self._pull)

    def copyWeightsToDevice(self) -> None:
        """Copy the user's model's weights to the device (host edits reach it only this way).

        The host copy is brought to the latest call first when a call trained since it was
        last: the upload holds every tensor from one point of training (docs/precision.md)."""
        if self._compiled is not None and self._sync is not None:
            self._sync.flush()
            host_copy.copy_state(self._user_model, self._compiled.engine.model)
            self._compiled.engine.push()
            self._uploaded_generation = self._sync.generation

    def copyNamedBuffersToDevice(self) -> None:
        """Copy the buffers named by Options.updatableNamedBuffers from the user's model to
        the device (other weights and buffers on the device are kept)."""
        compiled = self._compiled
        if compiled is None:
            raise RuntimeError("Model has not been compiled or has been destroyed. Call the "
                               "model (or compile()) before copyNamedBuffersToDevice()")
        names = self._options.updatable_named_buffers
        if not names:
            raise ConfigError("copyNamedBuffersToDevice: no buffers were named; list them with "
                              "Options.updatableNamedBuffers([...]) before wrapping the model")
        host = dict(self._user_model.named_buffers())
        device = dict(compiled.engine.model.named_buffers())
        missing = [n for n in names if n not in host or n not in device]
        if missing:
            raise ConfigError(f"copyNamedBuffersToDevice: {missing} are not buffers of the "
                              f"model; its buffers are {sorted(host)}")
        with torch.no_grad():
            wanted = {name: host[name].detach().clone() for name in names}
            # the host copy (which may be the user's model itself) must hold the device's
            # latest values first, then the named buffers the user set
            compiled.engine.pull()
            for name in names:
                device[name].copy_(wanted[name])
        compiled.engine.push()

    def setOptimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Send new hyper-parameters (learning rate, ...) to the device; its state is kept.

        The new optimiser may be another object of the same class; attributes that
        `variable_attrs` marks constant must keep their compiled values."""
        if not self._training:
            raise ConfigError("setOptimizer is for trainingModel wrappers; this is an inferenceModel")
        check_optimizer_params(optimizer, self._user_model, where="setOptimizer")
        if self._compiled is None:
            resolve_mean_strategy(optimizer, self._options)  # compiled later: may still change
        if self._compiled is not None and self._compiled.engine.optimizer is not None:
            assert self._optimizer_record is not None
            check_mean_strategy_kept(optimizer, self._options)
            attributes.check_replacement(self._optimizer_record, optimizer)
            copy_hyperparameters(optimizer, self._compiled.engine.optimizer)
            self._compiled.engine.set_hyperparameters()
            if optimizer is not self._user_optimizer:
                assert self._sync is not None and self._user_optimizer is not None
                self._flush_host()  # the old optimiser's state is the device's until now
                ipu_state.unlink(self._user_optimizer)
                # The new one reads the device's state, and a checkpoint's state it holds
                # (load_state_dict before this call) is pushed from it.
                self._user_optimizer = optimizer
                self._sync.mark_stale(self._fetch)
                self._link_optimizer(optimizer)
        self._user_optimizer = optimizer

    def _offline(self) -> bool:
        """ConnectionType.Never: the model compiles but never runs."""
        return self._options.connection_type == ConnectionType.Never

    def _link_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """`optimizer.state_dict()["ipu_state"]` and write_ipu_state reach this model (not
        an offline one: it has no device state, so they stay None, as in PopTorch)."""
        self._optimizer_record = attributes.record(
            optimizer, automatic_loss_scaling=self._options.Training.auto_loss_scaling,
            relaxed=self._options.relax_optimizer_attributes_checks)
        if self._offline():
            return
        ipu_param.link(optimizer, self._user_model, sync=self._flush_host,
                       push=self._push_optimizer_state)

    def _flush_host(self) -> None:
        """Before the user's optimiser is read or written: the device's weights and state."""
        if self._sync is not None:
            self._sync.flush()
        self._pull_optimizer_state()

    def _push_optimizer_state(self) -> None:
        """The user's optimiser state (written by write_ipu_state) becomes the device's."""
        if self._compiled is not None and self._compiled.engine.optimizer is not None:
            assert self._user_optimizer is not None
            logger.debug("Writing optimiser state tensors from host to IPU memory")
            copy_state_to_device(self._user_optimizer, self._compiled.engine)

    def state_dict(self, *args: object, **kwargs: object) -> dict[str, Any]:
        """The user model's state_dict, holding the device's latest weights."""
        state_dict: Callable[..., dict[str, Any]] = self._user_model.state_dict  # overloaded
        return state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, object], strict: bool = True) -> Any:
        """Load weights into the user model and the device."""
        result = self._user_model.load_state_dict(state_dict, strict=strict)
        self.copyWeightsToDevice()
        return result
