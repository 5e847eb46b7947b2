"""`poptorch.profiling.Channel`: named tracepoints recorded as spans (PopTorch's PopVision API)."""
from __future__ import annotations

import collections
import functools
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, ParamSpec, TypeVar

__all__ = ["Channel", "Span", "recorded_spans", "clear_spans"]

_MAX_SPANS = 100_000  # a long run keeps its latest spans, not all of them

_T = TypeVar("_T")
_P = ParamSpec("_P")
_R = TypeVar("_R")


@dataclass(frozen=True)
class Span:
    """One tracepoint: its channel, name and start/end in time.perf_counter_ns()."""

    channel: str
    name: str
    start_ns: int
    end_ns: int


_spans: collections.deque[Span] = collections.deque(maxlen=_MAX_SPANS)


def recorded_spans(channel: str | None = None) -> list[Span]:
    """The spans recorded so far (of one channel, or all)."""
    return [s for s in _spans if channel is None or s.channel == channel]


def clear_spans() -> None:
    _spans.clear()


class Channel:
    """A named group of tracepoints: `with Channel("data").tracepoint("load"): ...`."""

    def __init__(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"Channel name must be a non-empty str, got {name!r}")
        self._name = name

    @property
    def name(self) -> str:
        return self._name

    @contextmanager
    def tracepoint(self, name: str) -> Iterator[None]:
        """Record the time spent inside the `with` block as a span named `name`."""
        start = time.perf_counter_ns()
        try:
            yield
        finally:
            _spans.append(Span(self._name, name, start, time.perf_counter_ns()))

    def instrument(self, obj: _T, *methods: str) -> _T:
        """Wrap `obj`'s `methods` so each call records a span named `<Class>.<method>`."""
        dunders = {}
        for method in methods:
            label = f"{type(obj).__name__}.{method}"
            if method.startswith("__"):  # looked up on the class: patch a subclass
                dunders[method] = self._traced(getattr(type(obj), method), label)
            else:
                setattr(obj, method, self._traced(getattr(obj, method), label))
        if dunders:
            try:
                obj.__class__ = type(type(obj).__name__, (type(obj),), dunders)
            except TypeError as exc:
                raise TypeError(f"Channel.instrument cannot trace {sorted(dunders)} of a "
                                f"{type(obj).__name__}: {exc}") from None
        return obj

    def _traced(self, original: Callable[_P, _R], label: str) -> Callable[_P, _R]:
        @functools.wraps(original)
        def traced(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            with self.tracepoint(label):
                return original(*args, **kwargs)

        return traced
