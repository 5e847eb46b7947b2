"""User extension points: compile hooks, custom input types, and custom-op attribute look-up."""
from __future__ import annotations

import collections
import json
from typing import Any, Callable, Generic, Iterable, Iterator, Sequence, TypeAlias, TypeVar, Union

import torch
from torch.utils import _pytree as pytree
from torch.utils.hooks import RemovableHandle

__all__ = ["ICustomArgParser", "registerCustomArgParser", "registerPreCompileHook",
           "registerPostCompileHook", "accessAttributes", "ATTR_PREFIX"]

_pre_compile_hooks: collections.OrderedDict[int, Callable[[], object]] = collections.OrderedDict()
_post_compile_hooks: collections.OrderedDict[int, Callable[[], object]] = collections.OrderedDict()
_Custom = TypeVar("_Custom")


def _register(hooks: collections.OrderedDict, hook: Callable[[], object],
              kind: str) -> RemovableHandle:
    if not callable(hook):
        raise RuntimeError(f"{kind} hook must be callable; got {type(hook).__name__} ({hook!r})")
    handle = RemovableHandle(hooks)
    hooks[handle.id] = hook
    return handle


def registerPreCompileHook(hook: Callable[[], object]) -> RemovableHandle:
    """Call `hook()` before each model is compiled; `handle.remove()` unregisters it."""
    return _register(_pre_compile_hooks, hook, "Pre-compile")


def registerPostCompileHook(hook: Callable[[], object]) -> RemovableHandle:
    """Call `hook()` after each model is compiled; `handle.remove()` unregisters it."""
    return _register(_post_compile_hooks, hook, "Post-compile")


def run_pre_compile_hooks() -> None:
    for hook in list(_pre_compile_hooks.values()):
        hook()


def run_post_compile_hooks() -> None:
    for hook in list(_post_compile_hooks.values()):
        hook()


class ICustomArgParser(Generic[_Custom]):
    """How to find the tensors in an input of a custom type, and how to rebuild it.

    Subclass it and register an instance with `registerCustomArgParser(MyType, parser)`;
    objects of `MyType` may then be passed to a wrapped model and returned by a DataLoader.
    """

    def yieldTensors(self, struct: _Custom) -> Iterator[torch.Tensor]:
        """Yield every tensor held by `struct`, in a fixed order."""
        raise NotImplementedError

    def reconstruct(self, original_structure: _Custom,
                    tensor_iterator: Iterator[torch.Tensor]) -> _Custom:
        """A copy of `original_structure` holding the next tensors of `tensor_iterator`."""
        raise NotImplementedError


class _Original(Generic[_Custom]):
    """The object a custom input was flattened from; equal to any other of the same type,
    so two calls with fresh objects of one type share an input signature."""

    def __init__(self, value: _Custom) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Original) and type(other.value) is type(self.value)

    def __hash__(self) -> int:
        return hash(type(self.value))

    def __repr__(self) -> str:
        return f"<{type(self.value).__name__}>"


_parsers: dict[type, ICustomArgParser] = {}


def registerCustomArgParser(arg_type: type[_Custom], parser: ICustomArgParser[_Custom]) -> None:
    """Let inputs of `arg_type` be split into micro-batches and passed to the model."""
    if not isinstance(arg_type, type):
        raise TypeError(f"registerCustomArgParser: arg_type must be a class, got {arg_type!r}")
    if not isinstance(parser, ICustomArgParser):
        raise TypeError("registerCustomArgParser: parser must be an instance of a "
                        f"poptorch.ICustomArgParser subclass, got {type(parser).__name__}")
    if arg_type in _parsers:
        pytree._deregister_pytree_node(arg_type)
    _parsers[arg_type] = parser

    def flatten(obj: _Custom) -> tuple[list[torch.Tensor], _Original[_Custom]]:
        return list(parser.yieldTensors(obj)), _Original(obj)

    def unflatten(values: Iterable[torch.Tensor], context: _Original[_Custom]) -> _Custom:
        return parser.reconstruct(context.value, iter(values))

    name = f"{arg_type.__module__}.{arg_type.__qualname__}"
    pytree.register_pytree_node(arg_type, flatten, unflatten, serialized_type_name=name)


def register_dict_outputs(value: object) -> None:
    """Let torch's pytree see into the dict subclasses forward returns (`class
    Outputs(OrderedDict)`) that it does not know, rebuilding the same class in the same key
    order: PopTorch returns such a container holding each call's tensors (without this it
    is one opaque leaf, the first call's object)."""
    if isinstance(value, dict):
        if pytree._get_node_type(value) not in pytree.SUPPORTED_NODES:
            _register_dict_type(type(value))
        children: Iterable[object] = value.values()
    elif isinstance(value, (list, tuple)):
        children = value
    else:
        return
    for child in children:
        register_dict_outputs(child)


def _register_dict_type(cls: type[dict]) -> None:
    def flatten(d: dict) -> tuple[list[object], list[object]]:
        return list(d.values()), list(d.keys())

    def unflatten(values: Iterable[object], keys: list[object]) -> dict:
        return cls(zip(keys, values, strict=True))

    pytree.register_pytree_node(cls, flatten, unflatten,
                                serialized_type_name=f"{cls.__module__}.{cls.__qualname__}")


def parser_for(value_type: type) -> ICustomArgParser | None:
    """The parser registered for `value_type` (or a base class of it), if any."""
    return next((p for t, p in _parsers.items() if issubclass(value_type, t)), None)


# Custom-op attributes are passed to a backend as a string naming a registered dict.
ATTR_PREFIX = "attr:"
# An attribute's value, as PopTorch documents custom_op's: a number or a string, or a list (or
# tuple) of numbers or of strings.
AttributeValue: TypeAlias = Union[int, float, str, Sequence[int], Sequence[float], Sequence[str]]
_attributes: dict[int, dict[str, AttributeValue]] = {}


def register_attributes(attributes: dict[str, AttributeValue] | None) -> str:
    """The attribute string `accessAttributes` turns back into `attributes`."""
    _attributes[id(attributes)] = attributes if attributes is not None else {}
    return f"{ATTR_PREFIX}{id(attributes):x}"


def accessAttributes(attribute_id_str: str) -> dict[str, Any]:
    """The attributes dict named by `attribute_id_str` (an `attr:<hex id>` or a JSON object)."""
    if not isinstance(attribute_id_str, str):
        raise ValueError(f"Wrong type for attribute_id_str: expected str, got "
                         f"{type(attribute_id_str).__name__}")
    if attribute_id_str.startswith("{"):
        return json.loads(attribute_id_str)
    if not attribute_id_str.startswith(ATTR_PREFIX):
        raise ValueError(f"Invalid attribute_id_str {attribute_id_str!r}: expected "
                         f"'{ATTR_PREFIX}<hex id>' or a JSON object")
    key = int(attribute_id_str[len(ATTR_PREFIX):], 16)
    if key not in _attributes:
        raise ValueError(f"Invalid attribute_id_str {attribute_id_str!r}: no attributes "
                         "were registered under this id")
    return _attributes[key]
