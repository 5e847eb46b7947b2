"""Host-call inputs: their signature, and their split into [D][G][R] micro-batches."""
from __future__ import annotations

import collections
import inspect
from dataclasses import dataclass
from typing import Any, Iterable, TypeVar

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from pipetorch.errors import ZeroSizedInputError
from pipetorch.partition.export import Tree
from pipetorch.schedule.plans import Batching

__all__: list[str] = []

T = TypeVar("T")


@dataclass(frozen=True)
class LeafSpec:
    """What a call's input leaf looks like: a tensor's shape and dtype, or a constant."""

    shape: tuple[int, ...] | None
    dtype: torch.dtype | None
    constant: object = None


@dataclass(frozen=True)
class InputName:
    """How the user refers to one input leaf and to the argument holding it: in prose
    (`label` "argument 1 (labels)[0]", `argument` "argument 1 (labels)") and in code
    (`expr` "labels[0]", `argument_expr` "labels")."""

    argument: str
    argument_expr: str
    inner: str = ""  # the leaf's place inside the argument: "", "[0]", "['x']"

    @property
    def label(self) -> str:
        return self.argument + self.inner

    @property
    def expr(self) -> str:
        return self.argument_expr + self.inner


def forward_parameters(model: nn.Module) -> tuple[str, ...]:
    """The names of `model.forward`'s positional parameters ((x, labels) for most models)."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):  # a builtin or C forward: names unknown
        return ()
    return tuple(p.name for p in params
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def keyed_leaves(tree: Tree) -> list[tuple[tuple, object]]:
    """`tree`'s leaves with their key paths; a node type registered without keys (an
    ICustomArgParser type) keys its leaves by their position in it."""
    try:
        return pytree.tree_flatten_with_path(tree)[0]
    except ValueError:
        pass
    children = (tree.items() if isinstance(tree, dict)
                else enumerate(tree) if isinstance(tree, (list, tuple)) else None)
    if children is None:  # a leaf, or the custom node itself
        leaves = pytree.tree_leaves(tree)
        if len(leaves) == 1 and leaves[0] is tree:
            return [((), tree)]
        return [((pytree.SequenceKey(i),), leaf) for i, leaf in enumerate(leaves)]
    key = pytree.MappingKey if isinstance(tree, dict) else pytree.SequenceKey
    return [((key(k), *path), leaf) for k, child in children for path, leaf in keyed_leaves(child)]


def input_names(args: tuple, kwargs: dict, params: tuple[str, ...] = ()) -> tuple[InputName, ...]:
    """The name of every leaf of a call's inputs, in pytree order."""
    names = []
    for path, _ in keyed_leaves((args, kwargs)):
        where, key, inner = path[0], path[1], pytree.keystr(path[2:])
        if getattr(where, "idx", 0) == 0:
            index = key.idx
            param = params[index] if index < len(params) else None
            names.append(InputName(f"argument {index}" + (f" ({param})" if param else ""),
                                   param or f"args[{index}]", inner))
        else:
            names.append(InputName(f"argument {key.key}", key.key, inner))
    return tuple(names)


def _layout(spec: pytree.TreeSpec) -> str:
    """A nesting in words: "a tensor or value", "a tuple of 2", "a dict with keys ['x']"."""
    if spec.is_leaf():
        return "a tensor or value"
    kind = getattr(spec.type, "__name__", str(spec.type))
    if spec.type is dict:
        return f"a dict with keys {list(spec.context)}"
    return f"a {kind} of {spec.num_children}"


@dataclass(frozen=True)
class Signature:
    """The structure, shapes and dtypes of one host call's arguments."""

    spec: pytree.TreeSpec
    leaves: tuple[LeafSpec, ...]
    params: tuple[str, ...] = ()  # forward's positional parameter names, for messages

    @staticmethod
    def of(args: tuple, kwargs: dict, params: tuple[str, ...] = ()) -> "Signature":
        flat, spec = pytree.tree_flatten((args, kwargs))
        return Signature(spec, tuple(
            LeafSpec(tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else LeafSpec(None, None, x)
            for x in flat), params)

    def _arguments(self) -> tuple[list[str], list[str]]:
        """The positional arguments' names and the keywords, as the call passed them."""
        positional, keywords = _children(self.spec)
        names = [self.params[i] if i < len(self.params) else f"args[{i}]"
                 for i in range(positional.num_children)]
        return names, list(keywords.context)

    def _structure_change(self, other: "Signature") -> str:
        (old_pos, old_kw), (new_pos, new_kw) = self._arguments(), other._arguments()
        moved = [n for n in new_kw if n in old_pos] + [n for n in old_kw if n in new_pos]
        if moved:
            return (f"{moved[0]} was passed {'by position' if moved[0] in old_pos else 'by keyword'}"
                    f" on the first call and {'by keyword' if moved[0] in new_kw else 'by position'}"
                    " now; pass it the same way on every call")
        missing = [n for n in old_pos + old_kw if n not in new_pos + new_kw]
        extra = [n for n in new_pos + new_kw if n not in old_pos + old_kw]
        calls = (f"the first call passed {_call_shape(old_pos, old_kw)} and this one passes "
                 f"{_call_shape(new_pos, new_kw)}")
        if missing or extra:
            told = [f"{', '.join(names)} {'is' if len(names) == 1 else 'are'} {what}"
                    for names, what in ((missing, "missing"), (extra, "new")) if names]
            detail = f"{calls}: {' and '.join(told)}"
            # PopTorch's own words first, as its tests match them.
            if len(old_pos) != len(new_pos):
                return (f"Number of positional arguments mismatch: expected {len(old_pos)} "
                        f"arguments but got {len(new_pos)}; {detail}")
            keys = [f"{what} arguments: {', '.join(sorted(names))}" for names, what in
                    ((set(new_kw) - set(old_kw), "Unexpected"), (set(old_kw) - set(new_kw),
                                                                 "Missing")) if names]
            return (f"Keys mismatch for named arguments: {'. '.join(keys)}. "
                    f"{detail[0].upper()}{detail[1:]}")
        for label, a, b in zip(old_pos + old_kw, _top_specs(self.spec), _top_specs(other.spec),
                               strict=True):
            if a != b:
                nesting = (f"argument {label} changed its nesting from {_layout(a)} on the first "
                           f"call to {_layout(b)}")
                if a.type is dict and b.type is dict and set(a.context) != set(b.context):
                    keys = [f"{what} arguments: {', '.join(sorted(map(str, names)))}"
                            for names, what in ((set(b.context) - set(a.context), "Unexpected"),
                                                (set(a.context) - set(b.context), "Missing"))
                            if names]  # PopTorch's words for a dict argument's keys
                    return f"Keys mismatch for {label}: {'. '.join(keys)}. ({nesting})"
                if a.type is b.type and a.type in (tuple, list) and \
                        a.num_children != b.num_children:
                    return (f"Length mismatch for {label}: expected {a.num_children} elements "
                            f"but got {b.num_children} ({nesting})")
                return nesting
        return "the inputs' nesting changed"

    def mismatch(self, other: "Signature") -> str | None:
        """A sentence naming the first difference from `other`, or None when they agree.

        It starts with PopTorch's words ("Shape mismatch for x: expected torch.Size([4]) but
        got torch.Size([2])", "Keys mismatch for named arguments: Missing arguments: m.",
        ...: its python/_args_parser.py's). The executor fills in forward's
        defaults first, so an argument left out to its default None is a type mismatch.
        """
        if self.spec != other.spec:
            return self._structure_change(other)
        names = input_names_for(self)
        for name, old, new in zip(names, self.leaves, other.leaves, strict=True):
            label = name.label
            if old.shape is None and new.shape is None:
                if not _same_constant(old.constant, new.constant):
                    return (f"Value mismatch for {name.expr}: expected {old.constant} but got "
                            f"{new.constant} ({label} changed value from {old.constant!r} to "
                            f"{new.constant!r})")
            elif old.shape is None or new.shape is None:
                was = "a tensor" if old.shape is not None else repr(old.constant)
                now = "a tensor" if new.shape is not None else repr(new.constant)
                how = (", passed as None or left out to forward's default"
                       if new.shape is None and new.constant is None else "")
                return (f"Type mismatch for {name.expr}: expected {_kind(old)} but got "
                        f"{_kind(new)} ({label} changed from {was} to {now}{how})")
            elif old.shape != new.shape:
                return (f"Shape mismatch for {name.expr}: expected {torch.Size(old.shape)} but "
                        f"got {torch.Size(new.shape)} ({label} changed shape from "
                        f"{list(old.shape)} to {list(new.shape)})")
            elif old.dtype != new.dtype:
                assert old.dtype is not None  # a tensor's
                return (f"Data type mismatch for {name.expr}: expected {old.dtype} but got "
                        f"{new.dtype} ({label} changed dtype from {old.dtype} to {new.dtype}); "
                        f"convert it back with {name.expr}{conversion(old.dtype)}")
        return None


def _kind(leaf: LeafSpec) -> str:
    """PopTorch's name for what an input was: "Tensor", "None", "int", ..."""
    if leaf.shape is not None:
        return "Tensor"
    return "None" if leaf.constant is None else type(leaf.constant).__name__


def ordered_like(spec: pytree.TreeSpec, value: Tree) -> Any:
    """`value` with each plain dict holding the keys of `spec`'s dict at that place in
    `spec`'s key order: PopTorch matches dict inputs (and keywords) by key, not by order."""
    if spec.is_leaf():
        return value
    children = _children(spec)
    if spec.type is dict and type(value) is dict and set(value) == set(spec.context):
        return {key: ordered_like(child, value[key])
                for key, child in zip(spec.context, children, strict=True)}
    if (spec.type in (tuple, list) and isinstance(value, (tuple, list))
            and type(value) is spec.type and len(value) == len(children)):
        return type(value)(ordered_like(c, v) for c, v in zip(children, value, strict=True))
    return value


def _top_specs(spec: pytree.TreeSpec) -> list[pytree.TreeSpec]:
    """The spec of each positional argument, then of each keyword argument."""
    positional, keywords = _children(spec)
    return [*_children(positional), *_children(keywords)]


def _children(spec: pytree.TreeSpec) -> list[pytree.TreeSpec]:
    """`spec`'s child specs (`children()` on newer torch, `children_specs` before)."""
    children = getattr(spec, "children", None)
    return list(children()) if callable(children) else list(spec.children_specs)


def _call_shape(positional: list[str], keywords: list[str]) -> str:
    """How a call passed its arguments: "(x, labels=...)"."""
    return f"({', '.join(positional + [f'{k}=...' for k in keywords])})"


def input_names_for(signature: Signature) -> tuple[InputName, ...]:
    """The names of `signature`'s leaves (rebuilt from placeholders of its structure)."""
    try:
        args, kwargs = pytree.tree_unflatten([0] * len(signature.leaves), signature.spec)
        return input_names(args, kwargs, signature.params)
    except Exception:  # a custom input type that cannot hold placeholders: number the leaves
        return tuple(InputName(f"input {i}", f"inputs[{i}]") for i in range(len(signature.leaves)))


_CONVERSIONS = {torch.float32: ".float()", torch.float16: ".half()", torch.float64: ".double()",
                torch.bfloat16: ".bfloat16()", torch.int64: ".long()", torch.int32: ".int()",
                torch.bool: ".bool()", torch.uint8: ".byte()"}


def conversion(dtype: torch.dtype) -> str:
    """The tensor method converting to `dtype`: ".float()", or ".to(torch.int16)"."""
    return _CONVERSIONS.get(dtype, f".to({dtype})")


def _same_constant(a: object, b: object) -> bool:
    try:
        return bool(a == b)
    except Exception:  # objects whose == is not a bool (arrays): compare identity
        return a is b


def _factors(batching: Batching) -> str:
    return (f"deviceIterations ({batching.device_iterations}) x gradientAccumulation "
            f"({batching.gradient_accumulation}) x replicationFactor "
            f"({batching.replication_factor}) = {batching.micro_batches}")


def check_batch(args: tuple, kwargs: dict, batching: Batching, *,
                names: tuple[InputName, ...] | None = None) -> None:
    """Refuse, naming the input, a call whose tensors cannot be cut into D*G*R micro-batches:
    no tensor at all (unless D*G*R is 1: the model then runs once), an empty one, dim 0 not a multiple of D*G*R, or a 0-dim tensor where
    D*G*R > 1 (as in PopTorch, a 0-dim tensor is a batch of one: a call of one micro-batch
    passes it whole)."""
    count = batching.micro_batches
    flat = pytree.tree_leaves((args, kwargs))
    if names is None:
        names = tuple(InputName(f"Input {i}", f"inputs[{i}]") for i in range(len(flat)))
    if not any(isinstance(x, torch.Tensor) for x in flat):
        data = next((n for n, x in zip(names, flat, strict=True) if _is_number(x) and n.inner),
                    None)
        if data is not None:
            raise TypeError(
                f"The model was called without any tensor: {data.argument} holds Python "
                f"numbers (a list or tuple), not a tensor. Pass torch.tensor({data.argument_expr}) "
                "(or torch.stack of a list of tensors): dim 0 holds the samples of the host call")
        if count == 1:
            return  # PopTorch runs a model of no tensor inputs (buffers, constants) once a call
        raise ValueError(
            "The model was called without any tensor input, but this call takes "
            f"{_factors(batching)} "
            "micro-batches, cut from the inputs' dim 0: pass at least one tensor input, or set "
            "all three to 1 (a model of no inputs then runs once per call)")
    for name, x in zip(names, flat, strict=True):
        if not isinstance(x, torch.Tensor):
            continue
        if x.dim() == 0 and count == 1:
            continue
        if x.dim() == 0:
            raise ValueError(
                f"{name.label} is a 0-dim tensor ({x.item()!r}), but every tensor input needs "
                f"dim 0 = {count}*B samples ({_factors(batching)}). "
                f"Give it a batch dimension, e.g. {name.expr}.expand({count})")
        if x.shape[0] == 0:  # PopTorch's words first (a zero-sized other dimension runs)
            raise ZeroSizedInputError(
                f"Zero-sized tensors are unsupported (Got shape {list(x.shape)}): "
                f"{name.label} is empty: each host call takes {count} "
                f"micro-batches of B >= 1 samples ({_factors(batching)}), "
                f"so dim 0 must be {count}*B. An empty batch usually comes from slicing past the "
                "end of the data or from an empty dataset")
        if x.shape[0] % count:
            raise ValueError(
                f"{name.label} has shape {list(x.shape)}, but dim 0 must be a multiple of "
                f"{_factors(batching)}: "
                f"each host call takes {count} micro-batches of size B, i.e. dim 0 = {count}*B. "
                "Use a poptorch.DataLoader to build batches of the right size")


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def split_micro_batches(args: tuple, kwargs: dict, batching: Batching) -> list[tuple[tuple, dict]]:
    """Cut every tensor input along dim 0 into D*G*R micro-batches, in [D][G][R] order."""
    check_batch(args, kwargs, batching)
    count = batching.micro_batches
    flat, spec = pytree.tree_flatten((args, kwargs))
    pieces = {i: x.split(x.shape[0] // count) for i, x in enumerate(flat)
              if isinstance(x, torch.Tensor) and x.dim() > 0}  # 0-dim: only when count is 1
    result = []
    for m in range(count):
        leaves = [pieces[i][m] if i in pieces else x for i, x in enumerate(flat)]
        result.append(pytree.tree_unflatten(leaves, spec))
    return result


def plain_containers(tree: Tree) -> Any:
    """`tree` with dict subclasses that torch's pytree does not know (a user's
    `class Batch(OrderedDict)`) turned into OrderedDict or dict, as PopTorch hands forward
    its inputs' dicts rebuilt; lists, tuples and registered types are walked, not changed."""
    if isinstance(tree, dict):
        items = {k: plain_containers(v) for k, v in tree.items()}
        if type(tree) in pytree.SUPPORTED_NODES:
            if all(items[k] is v for k, v in tree.items()):
                return tree
            rebuilt = tree.copy()
            rebuilt.update(items)
            return rebuilt
        return collections.OrderedDict(items) if isinstance(tree, collections.OrderedDict) else items
    if type(tree) is list or type(tree) is tuple:
        children = [plain_containers(v) for v in tree]
        return tree if all(a is b for a, b in zip(children, tree, strict=True)) else type(tree)(children)
    return tree


def to_device(tree: T, device: torch.device) -> T:
    """Move every tensor of a nested structure to `device` (no copy if already there)."""
    return pytree.tree_map(
        lambda x: x.to(device, non_blocking=True) if isinstance(x, torch.Tensor) else x, tree)


def half_dtype(parameters: Iterable[torch.Tensor]) -> torch.dtype | None:
    """float16 (or bfloat16) when every floating-point parameter has that dtype."""
    dtypes = {p.dtype for p in parameters if p.is_floating_point()}
    return dtypes.pop() if len(dtypes) == 1 and dtypes <= {torch.float16, torch.bfloat16} else None


def cast_float_inputs(args: tuple, kwargs: dict, dtype: torch.dtype | None) -> tuple[tuple, dict]:
    """PopTorch's input casting: float32 input tensors of a half model become `dtype`."""
    if dtype is None:
        return args, kwargs
    return pytree.tree_map_only(
        torch.Tensor, lambda x: x.to(dtype) if x.dtype == torch.float32 else x, (args, kwargs))
