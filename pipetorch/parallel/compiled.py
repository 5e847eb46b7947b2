"""Stages run through torch.compile (opt-in): `opts.Jit.compileStages()` or PIPETORCH_COMPILE."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from pipetorch.parallel.recompute import _SharedView

__all__: list[str] = []


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

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.__dict__["_compiled"] is None:
            # Static shapes: a stage always sees its micro-batch's shapes (PopTorch's rule too).
            self.__dict__["_compiled"] = torch.compile(self.module, backend=self.backend,
                                                       dynamic=False)
        return self.__dict__["_compiled"](*args, **kwargs)

    def _apply(self, fn: Any, recurse: bool = True) -> nn.Module:
        self.__dict__["_compiled"] = None  # moved or converted weights: compile again
        return super()._apply(fn, recurse)

    def __reduce__(self) -> tuple[type, tuple[nn.Module, str]]:
        return type(self), (self.module, self.backend)
