"""What the reports read of a compiled wrapper (runtime.compile.Compiled builds it): the engine
that ran the calls, the plan it started from, and how long compiling took."""
from __future__ import annotations

from typing import Protocol

from pipetorch.parallel.host.engines import Engine
from pipetorch.parallel.layout.compile_plan import CompilePlan

__all__: list[str] = []


class Compiled(Protocol):
    """A compiled wrapper's engine, plan and compile time, as the reports read them."""

    engine: Engine
    plan: CompilePlan
    seconds: float
