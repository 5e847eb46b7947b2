"""A wrapper's copies between the user's model and optimiser and the device's: the lazy copy
to the host, uploads, named buffers, setOptimizer and the optimiser's state when it is read."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn as nn

from pipetorch.enums import ConnectionType
from pipetorch.errors import ConfigError
from pipetorch.optim import Optimizer, attributes, ipu_param, ipu_state, scaling
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


def offline(options: Options) -> bool:
    """ConnectionType.Never: the model compiles but never runs."""
    return options.connection_type == ConnectionType.Never


class WeightCopies:
    """A wrapper's copies between the user's model and optimiser and its compiled model's:
    the host copy (HostSync), the optimiser (replaced by setOptimizer) and its state."""

    def __init__(self, user_model: nn.Module, options: Options, *, training: bool,
                 optimizer: torch.optim.Optimizer | None) -> None:
        self._user_model, self._options, self._training = user_model, options, training
        self.optimizer = optimizer  # the user's; a trainingModel's steps on the device
        self._compiled: Compiled | None = None  # the device's copy, from compile to destroy
        self.sync: host_copy.HostSync | None = None
        self._state_stale = False  # the device's optimiser state is newer than the user's
        self._uploaded_generation = -1
        self._optimizer_record: attributes.Compiled | None = None

    def compiled(self, compiled: Compiled) -> None:
        """The model is compiled: `compiled` holds the device's weights and optimiser."""
        self._compiled = compiled
        # PopTorch copies a poptorch.optim optimiser's state to the host at the first read
        # after compiling (a torch optimiser's only once trained)
        self._state_stale = isinstance(self.optimizer, Optimizer)

    def attach(self, shown_model: nn.Module) -> None:
        """The host copy: the user's model (and `shown_model`) read the device's weights."""
        assert self._compiled is not None
        self.sync = host_copy.attach(self._user_model, shown_model)
        engine = self._compiled.engine
        if engine.optimizer is not None and self.optimizer is not None:
            # From compile on, the user's optimiser reports the device's loss scale (ipu_state's
            # lossScaleUpdateFactor), as PopTorch's does before the first call.
            scaling.load_scaling_state(self.optimizer, scaling.scaling_state(engine.optimizer))
        self._uploaded_generation = self.sync.generation

    def detach(self) -> None:
        """The model is destroyed: no device copy to read or write."""
        if self.sync is not None:
            host_copy.detach(self.sync)
        self._compiled, self.sync = None, None

    def trained(self, fetch: Callable[[], None]) -> None:
        """A call trained on the device: `fetch` copies its weights when the host reads them."""
        optimizer = self.optimizer
        assert optimizer is not None and self.sync is not None  # a trainingModel's
        # the device stepped: an LR scheduler must not warn that optimizer.step() never ran
        optimizer._opt_called = True  # type: ignore[attr-defined]  # torch's flag, undeclared
        self.sync.mark_stale(fetch)
        self._state_stale = True
        ipu_state.forget_loaded(optimizer)

    def _pull(self) -> None:
        """The device's weights into the user's model (PopTorch's implicit copy to the host:
        weights only; the optimiser's state comes when the optimiser is read)."""
        assert self._compiled is not None
        engine = self._compiled.engine
        engine.pull()
        if engine.model is not self._user_model:
            host_copy.copy_state(engine.model, self._user_model)
        if engine.optimizer is not None and self.optimizer is not None:
            copy_scaling_to_host(engine.optimizer, self.optimizer)

    def _pull_optimizer_state(self) -> None:
        """The device's optimiser state into the user's optimiser, stage by stage, when the
        user reads it (state_dict(), ipu_state) after training calls."""
        compiled = self._compiled
        if compiled is None or compiled.engine.optimizer is None or self.optimizer is None:
            return
        if not self._state_stale:
            if isinstance(self.optimizer, Optimizer):  # PopTorch caches its own only
                logger.debug("Using cached optimiser state dict")
            return
        self._state_stale = False  # first: loading the state reads the optimiser again
        logger.debug("Writing optimiser state tensors from IPU to host.")
        compiled.engine.pull(optimizer_state=True)
        copy_state_to_host(compiled.engine.optimizer, self.optimizer)

    def refresh_from_host(self) -> None:
        """Inference wrappers follow weights trained by another wrapper of the same model."""
        assert self.sync is not None and self._compiled is not None
        self.sync.flush()
        if self.sync.generation != self._uploaded_generation:
            host_copy.copy_state(self._user_model, self._compiled.engine.model)
            self._compiled.engine.push()
            self._uploaded_generation = self.sync.generation

    def to_host(self) -> None:
        """copyWeightsToHost: the device's weights (and optimiser state) into the user's model."""
        if self._compiled is not None and self.sync is not None:
            self.sync.run(self._pull)

    def to_device(self) -> None:
        """copyWeightsToDevice: the user's model's weights to the device, the host copy
        brought to the latest call first."""
        if self._compiled is not None and self.sync is not None:
            self.sync.flush()
            host_copy.copy_state(self._user_model, self._compiled.engine.model)
            self._compiled.engine.push()
            self._uploaded_generation = self.sync.generation

    def named_buffers_to_device(self) -> None:
        """copyNamedBuffersToDevice: the buffers named by Options.updatableNamedBuffers."""
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

    def set_optimizer(self, optimizer: torch.optim.Optimizer, fetch: Callable[[], None]) -> None:
        """setOptimizer: new hyper-parameters to the device, its state kept; `fetch` copies
        the device's weights when the host reads them."""
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
            if optimizer is not self.optimizer:
                assert self.sync is not None and self.optimizer is not None
                self.flush_host()  # the old optimiser's state is the device's until now
                ipu_state.unlink(self.optimizer)
                # The new one reads the device's state, and a checkpoint's state it holds
                # (load_state_dict before this call) is pushed from it.
                self.optimizer = optimizer
                self.sync.mark_stale(fetch)
                self.link_optimizer()
        self.optimizer = optimizer

    def link_optimizer(self) -> None:
        """`optimizer.state_dict()["ipu_state"]` and write_ipu_state reach this model (not
        an offline one: it has no device state, so they stay None, as in PopTorch)."""
        if self.optimizer is None:  # an inferenceModel's
            return
        self._optimizer_record = attributes.record(
            self.optimizer, automatic_loss_scaling=self._options.Training.auto_loss_scaling,
            relaxed=self._options.relax_optimizer_attributes_checks)
        if offline(self._options):
            return
        ipu_param.link(self.optimizer, self._user_model, sync=self.flush_host,
                       push=self._push_optimizer_state)

    def flush_host(self) -> None:
        """Before the user's optimiser is read or written: the device's weights and state."""
        if self.sync is not None:
            self.sync.flush()
        self._pull_optimizer_state()

    def _push_optimizer_state(self) -> None:
        """The user's optimiser state (written by write_ipu_state) becomes the device's."""
        if self._compiled is not None and self._compiled.engine.optimizer is not None:
            assert self.optimizer is not None
            logger.debug("Writing optimiser state tensors from host to IPU memory")
            copy_state_to_device(self.optimizer, self._compiled.engine)
