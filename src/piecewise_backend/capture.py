"""Capture sessions and break points.

A wrapper that captures opens a *session* on the current thread. A breakable session
records a list of segments: graph, eager break, graph, ... A *break point* (a splitting
piece from the backend, or a function decorated with :func:`eager_break`) ends the open
graph segment, runs eagerly, records itself for replay, and opens the next segment.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.utils._pytree import tree_leaves

from .observability import counters
from .platforms import Graph, Platform, Recorder, fresh_outputs

F = TypeVar("F", bound=Callable[..., Any])


class _State(threading.local):
    def __init__(self) -> None:
        self.session: CaptureSession | None = None
        self.in_break = 0


_state = _State()


def capture_active() -> bool:
    """True while this thread is inside some wrapper's capture."""
    return _state.session is not None


class EagerSegment:
    """A break recorded during capture: re-run on replay, fresh results copied into place."""

    __slots__ = ("fn", "args", "kwargs", "fresh", "single")

    def __init__(self, fn: Callable[..., Any], args: tuple, kwargs: dict, out: Any):
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.single = isinstance(out, torch.Tensor)
        # A result in fresh memory must land where the later graph segments read it.
        self.fresh = fresh_outputs(args, kwargs, [out] if self.single else tree_leaves(out))

    def replay(self) -> None:
        out = self.fn(*self.args, **self.kwargs)
        if self.fresh:
            leaves = [out] if self.single else tree_leaves(out)
            for i, captured in self.fresh:
                captured.copy_(leaves[i])


class CaptureSession:
    """One capture in progress on one thread."""

    def __init__(self, platform: Platform, breakable: bool):
        self.platform, self.breakable = platform, breakable
        self.segments: list[Graph | EagerSegment] = []
        self._recorder: Recorder | None = None

    def begin(self) -> None:
        self._recorder = self.platform.begin()

    def end(self) -> None:
        recorder, self._recorder = self._recorder, None
        if recorder is not None:
            self.segments.append(recorder.end())

    def abort(self) -> None:
        recorder, self._recorder = self._recorder, None
        if recorder is not None:
            recorder.abort()

    def run_break(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        self.end()
        _state.in_break += 1
        try:
            out = fn(*args, **kwargs)
        finally:
            _state.in_break -= 1
        self.segments.append(EagerSegment(fn, args, kwargs, out))
        counters["breaks"] += 1
        self.begin()
        return out


def run_session(session: CaptureSession, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """Run ``fn`` under ``session``; on any error nothing stays open or recorded."""
    if _state.session is not None:
        raise RuntimeError("a capture is already active on this thread; captures do not nest")
    _state.session = session
    try:
        with session.platform.capture_scope():
            session.begin()
            try:
                out = fn(*args, **kwargs)
                session.end()
            except BaseException:
                session.abort()
                raise
    finally:
        _state.session = None
    return out


def call_break(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """Run ``fn`` as a break point: a break inside a breakable capture, plain call elsewhere."""
    session = _state.session
    if session is None or not session.breakable or _state.in_break:
        return fn(*args, **kwargs)
    return session.run_break(fn, args, kwargs)


class BreakPoint:
    """A splitting piece turned into a break point (see :func:`call_break`)."""

    def __init__(self, fn: Callable[..., Any], name: str = ""):
        self.fn, self.name = fn, name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _state.session is None:  # hot path: serving replays never get here, eager runs do
            return self.fn(*args, **kwargs)
        return call_break(self.fn, args, kwargs)

    def __repr__(self) -> str:
        return f"BreakPoint({self.name or self.fn!r})"


def eager_break(fn: F) -> F:
    """Make ``fn`` a break point: breakable captures run it eagerly between graph segments.

    The compile-free path: decorate a model's attention function, wrap the model in a
    ``BreakableCUDAGraphWrapper``, and no torch.compile is needed.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _state.session is None:
            return fn(*args, **kwargs)
        return call_break(fn, args, kwargs)

    wrapper.__pb_break_point__ = fn  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]


# Capture switch: after startup capture, a serving engine turns capture off so an
# unseen descriptor fails loudly instead of capturing (slowly) mid-serving.
_capture_enabled = True


class CaptureDisabledError(RuntimeError):
    pass


def set_capture_enabled(enabled: bool) -> None:
    global _capture_enabled
    _capture_enabled = bool(enabled)


def capture_enabled() -> bool:
    return _capture_enabled
