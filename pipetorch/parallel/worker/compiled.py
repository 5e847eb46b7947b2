"""Stages run through torch.compile (opt-in): `opts.Jit.compileStages()` or PIPETORCH_COMPILE."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
import torch.nn as nn

from pipetorch.parallel.worker.recompute import _SharedView

if TYPE_CHECKING:  # annotations only
    from pipetorch.parallel.comm.payloads import DeviceStage

__all__: list[str] = []

# Seconds the NCCL watchdog waits beyond PIPETORCH_TIMEOUT in workers whose stages compile.
# torch.compile runs at a stage's first forward and (AOTAutograd) first backward, in the
# middle of the first call's schedule: a neighbour's receive, posted before that compile
# started, waits for all of it, and the watchdog would abort the waiting worker. Compiling
# before the first transfer instead would need every stage's inputs and gradients up front
# (one more forward and backward, on made-up data, moving BatchNorm statistics and random
# streams), so the watchdog gets an allowance instead. A worker that stops answering is still
# reported after PIPETORCH_TIMEOUT by the host (wire.gather), which waits for every call's
# reply, and a dead one at once; the watchdog only has to stay behind the host.
COMPILE_ALLOWANCE = 1800.0


class CompiledStage(_SharedView):
    """`module` run through `torch.compile(backend=...)`, compiled at its first call.

    It shares `module`'s parameters, buffers and names, and pickles as `module` plus the
    backend, so a stage worker compiles its own copy (compiled code does not pickle).
    """

    def __init__(self, module: nn.Module, backend: str) -> None:
        super().__init__(module)
        self.__dict__["_backend"] = backend
        self.__dict__["_compiled"] = None

    @property
    def backend(self) -> str:
        return self.__dict__["_backend"]

    def forward(self, *args: object, **kwargs: object) -> Any:
        if self.__dict__["_compiled"] is None:
            # Static shapes: a stage always sees its micro-batch's shapes (PopTorch's rule too).
            self.__dict__["_compiled"] = torch.compile(self.module, backend=self.backend,
                                                       dynamic=False)
        return self.__dict__["_compiled"](*args, **kwargs)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True
               ) -> nn.Module:
        self.__dict__["_compiled"] = None  # moved or converted weights: compile again
        return super()._apply(fn, recurse)

    def __reduce__(self) -> tuple[type, tuple[nn.Module, str]]:
        return type(self), (self.module, self.backend)


def compile_backend(stages: Sequence[DeviceStage]) -> str | None:
    """The torch.compile backend of `stages` (DeviceStages), None when none is compiled."""
    return next((s.module.backend for s in stages if isinstance(s.module, CompiledStage)), None)


def watchdog_timeout(timeout: float, *, backend: str, compiling: bool) -> float:
    """The process group's timeout (the NCCL watchdog's) for waits of `timeout` seconds:
    COMPILE_ALLOWANCE more on NCCL while stages compile; gloo's waits are bounded by the
    links themselves (PeerLink._wait), so its timeout stays as it is."""
    return timeout + COMPILE_ALLOWANCE if backend == "nccl" and compiling else timeout


def limit_compile_threads(*, workers: int, cores: int) -> int:
    """Cap inductor's compile threads in this worker at its share of the cores,
    max(1, cores // workers); the threads it now uses.

    Each process's inductor otherwise starts min(32, cores) compile workers: 8 GPU workers
    on 16 cores would run 128 compile processes at once. Call it before the first compile.
    """
    import torch._inductor.config as inductor  # here: only compiling workers pay the import

    share = max(1, cores // max(1, workers))
    inductor.compile_threads = min(inductor.compile_threads or share, share)
    return inductor.compile_threads
