"""Activation recomputation: forward cut at recomputationCheckpoint calls, or a whole stage
checkpointed, so backward reruns the forward instead of keeping its activations."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import operator
import traceback
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
import torch.fx as fx
from torch import nn
from torch.utils.checkpoint import checkpoint as _checkpoint

from pipetorch import ops
from pipetorch.errors import CompileError
from pipetorch.partition.trace import FX_RULES, user_line
from pipetorch.partition.inplace import inplace_inputs
from pipetorch.partition.casting import HalfFloatCasting

if TYPE_CHECKING:
    from typing_extensions import Self  # typing's from Python 3.11

__all__: list[str] = []


def stage_module(module: nn.Module, *, checkpoint: bool) -> nn.Module:
    """`module` (one pipeline stage, or any module) set up to recompute activations in backward.

    checkpoint=True (Options.Training.setRecomputation): the whole forward runs under
    activation checkpointing, so only the inputs stay alive until backward, which reruns the
    forward first (same RNG state, so dropout masks match). Otherwise, when forward calls
    poptorch.recomputationCheckpoint, the activations between checkpoints are recomputed (see
    _RecomputedModule); without calls `module` itself is returned. An fx.GraphModule (a stage
    from split_stages) is read as it is; another module is traced with torch.fx to find the
    calls (CompileError when it can't be).

    The result shares `module`'s parameters, buffers and submodules under the same names
    (named_parameters() and state_dict() keys are identical), updates buffers once per forward
    as `module` does, and pickles (the unpickled copy shares its own weights the same way).
    """
    if checkpoint:
        return _CheckpointedStage(module)
    if isinstance(module, fx.GraphModule):
        calls = any(_is_checkpoint(node) for node in module.graph.nodes)
        return _RecomputedModule(module) if calls else module
    recomputed = _RecomputedModule(module)
    return recomputed if recomputed.segmented else module


def original_module(module: nn.Module) -> nn.Module:
    """The module stage_module or compiled_stage wrapped (through every
    layer of wrapping); `module` itself otherwise."""
    while isinstance(module, _SharedView):
        module = module.module
    return module


class _SharedView(nn.Module):
    """Runs `module` while presenting its parameters, buffers and submodules as its own.

    The registries are the same dict objects as `module`'s, not copies: names are identical,
    and weights loaded, moved or replaced through either object are seen by both. `module` is
    deliberately not a registered child (its names would gain a `module.` prefix).
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        for name in ("_parameters", "_buffers", "_non_persistent_buffers_set", "_modules"):
            self.__dict__[name] = module.__dict__[name]
        self.__dict__["_wrapped"] = module
        self.training = module.training

    @property
    def module(self) -> nn.Module:
        """The module run."""
        return self.__dict__["_wrapped"]

    def train(self, mode: bool = True) -> Self:
        super().train(mode)
        self.module.train(mode)  # not a registered child, and its forward may read .training
        return self

    def __reduce__(self) -> tuple[type, tuple[object, ...]]:
        # Unpickling rebuilds the module (a GraphModule gets new registries): share those.
        return type(self), (self.module,)


class _CheckpointedStage(_SharedView):
    """The whole forward checkpointed: its inputs are kept, everything else recomputed."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__(module)
        self._mutated = _inplace_inputs(module)

    def forward(self, *args: object, **kwargs: object) -> Any:
        if not torch.is_grad_enabled():
            return self.module(*args, **kwargs)
        return _checkpoint_call(self.module, self._mutated, args, kwargs,
                                owner=f"{type(self.module).__name__}.forward")


class _RecomputedModule(_SharedView):
    """Runs the segmented program traced for the current train/eval modes of `module`: its
    activations between recomputationCheckpoint calls are recomputed in backward, not kept.

    The forward is traced with torch.fx (an fx.GraphModule's own graph is used as it is) and
    cut after every checkpoint call; each segment that ends in a checkpoint runs under
    torch.utils.checkpoint, so only the values crossing segments stay alive. It computes the
    same numbers as `module`. Raises CompileError when forward cannot be traced.
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__(module)
        # fx bakes Python-level branches on `self.training` into the graph, so one program is
        # kept per combination of modes. Not registered: `module` already owns the weights.
        self._programs: dict[tuple[bool, ...], fx.GraphModule] = {}
        self._program()  # trace now so an untraceable model fails at wrapping time

    @property
    def segmented(self) -> bool:
        """Whether forward calls recomputationCheckpoint (some segment is recomputed)."""
        return any(isinstance(m, _CheckpointedSegment) for m in self._program().children())

    def forward(self, *args: object, **kwargs: object) -> Any:
        if not torch.is_grad_enabled():  # nothing is kept for backward: nothing to recompute
            return self.module(*args, **kwargs)
        return self._program()(*args, **kwargs)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True
               ) -> nn.Module:
        # Conversions may put new Parameter objects in the modules (torch.__future__'s
        # overwrite_module_params_on_conversion); the traces hold the old ones: trace again.
        self._programs.clear()
        return super()._apply(fn, recurse)

    def _program(self) -> fx.GraphModule:
        modes = tuple(m.training for m in self.module.modules())
        if modes not in self._programs:
            self._programs[modes] = _build_program(self.module)
        return self._programs[modes]


class _CheckpointedSegment(nn.Module):
    """A segment whose inner activations are dropped after forward and recomputed in backward."""

    def __init__(self, segment: fx.GraphModule) -> None:
        super().__init__()
        self.segment = segment
        self._mutated = _inplace_inputs(segment)

    def forward(self, *inputs: object) -> Any:
        if not torch.is_grad_enabled():
            return self.segment(*inputs)
        return _checkpoint_call(self.segment, self._mutated, inputs, {},
                                owner="The code before a recomputationCheckpoint call")


def _inplace_inputs(module: nn.Module) -> tuple[int, ...]:
    # The stage executor's own reading of which inputs the module changes in place.
    return tuple(sorted(inplace_inputs(module)))


def _checkpoint_call(module: nn.Module, mutated: tuple[int, ...], args: tuple[object, ...],
                     kwargs: dict[str, object], *, owner: str) -> Any:
    """`module(*args, **kwargs)` under non-reentrant checkpointing, RNG state kept.

    Arguments at the positions in `mutated` (which forward changes in place, e.g.
    ReLU(inplace=True)) are changed in the caller's tensors as without checkpointing, while
    the copy checkpoint keeps for the rerun stays as it was received.
    """
    given = {i: a for i in mutated if i < len(args) and isinstance(a := args[i], torch.Tensor)}
    kept = [given[i].clone() if i in given else a for i, a in enumerate(args)]
    versions = [(i, a, a._version) for i, a in enumerate(kept) if isinstance(a, torch.Tensor)]
    run = functools.partial(_run_on_copies, module, tuple(given), **kwargs)
    outputs, changed = _checkpoint(run, *kept, use_reentrant=False,
                                   context_fn=functools.partial(_contexts, module))
    for index, arg, version in versions:
        if arg._version != version:
            raise CompileError(
                f"{owner} modified its input {_input_name(module, index)} in place, so it "
                "cannot be rerun in backward from its inputs to recompute activations. Compute "
                "it out of place (`x = x + 1`, ReLU(inplace=False)), or turn recomputation off")
    for tensor, value in zip(given.values(), changed, strict=True):
        tensor.copy_(value)  # through autograd: the gradient reaches the recomputed value
    return outputs


def _run_on_copies(module: nn.Module, positions: tuple[int, ...], *args: object,
                   **kwargs: object) -> tuple[Any, tuple[torch.Tensor, ...]]:
    copies = {i: a.clone() for i, a in enumerate(args)
              if i in positions and isinstance(a, torch.Tensor)}
    outputs = module(*(copies.get(i, a) for i, a in enumerate(args)), **kwargs)
    return outputs, tuple(copies.values())


def _input_name(module: nn.Module, index: int) -> str:
    if isinstance(module, fx.GraphModule):
        names = [n.name for n in module.graph.find_nodes(op="placeholder")]
        if index < len(names):
            return f"{index} ('{names[index]}')"
    return str(index)


def _contexts(module: nn.Module
              ) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """checkpoint's context_fn (with `module` bound): nothing around the forward,
    _recomputation around the rerun."""
    # Called as the forward starts: the rerun casts as this forward does (partition.casting).
    casting = [m for m in torch.overrides._get_current_function_mode_stack()
               if isinstance(m, HalfFloatCasting)]
    return contextlib.nullcontext(), _recomputation(list(module.buffers()), casting)


@contextlib.contextmanager
def _recomputation(buffers: list[torch.Tensor],
                   modes: list[HalfFloatCasting]) -> Iterator[None]:
    """Recompute without side effects: buffers (BatchNorm statistics, counters) are restored,
    so they are updated once per forward as without recomputation; ops don't print twice.
    `modes` (the forward's casting) are entered again."""
    saved = [b.clone() for b in buffers]
    try:
        with ops.recomputing(), contextlib.ExitStack() as stack:
            for mode in modes:
                stack.enter_context(mode)
            yield
    finally:
        with torch.no_grad():
            for buffer, value in zip(buffers, saved, strict=True):
                buffer.copy_(value)


@dataclasses.dataclass(frozen=True)
class _Segment:
    """Consecutive graph nodes, the earlier values they read and the values read after them."""

    nodes: tuple[fx.Node, ...]
    inputs: tuple[fx.Node, ...]
    outputs: tuple[fx.Node, ...]
    checkpointed: bool


def _build_program(module: nn.Module) -> fx.GraphModule:
    before = set(vars(module))
    try:
        graph = module.graph if isinstance(module, fx.GraphModule) else _trace(module)
        return _assemble(module, graph)
    finally:
        # fx stores tensor constants on the traced root; the segments hold their own references
        # by now, so the user's module is left as it was.
        for name in set(vars(module)) - before:
            delattr(module, name)


def _assemble(module: nn.Module, graph: fx.Graph) -> fx.GraphModule:
    """A program calling one submodule per segment, passing values between them."""
    program = fx.Graph()
    owned: dict[str, Any] = {}  # the program's attributes, by the names its nodes use
    env: dict[fx.Node, fx.Node] = {}

    def lookup(node: fx.Node) -> fx.Node:
        if node not in env:  # a get_attr read directly by the output
            assert isinstance(node.target, str)  # an attribute's name
            owned[node.target] = operator.attrgetter(node.target)(module)
            env[node] = program.node_copy(node)
        return env[node]

    for node in graph.find_nodes(op="placeholder"):
        env[node] = program.node_copy(node)
    for index, segment in enumerate(_segments(graph)):
        if not segment.nodes:
            continue
        code = fx.GraphModule(module, _segment_graph(segment))
        name = f"segment{index}"
        owned[name] = _CheckpointedSegment(code) if segment.checkpointed else code
        call = program.call_module(name, tuple(lookup(n) for n in segment.inputs))
        for position, node in enumerate(segment.outputs):
            env[node] = program.call_function(operator.getitem, (call, position))
    output = next(iter(graph.find_nodes(op="output")))
    program.node_copy(output, lookup)
    return fx.GraphModule(owned, program, class_name=f"Recomputed{type(module).__name__}")


def _trace(module: nn.Module) -> fx.Graph:
    try:
        return fx.Tracer().trace(module)
    except Exception as error:  # any failure of symbolic tracing is the same user problem
        raise CompileError(_trace_failure_message(module, error)) from error


def _trace_failure_message(module: nn.Module, error: Exception) -> str:
    where = user_line(traceback.extract_tb(error.__traceback__))
    return (
        f"recomputationCheckpoint needs {type(module).__name__}.forward to be traceable by "
        f"torch.fx, but tracing failed{where} ({type(error).__name__}: {error}). Either remove "
        "the poptorch.recomputationCheckpoint calls (no recomputation then), or make forward "
        f"traceable under {FX_RULES}.")


def _is_checkpoint(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is ops.recomputationCheckpoint


def _segments(graph: fx.Graph) -> list[_Segment]:
    """Cut after every checkpoint call; the part after the last one is not checkpointed."""
    groups: list[list[fx.Node]] = [[]]
    for node in graph.nodes:
        # Placeholders are program inputs; get_attr nodes are copied into each segment using them.
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        groups[-1].append(node)
        if _is_checkpoint(node):
            groups.append([])
    return [_describe(group, checkpointed=index < len(groups) - 1)
            for index, group in enumerate(groups)]


def _describe(nodes: list[fx.Node], *, checkpointed: bool) -> _Segment:
    members = set(nodes)
    inputs = {i: None for n in nodes for i in n.all_input_nodes
              if i not in members and i.op != "get_attr"}
    outputs = [n for n in nodes if any(user not in members for user in n.users)]
    return _Segment(tuple(nodes), tuple(inputs), tuple(outputs), checkpointed)


def _segment_graph(segment: _Segment) -> fx.Graph:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {n: graph.placeholder(n.name) for n in segment.inputs}
    for node in segment.nodes:
        for attr in node.all_input_nodes:
            if attr.op == "get_attr" and attr not in env:
                env[attr] = graph.node_copy(attr)
        env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(tuple(env[n] for n in segment.outputs))
    return graph
