"""One module per pipeline stage, cut from a single traced forward along its blocks."""
from __future__ import annotations

import operator
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Hashable, Iterator, TypeVar

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.passes.split_module import split_module
from torch.utils import _pytree as pytree

from pipetorch.errors import CompileError
from pipetorch.partition import export
from pipetorch.partition.casting import Casting
from pipetorch.partition.export import Tree
from pipetorch.partition.stage_module import StageModule
from pipetorch.partition.strategies import StageSpec, stage_of_blocks
from pipetorch.partition.trace import BLOCK_KEY, InputLayout, Traced, trace_blocks

if TYPE_CHECKING:  # annotations only: save() imports the cache when it writes
    from pipetorch.partition.cache import Stored
    from pipetorch.partition.probe import Capture

__all__: list[str] = []

L = TypeVar("L")
T = TypeVar("T")


class Source(tuple):
    """Where a value comes from: `("input", i)`, the i-th tensor argument of forward, or
    `("stage", j, k)`, output k of stage j. Compares equal to the plain tuple."""

    __slots__ = ()

    @classmethod
    def input(cls, index: int) -> "Source":
        return cls(("input", index))

    @classmethod
    def stage(cls, stage: int, slot: int) -> "Source":
        return cls(("stage", stage, slot))

    @property
    def kind(self) -> str:
        return self[0]


@dataclass(frozen=True)
class StageIO:
    """What a stage module takes (in call order) and what it returns (always a tuple)."""

    inputs: tuple[Source, ...]
    outputs: tuple[str, ...]  # graph names of the returned values, by slot (for messages)


@dataclass(frozen=True, eq=False)
class StagedModel:
    """A model cut into stages that run one after another, each owning its own weights.

    `modules[j]` is stage j: an `fx.GraphModule` holding only the parameters and buffers that
    stage uses, under their names in the user's model (`layer3.1.conv1.weight`); they are the
    user's Parameter objects, not copies (a tied one is in every stage using it; `owners`
    names a stage per device holding it, and each device's worker trains its own copy).
    `io[j].inputs` lists where each of its arguments comes from; `output` is forward's return
    structure with a Source at each tensor leaf.

    Routing for the runtime: a value read by a stage other than the next one (a skip
    connection over a stage) is listed with its true source `("stage", j, k)`. Send it from
    stage j to its reader directly (point-to-point, matched by micro-batch), or relay it
    through the stages in between: both compute the same numbers; direct sends keep the
    intermediate stages' memory and links free. In backward the gradient for that input goes
    back to stage j the same way and is summed with j's other output gradients before j's
    backward runs. `readers(j, k)` lists the stages reading a value; an output leaf whose
    source is a non-last stage (or a host input) is shipped to the host from there. Stage
    modules may modify their inputs in place (as the model's forward did), so a value sent to
    several readers must reach each reader as it was when the producer returned it, i.e. as
    its own copy (which a send gives). The graph was traced in the model's train/eval mode
    at the time: `training` records it; split again for the other mode.
    """

    modules: list[nn.Module]
    specs: tuple[StageSpec, ...]
    io: tuple[StageIO, ...]
    output: Tree
    layout: InputLayout
    owners: dict[str, tuple[int, ...]]  # parameter or buffer name in the user's model -> the
    # stages holding it: one per device using it (several for a parameter tied across devices)
    training: bool

    def flatten_inputs(self, *args: Tree, **kwargs: Tree) -> list[torch.Tensor]:
        """The host inputs `("input", i)` of a call: its tensor arguments in forward's order."""
        return self.layout.flatten(args, kwargs)

    def tied(self) -> dict[str, tuple[int, ...]]:
        """The parameters held by stages of several devices, with those stages: each device
        has its own copy, trained as one weight (gradients summed before every step)."""
        return {name: stages for name, stages in self.owners.items() if len(stages) > 1}

    def readers(self, stage: int, slot: int) -> tuple[int, ...]:
        """The stages that take output `slot` of `stage` as an input."""
        wanted = Source.stage(stage, slot)
        return tuple(j for j, io in enumerate(self.io) if wanted in io.inputs)

    def run(self, *args: Tree, **kwargs: Tree) -> Tree:
        """Run every stage in order in this process: the same result as the model's forward."""
        inputs = self.flatten_inputs(*args, **kwargs)
        produced: list[tuple] = []

        def fetch(source: Source) -> Any:
            return inputs[source[1]] if source.kind == "input" else produced[source[1]][source[2]]

        for module, io in zip(self.modules, self.io, strict=True):
            produced.append(tuple(module(*(fetch(s) for s in io.inputs))))
        return map_leaves(self.output, Source, fetch)


@dataclass(frozen=True)
class OutputTree:
    """Forward's output as flat leaves and the pytree spec that rebuilds it (tuples, dicts,
    dataclasses such as HuggingFace's ModelOutput); what a torch.export capture returns."""

    spec: pytree.TreeSpec
    leaves: tuple


def _children(spec: pytree.TreeSpec) -> list[pytree.TreeSpec]:
    method = getattr(spec, "children", None)  # torch >= 2.12; children_specs before
    return list(method() if callable(method) else spec.children_specs)


def _plain(spec: pytree.TreeSpec) -> bool:
    """Whether the structure is made of tuples, lists and dicts only (map_leaves rebuilds it)."""
    return spec.is_leaf() or (spec.type in (tuple, list, dict) and all(map(_plain, _children(spec))))


def map_leaves(structure: Tree, leaf: type[L], fn: Callable[[L], object]) -> Tree:
    """`structure` (nested tuples, lists, dicts, an OutputTree) with every instance of `leaf`
    replaced by fn."""
    if isinstance(structure, leaf):
        return fn(structure)
    if isinstance(structure, OutputTree):
        return pytree.tree_unflatten([map_leaves(v, leaf, fn) for v in structure.leaves],
                                     structure.spec)
    if isinstance(structure, tuple):
        items = [map_leaves(v, leaf, fn) for v in structure]
        named: Callable[..., Tree] = type(structure)  # a namedtuple takes its fields as arguments
        return named(*items) if hasattr(structure, "_fields") else tuple(items)
    if isinstance(structure, list):
        return [map_leaves(v, leaf, fn) for v in structure]
    if isinstance(structure, dict):
        return {k: map_leaves(v, leaf, fn) for k, v in structure.items()}
    return structure


def capture(model: nn.Module, args: tuple, kwargs: dict, *,
            casting: Casting | None = None) -> Traced:
    """`model(*args, **kwargs)` as one graph stamped with blocks: torch.export, else torch.fx.

    torch.fx symbolic tracing serves only where export cannot run (an old torch); when export
    fails the error names the user's line and the construct. `casting` (partition.casting) is
    the mode forward runs under; the casts it makes become nodes of the graph. torch.fx traces
    proxies, whose dtypes are unknown, so on that path ops mixing float16 and float32 are
    left to PyTorch's rules.
    """
    from pipetorch import ops

    # The device's view of forward (isRunningOnIpu() is True), printing nothing while captured.
    with ops.running_on_device(), ops.recomputing():
        if export.available():
            return export.export_blocks(model, args, kwargs, casting=casting)
        return trace_blocks(model, args, kwargs)


class CaptureOnce:
    """One compilation's capture of forward and what is derived from it, each made once.

    `capture(model, *first)` is made on the first call and shared by the memory estimate and
    the engine, as is `split(stages)`. `remember(key, make)` keeps a value derived from the
    capture (the values' specs, the stages' measured footprints). With `cache_dir` (the
    executable cache) `save()` writes the capture with `probe`'s findings and the remembered
    values;
    `stored` (`cache.lookup`) is what an earlier run saved there, used instead of capturing,
    probing or measuring again; `traced` is a capture already made (partition.probe's
    probe_by_export).
    """

    def __init__(self, model: nn.Module, first: tuple[tuple, dict], *,
                 cache_dir: str | None = None, settings: dict[str, object] | None = None,
                 casting: Casting | None = None, probe: Capture | None = None,
                 stored: Stored | None = None, traced: Traced | None = None) -> None:
        self.model, self.first, self.cache_dir, self.settings = model, first, cache_dir, settings
        self.casting, self.probe, self._stored = casting, probe, stored
        self._traced = stored.traced if stored is not None else traced
        self._memo: dict[Any, Any] = dict(stored.memo) if stored is not None else {}
        self._staged: dict[tuple[StageSpec, ...], StagedModel] = {}
        self.seconds = 0.0
        self.from_cache = stored is not None
        self._unsaved = traced is not None

    @property
    def done(self) -> bool:
        """Whether the capture was made (or loaded)."""
        return self._traced is not None

    def __call__(self) -> Traced:
        if self._traced is None:
            start = time.perf_counter()
            self._traced = capture(self.model, *self.first, casting=self.casting)
            self.seconds = time.perf_counter() - start
            self._unsaved = True
        return self._traced

    def moved(self, model: nn.Module, first: tuple[tuple, dict]) -> "CaptureOnce":
        """This capture's findings for `model` and `first` on another device (this model
        moved there, or a copy of it), before anything was derived from it: the executable
        cache's entry is kept; a graph captured here is not, and is captured again when
        needed."""
        return CaptureOnce(model, first, cache_dir=self.cache_dir, settings=self.settings,
                           casting=self.casting, probe=self.probe, stored=self._stored)

    def split(self, stages: list[StageSpec]) -> StagedModel:
        """`split_stages` of the capture into `stages`, cut once."""
        key = tuple(stages)
        if key not in self._staged:
            self._staged[key] = split_stages(self.model, *self.first, stages, traced=self())
        return self._staged[key]

    def remember(self, key: Hashable, make: Callable[[], T]) -> T:
        """`make()`, computed once per key (and once per cache entry: saved with it)."""
        if key not in self._memo:
            self._memo[key] = make()
            self._unsaved = True
        return self._memo[key]

    def save(self) -> None:
        """Write what was captured or remembered since the entry was read (once, at the end
        of compiling) to the executable cache, when one is enabled."""
        if self._unsaved and self.cache_dir and self.probe is not None and \
                self._traced is not None:
            from pipetorch.partition.cache import Stored, store

            store(self.cache_dir, self.model, *self.first,
                  Stored(self.probe, self._traced, dict(self._memo)), settings=self.settings)
            self._unsaved = False


def split_stages(model: nn.Module, args: tuple, kwargs: dict,
                 stages: list[StageSpec], *, traced: Traced | None = None) -> StagedModel:
    """Capture `model(*args, **kwargs)` once (or use `traced`, that capture) and cut it into
    one module per stage.

    Ops before the first block go to stage 0. Raises CompileError when forward cannot be
    captured, when the captured blocks differ from `stages`, when a stage would need a value
    computed by a later stage, or when a buffer is used by two stages on different devices.
    A parameter used on several devices (GPT-2's lm_head tied to wte) is held by a stage of
    each (`StagedModel.tied`); two stages of one device share its worker's one copy.
    """
    if traced is None:
        traced = capture(model, args, kwargs)
    _check_blocks(traced, stages)
    graph = traced.module.graph
    stage_of = _assign(graph, stage_of_blocks(stages))
    _check_order(graph, stage_of)
    owners = _owners(model, traced.module, stage_of, [s.ipu_id for s in stages])
    qualnames: dict[str, str] = {}
    top = split_module(traced.module, traced.module, stage_of.__getitem__,
                       qualname_map=qualnames, keep_original_order=True)
    return _assemble(top, qualnames, traced, stages, owners, training=model.training)


def _check_blocks(traced: Traced, stages: list[StageSpec]) -> None:
    seen = [b.user_id for b in traced.blocks]
    named = [b for s in stages for b in s.block_ids]
    if sorted(seen) != sorted(named):
        raise CompileError(
            f"Tracing forward entered blocks {seen} but the stages are made of blocks {named}: "
            "forward must enter the same blocks on every call (no block chosen by a tensor's "
            "value or by an argument that changed); resolve the stages from the same call"
        )


def _ops(graph: fx.Graph) -> Iterator[fx.Node]:
    return (n for n in graph.nodes if n.op not in ("placeholder", "get_attr", "output"))


def _assign(graph: fx.Graph, stage_of_block: dict[str, int]) -> dict[fx.Node, int]:
    """Stage of every op: its block's stage; ops before the first block are in stage 0."""
    return {n: 0 if n.meta[BLOCK_KEY] is None else stage_of_block[n.meta[BLOCK_KEY]]
            for n in _ops(graph)}


def _check_order(graph: fx.Graph, stage_of: dict[fx.Node, int]) -> None:
    for node in _ops(graph):
        for source in node.all_input_nodes:
            if stage_of.get(source, 0) > stage_of[node]:
                raise CompileError(
                    f"'{node.name}' in block {node.meta[BLOCK_KEY]!r} (stage {stage_of[node]}) "
                    f"reads '{source.name}', computed later in block {source.meta[BLOCK_KEY]!r} "
                    f"(stage {stage_of[source]}): a stage can only use values of earlier stages. "
                    "Put both blocks in one stage, or re-order the blocks so data flows forward"
                )


def _owners(model: nn.Module, traced: fx.GraphModule, stage_of: dict[fx.Node, int],
            ipus: list[int]) -> dict[str, tuple[int, ...]]:
    """The stages holding each parameter and buffer forward uses: one per device using it,
    the last of its stages there (stages of one device share the device's copy). A buffer
    used on two devices is an error: forward may change it, and the copies would diverge."""
    names: dict[int, tuple[str, str]] = {}  # id -> (name, kind), the first name of a tied one
    for kind, named in (("Parameter", model.named_parameters(remove_duplicate=False)),
                        ("Buffer", model.named_buffers(remove_duplicate=False))):
        for name, tensor in named:
            names.setdefault(id(tensor), (name, kind))
    uses: dict[tuple[str, str], dict[int, fx.Node]] = {}
    for node in traced.graph.nodes:
        if node.op == "call_module":
            users = [node]
        elif node.op == "get_attr":
            users = [u for u in node.users if u in stage_of]
        else:
            continue
        for tensor in _tensors_of(operator.attrgetter(node.target)(traced)):
            if id(tensor) in names:
                for user in users:
                    uses.setdefault(names[id(tensor)], {}).setdefault(stage_of[user], user)
    owners: dict[str, tuple[int, ...]] = {}
    for (name, kind), by_stage in uses.items():
        if kind == "Buffer":
            _check_one_device(name, by_stage, ipus)
        last = {ipus[stage]: stage for stage in sorted(by_stage)}
        owners[name] = tuple(sorted(last.values()))
    return owners


def _check_one_device(name: str, by_stage: dict[int, fx.Node], ipus: list[int]) -> None:
    apart = sorted({ipus[stage]: (stage, user) for stage, user in
                    sorted(by_stage.items(), reverse=True)}.values())
    if len(apart) > 1:
        (first, a), (second, b) = apart[:2]
        raise CompileError(
            f"Buffer '{name}' is used by stage {first} ('{a.name}' in block "
            f"{a.meta[BLOCK_KEY]!r}, ipu {ipus[first]}) and by stage {second} ('{b.name}' "
            f"in block {b.meta[BLOCK_KEY]!r}, ipu {ipus[second]}), but each device keeps its "
            "own copy of a buffer and forward may change it, so the copies would diverge. "
            "Put both uses on one device (both blocks on one ipu_id), or give each use its "
            "own buffer"
        )


def _tensors_of(value: object) -> list[torch.Tensor]:
    if isinstance(value, nn.Module):
        return [*value.parameters(), *value.buffers()]
    return [value] if isinstance(value, torch.Tensor) else []


def _assemble(top: fx.GraphModule, qualnames: dict[str, str], traced: Traced,
              stages: list[StageSpec], owners: dict[str, tuple[int, ...]], *,
              training: bool) -> StagedModel:
    """Read the stages' sources off split_module's top-level graph and re-home their weights."""
    sources: dict[fx.Node, Source] = {}
    modules: list[nn.Module] = [_empty_stage(j) for j in range(len(stages))]
    ios = [StageIO((), ())] * len(stages)
    # Placeholders are forward's tensor arguments in signature order (export names them
    # after its flat inputs, fx after forward's parameters).
    position = {n.target: i for i, n in enumerate(traced.module.graph.find_nodes(op="placeholder"))}
    for node in top.graph.nodes:
        if node.op == "placeholder":
            sources[node] = Source.input(position[node.target])
        elif node.op == "call_module":
            j = int(str(node.target).removeprefix("submod_"))
            modules[j], ios[j] = _rehome(getattr(top, node.target), node, qualnames, sources, j)
            sources[node] = Source.stage(j, 0)  # read directly only when j has a single output
        elif node.op == "call_function" and node.target is operator.getitem:
            call = node.args[0]
            stage = int(str(call.target).removeprefix("submod_"))
            sources[node] = Source.stage(stage, node.args[1])
    output = next(iter(top.graph.find_nodes(op="output"))).args[0]
    structure = map_leaves(output, fx.Node, lambda n: _source(n, sources))
    spec = traced.output_spec
    if spec is not None:
        assert isinstance(structure, (tuple, list))  # export's graph returns the flat leaves
        structure = (pytree.tree_unflatten(list(structure), spec) if _plain(spec)
                     else OutputTree(spec, tuple(structure)))
    return StagedModel(modules, tuple(stages), tuple(ios), structure, traced.layout, owners,
                       training)


def _source(node: fx.Node, sources: dict[fx.Node, Source]) -> Source:
    if node not in sources:
        raise CompileError(
            f"forward returns '{node.target}' ({node.op}) directly, which no stage computes; "
            "return values computed in forward (e.g. a clone of it)"
        )
    return sources[node]


def _rehome(part: fx.GraphModule, call: fx.Node, qualnames: dict[str, str],
            sources: dict[fx.Node, Source], index: int) -> tuple[nn.Module, StageIO]:
    """split_module's stage, with its parameters under their original names inside it.

    split_module renames submodules (`layer1.conv` -> `layer1_conv`) and passes weights read
    with get_attr in from the top level; here both live in the stage under the model's names.
    """
    graph = fx.Graph()
    attrs: dict[str, Any] = {}
    env: dict[fx.Node, fx.Node] = {}
    inputs: list[Source] = []
    placeholders = iter(call.args)
    for node in part.graph.nodes:
        if node.op == "placeholder":
            arg = next(placeholders)
            assert isinstance(arg, fx.Node)
            if arg.op == "get_attr":
                target = str(arg.target)
                attrs[target] = operator.attrgetter(target)(call.graph.owning_module)
                env[node] = graph.get_attr(target)
            else:
                inputs.append(sources[arg])
                env[node] = graph.placeholder(node.name)
        elif node.op in ("call_module", "get_attr"):
            name = qualnames.get(f"submod_{index}.{node.target}", node.target)
            attrs[name] = operator.attrgetter(node.target)(part)
            env[node] = graph.create_node(node.op, name, fx.map_arg(node.args, env.__getitem__),
                                          fx.map_arg(node.kwargs, env.__getitem__), node.name)
            env[node].meta = node.meta.copy()
        elif node.op == "output":  # a stage always returns a tuple, one value or several
            values = node.args[0] if isinstance(node.args[0], tuple) else (node.args[0],)
            outputs = tuple(env[n] for n in values)
            graph.output(outputs)
        else:
            env[node] = graph.node_copy(node, env.__getitem__)
    module = StageModule(attrs, graph, class_name=f"Stage{index}")
    return module, StageIO(tuple(inputs), tuple(n.name for n in outputs))


def _empty_stage(index: int) -> fx.GraphModule:
    """A stage whose blocks compute nothing: no inputs, no outputs."""
    graph = fx.Graph()
    graph.output(())
    return StageModule(nn.Module(), graph, class_name=f"Stage{index}")
