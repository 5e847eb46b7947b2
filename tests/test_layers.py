"""The package's import graph: no cycles between modules, and every import points down the
layers (the user's wrapper -> compile -> engine -> foundations), lazy imports included."""
from __future__ import annotations

import ast
from pathlib import Path

import pipetorch

ROOT = Path(pipetorch.__file__).parent

# Lowest first. A module may import its own layer and the layers below it.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "enums", "log_level", "printing", "losses", "tracebacks", "tensor_ops",
     "extensions", "ops", "environment", "torch_compat", "memfd", "version"),  # foundations, beside the flow
    ("schedule",),                          # schedules as pure data
    ("optim",),                             # PopTorch's optimisers
    ("weights",),                           # where each weight lives: files, shared memory, copies
    ("partition",),                         # compile: blocks, probe, capture, split, cache
    ("parallel", "parallel.layout"),        # compile-time: placement, routes, ties
    ("parallel.comm",),                     # between processes: messages, wire, links, arenas
    ("parallel.worker", "parallel.generation"),  # in a device's worker: executor, generation
    ("parallel.host",),                     # in the user's process: engines, worker set, clients
    ("planning",),                          # compile-time: memory model and estimate, balancing
    ("profiling",),                         # a run's reports: spans, memory.json, comparisons
    ("options", "data", "poptorch_core"),   # PopTorch's Options, DataLoader, core checks
    ("runtime",),                           # the wrapper: trainingModel, weights, anchors
    ("popdist",),                           # PopDist's API over torchrun's processes
    ("cli", "__main__", ""),                # the command line and the top-level names
)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in ROOT.rglob("*.py")}


def _type_checking_only(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imports_of(path: Path, known: set[str], *, typing: bool = False) -> set[str]:
    """The pipetorch modules `path` imports, at any depth; under `if TYPE_CHECKING:` too with
    `typing`."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if _type_checking_only(node) and not typing:
            return
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] == "pipetorch":
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in known else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in known)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return {m for m in found if m in known}


def graph(*, typing: bool = False) -> dict[str, set[str]]:
    """Module -> the modules it imports. `import pipetorch` itself (for `__version__`, or the
    lazy table of public names that a config file's `poptorch.X` names resolve through) is
    left out: Python runs the package's `__init__` before any of its modules anyway."""
    known = modules()
    return {name: imports_of(path, set(known), typing=typing) - {name, "pipetorch"}
            for name, path in known.items()}


def layer_of(module: str) -> int:
    """parallel's folders are layers of their own: which process runs the code."""
    parts = module.split(".")[1:3]
    top = ".".join(parts) if parts[:1] == ["parallel"] else (parts[0] if parts else "")
    for index, names in enumerate(LAYERS):
        if top in names:
            return index
    raise AssertionError(f"{module} belongs to no layer: add its package to LAYERS")


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return found


def test_every_module_has_a_layer():
    for name in modules():
        layer_of(name)


def test_no_import_points_up_a_layer():
    upward = sorted(f"{a} -> {b}" for a, targets in graph().items() for b in targets
                    if layer_of(b) > layer_of(a))
    assert upward == [], "imports pointing up the layers:\n" + "\n".join(upward)


def test_no_import_cycles_type_only_imports_included():
    assert cycles(graph(typing=True)) == []


# Imports under TYPE_CHECKING that point up these layers: the user's Options, which the public
# `pipetorch.balance(options=)` sets and the memory report reads (options/ sits above planning/
# and profiling/ here, beside the DataLoader; no module of options/ imports them, so the
# packages form no circle). Issue 52 asks for none; the list may only shrink.
TYPED_UPWARD = {
    "pipetorch.planning.balancing -> pipetorch.options.options",
    "pipetorch.planning.memory -> pipetorch.options.options",
    "pipetorch.profiling.memory -> pipetorch.options.options",
    "pipetorch.profiling.recorder -> pipetorch.options.options",
    "pipetorch.profiling.summary -> pipetorch.options.options",
}


def test_type_only_imports_point_up_only_where_they_did():
    upward = {f"{a} -> {b}" for a, targets in graph(typing=True).items() for b in targets
              if layer_of(b) > layer_of(a)}
    assert upward <= TYPED_UPWARD, f"new upward imports: {sorted(upward - TYPED_UPWARD)}"
    assert upward == TYPED_UPWARD, f"gone (remove them from TYPED_UPWARD): {TYPED_UPWARD - upward}"


def test_the_checks_see_a_cycle_and_an_upward_import():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert layer_of("pipetorch.parallel.worker.stage") > layer_of("pipetorch.partition.split")
    assert layer_of("pipetorch.runtime.executor") > layer_of("pipetorch.parallel.host.engine")
    assert layer_of("pipetorch.parallel.host.engine") > layer_of("pipetorch.parallel.worker.stage") \
        > layer_of("pipetorch.parallel.comm.messages") > layer_of("pipetorch.parallel.layout.routes")
