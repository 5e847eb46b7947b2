"""Each op forward ran, named and placed as PopTorch's lowering logs it at DEBUG.

PopTorch logs every op it lowers with its name (the module path, the op type, ":0" and a
"/N" suffix for the N-th repeat of a name: "l1/Mul:0", "Mul:0/1") and where it runs
("mode(Pipelined), ipu(1), stage(1)"); scripts and PopTorch's tests read those lines to
check how blocks were placed. The capture records (name, block) of each op while
`recording()` is on (only when DEBUG is on: it costs a hook per module call), and
`placement_lines` gives the lines once the stages are known.
"""
from __future__ import annotations

import collections
import logging
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

import torch.nn as nn
from torch.nn.modules import module as module_hooks

if TYPE_CHECKING:
    from pipetorch.partition.export import Tree
    from pipetorch.partition.strategies import ExecutionStrategy, StageSpec

__all__: list[str] = []

logger = logging.getLogger("pipetorch.partition.lowering")

# torch function name -> PopART op type, where capitalising the name is not it
_TYPES = {"truediv": "Div", "div": "Div", "linear": "MatMul", "matmul": "MatMul", "mm": "MatMul",
          "bmm": "MatMul", "addmm": "MatMul", "conv1d": "Conv", "conv2d": "Conv",
          "conv3d": "Conv", "log_softmax": "LogSoftmax", "softmax": "Softmax",
          "max_pool2d": "MaxPool", "avg_pool2d": "AveragePool", "batch_norm": "BatchNormalization",
          "group_norm": "GroupNormalization", "layer_norm": "LayerNormalization"}
_REFLECTED = {"radd", "rsub", "rmul", "rtruediv", "rdiv", "rpow", "rmatmul"}


def op_type(function_name: str) -> str:
    """PopART's op type for a torch function: `__mul__` -> Mul, `relu_` -> Relu."""
    name = function_name.strip("_")
    if name in _REFLECTED:
        name = name[1:]
    name = name.rstrip("_")
    return _TYPES.get(name, "".join(part.capitalize() for part in name.split("_")))


class OpRecorder:
    """(name base, block) of each op, the name base being "<module path>/<Type>:0"."""

    def __init__(self, model: nn.Module) -> None:
        self._paths = {id(m): name.replace(".", "/") for name, m in model.named_modules()}
        self._scopes: list[str] = []
        self.ops: list[tuple[str, str | None]] = []

    def record(self, function_name: str, block: str | None) -> None:
        scope = next((s for s in reversed(self._scopes) if s), "")
        base = f"{op_type(function_name)}:0"
        self.ops.append((f"{scope}/{base}" if scope else base, block))

    @contextmanager
    def scopes(self) -> Iterator[OpRecorder]:
        """Track the module path of the running forward (global hooks, removed on exit)."""
        def enter(module: nn.Module, _args: tuple) -> None:
            self._scopes.append(self._paths.get(id(module), ""))

        def leave(module: nn.Module, _args: tuple, _out: Tree) -> None:
            if self._scopes:
                self._scopes.pop()

        pre = module_hooks.register_module_forward_pre_hook(enter)
        post = module_hooks.register_module_forward_hook(leave)
        try:
            yield self
        finally:
            pre.remove()
            post.remove()


def wanted() -> bool:
    """Whether the lines would be printed (recording costs a hook per module call)."""
    return logger.isEnabledFor(logging.DEBUG)


def placement_lines(ops: tuple[tuple[str, str | None], ...], stages: list[StageSpec],
                    strategy: ExecutionStrategy) -> list[str]:
    """One line per op: its unique name and PopTorch's "mode(M), ipu(i), stage(s)"."""
    mode = type(strategy).__name__.replace("Execution", "")
    mode = "Phased" if mode.endswith("Phased") else mode
    where = {block: stage for stage in stages for block in stage.block_ids}
    first = stages[0]
    seen: collections.Counter[str] = collections.Counter()
    lines = []
    for base, block in ops:
        stage = where.get(block, first) if block is not None else first
        name = base if not seen[base] else f"{base}/{seen[base]}"
        seen[base] += 1
        lines.append(f"Lowered op {name} : mode({mode}), ipu({stage.ipu_id}), "
                     f"stage({stage.index})")
    return lines
