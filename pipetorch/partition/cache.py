"""The executable cache: a model's captured forward saved, so the next run skips the capture.

`enableExecutableCaching(dir)` or POPTORCH_CACHE_DIR name the folder. An entry is keyed by
everything the capture depends on: the file defining each module class in the model, the
source of its hooks, parameter and buffer names, shapes and dtypes, the blocks' annotations,
the call's input signature, the train/eval modes, the options and the pipetorch, torch and
Python versions. It holds the graph (not the weights: they are the model's at load time) and
what the probe found (blocks, loss, changed buffers, output structure), so a hit compiles
without running forward, in a file that starts with a header naming pipetorch, the key and the payload's SHA-256; nothing is
unpickled before the three are checked. A stale or corrupt entry is captured again and
rewritten, with a log line.

    PIPETORCH-CAPTURE\\n
    {"format": 2, "key": "<sha256 of the key>", "sha256": "<of the payload>"}\\n
    <pickled payload>
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import json
import logging
import marshal
import os
import pickle
import platform
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Hashable, TypedDict

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils import _pytree as pytree

from pipetorch.version import __version__
from pipetorch import extensions
from pipetorch.partition.blocks import BlockInfo, begin_blocks
from pipetorch.partition.export import Tree
from pipetorch.partition.probe import Capture, on_meta
from pipetorch.partition.stage_module import NodeRecord, attribute, build_graph, graph_nodes
from pipetorch.partition.trace import BLOCK_KEY, Traced, input_layout

__all__: list[str] = []

logger = logging.getLogger(__name__)

MAGIC = b"PIPETORCH-CAPTURE\n"
FORMAT = 2  # 2: the probe's findings are stored too


# Where files go and how compilation looks do not change what is captured.
_UNKEYED_OPTIONS = ("executable_cache_dir", "profiling_dir", "log_dir",
                    "show_compilation_progress_bar", "model_name", "input_signatures")


def capture_key(model: nn.Module, args: tuple, kwargs: dict,
                settings: dict[str, object] | None = None) -> str:
    """SHA-256 of everything a capture of `model(*args, **kwargs)` depends on; `settings`
    are the options (Options.toDict())."""
    settings = settings or {}
    parts: dict[str, Any] = {
        "format": FORMAT, "pipetorch": __version__, "torch": torch.__version__,
        "python": platform.python_version(),
        "code": sorted({_source(type(m)) for m in model.modules()}),
        "hooks": [_hooks(name, m) for name, m in model.named_modules()],
        "modes": [m.training for m in model.modules()],
        "weights": [(n, tuple(t.shape), str(t.dtype), t.requires_grad)
                    for n, t in model.named_parameters(remove_duplicate=False)]
        + [(n, tuple(t.shape), str(t.dtype)) for n, t in model.named_buffers(remove_duplicate=False)],
        "blocks": sorted(begin_blocks(model).items()),
        "inputs": _signature((args, kwargs)),
        "options": {k: v for k, v in settings.items() if k not in _UNKEYED_OPTIONS},
    }
    return hashlib.sha256(json.dumps(parts, default=repr).encode()).hexdigest()


def _source(kind: type) -> str:
    """The class's name and the SHA-256 of the file defining it: any edit to that file is a
    new key. (inspect.getsource of a class parses its whole module, 30 ms for torch's.) A
    class with no file (exec'd, or its module not in sys.modules) is keyed by its methods'
    compiled code instead."""
    name = f"{kind.__module__}.{kind.__qualname__}"
    try:
        path = inspect.getsourcefile(kind)
    except TypeError:  # a built-in class, or one whose module is not in sys.modules
        path = None
    if path is None or not os.path.isfile(path):
        return f"{name}\n{_code_digest(kind)}"
    stat = os.stat(path)
    return f"{name}\n{_file_digest(path, stat.st_mtime_ns, stat.st_size)}"


def _code_digest(kind: type) -> str:
    """SHA-256 of the code of the functions defined in the class body (the key carries the
    Python version, which marshal's format depends on)."""
    digest = hashlib.sha256()
    for name, value in sorted(vars(kind).items()):
        function = getattr(value, "__func__", value)  # staticmethod, classmethod
        code = getattr(function, "__code__", None)
        if code is not None:
            digest.update(name.encode() + marshal.dumps(code))
    return digest.hexdigest()


@functools.lru_cache(maxsize=None)
def _file_digest(path: str, mtime_ns: int, size: int) -> str:
    """SHA-256 of the file at `path`, read once per (modification time, size)."""
    with open(path, "rb") as file:
        return hashlib.sha256(file.read()).hexdigest()


def _hooks(name: str, module: nn.Module) -> list[str]:
    found = []
    for registry in (module._forward_pre_hooks, module._forward_hooks):
        for hook in registry.values():
            function = getattr(hook, "__func__", hook)
            found.append(f"{name}:{getattr(function, '__qualname__', repr(function))}:"
                         f"{_function_source(function)}")
    return found


def _function_source(function: Callable) -> str:
    try:
        return inspect.getsource(function)
    except (OSError, TypeError):
        return ""


def _signature(value: Tree) -> object:
    if isinstance(value, torch.Tensor):
        return ["tensor", list(value.shape), str(value.dtype), value.requires_grad]
    if isinstance(value, dict):
        return {str(k): _signature(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_signature(v) for v in value]
    return repr(value)


@dataclass(frozen=True)
class Stored:
    """A cache entry: the probe's findings (outputs as meta tensors), the captured graph and
    values derived from it (`split.CaptureOnce.remember`)."""

    probe: Capture
    traced: Traced
    memo: dict[Any, Any] = field(default_factory=dict)


class _Payload(TypedDict):
    """What an entry holds after its header (`store` writes it)."""

    nodes: list[NodeRecord]
    constants: dict[str, object]
    blocks: list[BlockInfo]
    node_blocks: dict[str, str | None]
    output_spec: pytree.TreeSpec | None
    class_name: str
    probe: Capture
    memo: dict[Hashable, object]


def lookup(folder: str | os.PathLike, model: nn.Module, args: tuple, kwargs: dict, *,
           settings: dict[str, object] | None = None) -> Stored | None:
    """The entry for `model(*args, **kwargs)` in `folder`, None when there is none usable:
    with it, compiling runs forward zero times."""
    key = capture_key(model, args, kwargs, settings)
    path = _path(folder, key)
    if not path.exists():
        return None
    try:
        header, payload = read_checked(path, MAGIC, "a pipetorch capture")
        if header.get("format") != FORMAT or header.get("key") != key:
            raise ValueError("it was written for another model, input or version")
        stored = _rebuild(unpickle(payload), model, args, kwargs)
    except Exception as error:  # any unreadable entry is captured again, never used
        logger.warning("Executable cache: %s is unusable (%s); capturing again", path, error)
        return None
    logger.info("Executable cache: loaded the captured forward from %s", path)
    return stored


def store(folder: str | os.PathLike, model: nn.Module, args: tuple, kwargs: dict,
          stored: Stored, *, settings: dict[str, object] | None = None) -> None:
    """Save `stored` for `model(*args, **kwargs)` in `folder` (a log line when it cannot be)."""
    key = capture_key(model, args, kwargs, settings)
    path, traced = _path(folder, key), stored.traced
    own = {id(t) for t in [*model.parameters(), *model.buffers()]}
    constants = {}
    for node in traced.module.graph.find_nodes(op="get_attr"):
        value = attribute(traced.module, str(node.target))
        if not (isinstance(value, torch.Tensor) and id(value) in own):
            constants[str(node.target)] = value  # made by forward, not one of the model's
    try:
        payload = pickle.dumps({"nodes": graph_nodes(traced.module.graph),
                                "constants": constants, "blocks": traced.blocks,
                                "node_blocks": {n.name: n.meta.get(BLOCK_KEY)
                                                for n in traced.module.graph.nodes},
                                "output_spec": traced.output_spec,
                                "class_name": type(traced.module).__name__,
                                "probe": dataclasses.replace(
                                    stored.probe, output=on_meta(stored.probe.output)),
                                "memo": stored.memo})
    except Exception as error:
        logger.warning("Executable cache: the capture of %s cannot be saved (%s)",
                       type(model).__name__, error)
        return
    write_checked(path, MAGIC, {"format": FORMAT, "key": key}, payload)
    logger.info("Executable cache: saved the captured forward to %s", path)


def _path(folder: str | os.PathLike, key: str) -> Path:
    return Path(folder) / f"capture-{key[:32]}.pt2cache"


def write_checked(path: Path, magic: bytes, header: dict[str, object], payload: bytes) -> None:
    """`magic`, the JSON `header` plus the payload's SHA-256, then `payload`, written whole
    (readers see the old file or the new one, never half of it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps({**header, "sha256": hashlib.sha256(payload).hexdigest()}).encode()
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=".pipetorch-")
    with os.fdopen(handle, "wb") as file:
        file.write(magic + line + b"\n" + payload)
    os.replace(temporary, path)


def read_checked(path: Path, magic: bytes, what: str) -> tuple[dict[str, Any], bytes]:
    """(header, payload) of a `write_checked` file; ValueError when the magic or the
    checksum is wrong. Nothing is unpickled here."""
    with open(path, "rb") as file:
        if file.read(len(magic)) != magic:
            raise ValueError(f"it is not {what}")
        header = json.loads(file.readline())
        payload = file.read()
    if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        raise ValueError("its contents do not match their checksum")
    return header, payload


def unpickle(payload: bytes) -> Any:
    with warnings.catch_warnings():  # pytree's own pickled specs warn on some versions
        warnings.simplefilter("ignore", FutureWarning)
        return pickle.loads(payload)


def _rebuild(payload: _Payload, model: nn.Module, args: tuple, kwargs: dict) -> Stored:
    graph = build_graph(payload["nodes"])
    attrs: dict[str, Any] = dict(payload["constants"])
    for node in graph.find_nodes(op="get_attr"):
        if node.target not in attrs:
            attrs[str(node.target)] = attribute(model, str(node.target))
    module = fx.GraphModule(attrs, graph, class_name=payload["class_name"])
    for node, record in zip(module.graph.nodes, payload["nodes"], strict=True):
        node.meta[BLOCK_KEY] = payload["node_blocks"][record[1]]
    extensions.register_dict_outputs(payload["probe"].output)  # forward did not run here
    return Stored(payload["probe"], Traced(module, payload["blocks"],
                                           input_layout(model, args, kwargs),
                                           output_spec=payload["output_spec"]),
                  payload["memo"])
