"""Capture sessions and break points.

A wrapper that captures opens a *session* on the current thread. A breakable session
records a list of segments: graph, eager break, graph, ... A *break point* (a splitting
piece from the backend, or a function decorated with :func:`eager_break`) ends the open
graph segment, runs eagerly, records itself for replay, and opens the next segment.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch.utils._pytree import tree_leaves, tree_structure, tree_unflatten

from ..inputs import VALUE_TYPES, same_value
from ..observability import counters
from ..platforms.base import Graph, Recorder, Recording, fresh_outputs, set_gc_managed
from .escapes import EscapeWatch

F = TypeVar("F", bound=Callable[..., Any])


class _State(threading.local):
    def __init__(self) -> None:
        self.session: CaptureSession | None = None
        self.in_break = 0


_state = _State()
_capture_lock = threading.Lock()  # one capture at a time per process (see run_session)


def capture_active() -> bool:
    """True while this thread is inside some wrapper's capture."""
    return _state.session is not None


def break_name(fn: Any) -> str:
    """A readable name for any callable a break point runs: its ``__qualname__``, else (a
    ``functools.partial``, a callable object) what it calls."""
    name = getattr(fn, "__qualname__", None)
    if isinstance(name, str):
        return name
    if isinstance(fn, functools.partial):
        return f"functools.partial({break_name(fn.func)})"
    return f"{type(fn).__qualname__}.__call__"


def _describe(t: Any) -> str:
    if isinstance(t, torch.Tensor):
        return f"a tensor of shape {tuple(t.shape)}, dtype {t.dtype}, on {t.device}"
    if t is None:
        return "None"
    text = repr(t)
    return f"{type(t).__name__} {text if len(text) <= 80 else text[:77] + '...'}"


class EagerSegment:
    """A break recorded during capture: re-run on replay, fresh results copied into place.

    Breaks run twice on the capturing step (once during the capture, on memory the
    unexecuted graph before them never wrote, then in the replay that follows), and on
    every replay with the arguments they got at capture: a break must be an idempotent
    write (as a KV-cache write is) whose Python arguments do not change between steps.

    What a break returns is checked, since later graph segments read the capture-time result:
    at capture, an opaque object and a ``capture_stub`` result that is its input (the segments
    would read the input, not the break's result) are refused; on replay, a result of another
    shape, dtype, device or structure than at capture raises instead of being broadcast or cast
    into the capture-time tensor. A Python value (a leaf of ``inputs.VALUE_TYPES``: a number, a
    bool, None, ...) is returned as it is to the segments after the break, which were recorded
    with it: each replay compares the break's new value with the capture-time one
    (``inputs.same_value``: NaN equals NaN) and raises naming the break when it differs.
    """

    __slots__ = ("fn", "args", "kwargs", "fresh", "single", "returned", "grad_enabled", "_plain", "name", "stub",
                 "num_leaves", "values")

    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple,
        kwargs: dict,
        out: Any,
        force_grad: bool | None = None,
        *,
        name: str = "",
        stub: Callable[..., Any] | None = None,
    ):
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.name = name or break_name(fn)
        self.stub = None if stub is None else break_name(stub)  # whose result the capture recorded
        self.single = isinstance(out, torch.Tensor)
        leaves = [out] if self.single else [] if out is None else tree_leaves(out)
        self.num_leaves = len(leaves)
        for i, t in enumerate(leaves):
            if not isinstance(t, (torch.Tensor, *VALUE_TYPES)):
                raise RuntimeError(
                    f"{self._who()} returned {_describe(t)} (output {i}) at capture: the graph segments after a "
                    "break read what it returned at capture, and an object cannot be compared or copied on "
                    "replay. A break may return tensors, Python values (numbers, bools, None, strings) or "
                    "containers of them"
                )
        # Python values the later segments were recorded with: every replay must give them again.
        self.values = [(i, v) for i, v in enumerate(leaves) if not isinstance(v, torch.Tensor) and v is not None]
        # A result in fresh memory must land where the later graph segments read it.
        self.fresh = fresh_outputs(args, kwargs, leaves)
        if stub is not None:
            fresh = {i for i, _ in self.fresh}
            for i, t in enumerate(leaves):
                if isinstance(t, torch.Tensor) and i not in fresh:
                    what = "its input tensor" if any(t is a for a in tree_leaves((args, kwargs))) else (
                        "a tensor sharing memory with one of its inputs")
                    raise RuntimeError(
                        f"capture_stub {self.stub!r} of the break {self.name!r} returned {what} (output {i}) at "
                        "capture: later graph segments would read that input in place of the break's result, "
                        "and the result of the real body would be lost on replay. A stub stands in for the "
                        "result: return a fresh tensor of the result's shape, dtype and device "
                        "(e.g. torch.empty_like(x)); it is overwritten with the body's result on every replay"
                    )
        # A result that *is* one of the inputs is read in place by later segments: it must stay that input.
        self.returned = []
        if any(isinstance(t, torch.Tensor) for t in leaves):
            inputs = {id(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            self.returned = [(i, t) for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and id(t) in inputs]
        # Dynamo puts grad-mode switches of a no_grad region into pieces a replay skips: a break whose
        # grad mode at capture was set by the model (see CaptureSession.run_break) gets it back on replay.
        self.grad_enabled = force_grad
        self._plain = not self.fresh and not self.returned and not self.values  # nothing to check after the call

    def replay(self) -> None:
        if self.grad_enabled is not None:
            torch._C._set_grad_enabled(self.grad_enabled)
        out = self.fn(*self.args, **self.kwargs)
        if self._plain:
            return
        if self.single:
            if self.returned:
                if out is not self.returned[0][1]:
                    self._lost(0)
            else:
                captured = self.fresh[0][1]
                if not (isinstance(out, torch.Tensor) and out.shape == captured.shape and out.dtype == captured.dtype
                        and out.device == captured.device):
                    self._mismatch(0, captured, out)
                captured.copy_(out)
            return
        leaves = tree_leaves(out)
        if len(leaves) != self.num_leaves:
            raise RuntimeError(
                f"{self._who(replay=True)} returned {len(leaves)} values on replay and {self.num_leaves} at "
                "capture: later graph segments read the capture-time results, so a break must return the "
                "same structure on every call (a capture_stub the structure of the body's result)"
            )
        for i, value in self.values:
            if not same_value(leaves[i], value):
                self._value_changed(i, value, leaves[i])
        for i, t in self.returned:
            if leaves[i] is not t:
                self._lost(i)
        for i, captured in self.fresh:
            t = leaves[i]
            if not (isinstance(t, torch.Tensor) and t.shape == captured.shape and t.dtype == captured.dtype
                    and t.device == captured.device):
                self._mismatch(i, captured, t)
            captured.copy_(t)

    def _who(self, replay: bool = False) -> str:
        if self.stub is not None and not replay:
            return f"capture_stub {self.stub!r} of the break {self.name!r}"
        return f"break {self.name!r}"

    def _mismatch(self, i: int, captured: torch.Tensor, t: Any) -> None:
        at_capture = f"its capture_stub {self.stub!r}" if self.stub is not None else "it"
        raise RuntimeError(
            f"break {self.name!r} returned {_describe(t)} (output {i}) on replay, where {at_capture} returned "
            f"{_describe(captured)} at capture: later graph segments read the capture-time tensor, and copying "
            "this result into it would broadcast or cast it silently. A break must return the same shape, dtype "
            "and device on every call" + (" (a capture_stub what the body returns)" if self.stub is not None else "")
        )

    def _value_changed(self, i: int, captured: Any, now: Any) -> None:
        at_capture = f"its capture_stub {self.stub!r}" if self.stub is not None else "it"
        raise RuntimeError(
            f"break {self.name!r} returned {_describe(now)} (output {i}) on replay, where {at_capture} returned "
            f"{_describe(captured)} at capture: the graph segments after the break were recorded with the "
            "capture-time value, so they would compute with it silently. A Python value a break returns must be "
            "the same on every call (at capture a break runs on memory the unexecuted segment before it never "
            "wrote, so a value computed from a tensor that segment made is garbage there); return a value that "
            "changes between steps as a tensor (x.sum(), not x.sum().item()), or capture again"
        )

    def _lost(self, i: int) -> None:
        raise RuntimeError(
            f"break {self.name!r} returned its input tensor (output {i}) at "
            "capture and another tensor now; later graph segments read the captured one, so the result "
            "would be lost: a break must return the same input object on every call, or always a fresh tensor"
        )


class CaptureSession:
    """One capture in progress on one thread.

    ``scope`` opens what the whole capture runs in (default: the platform's capture scope;
    :func:`~.graph.breakable_graph` adds its pool and stream); ``barrier`` runs before each
    break's eager call, at capture only (``breakable_graph(barrier_fn=)``). ``watch_escapes``: refuse
    a segment that reads a tensor a break made without returning it (:mod:`.escapes`; breakable only).
    """

    def __init__(
        self,
        platform: Recording,
        breakable: bool,
        *,
        scope: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
        barrier: Callable[[], Any] | None = None,
        watch_escapes: bool = False,
    ):
        self.platform, self.breakable = platform, breakable
        self.watch = EscapeWatch() if watch_escapes and breakable else None
        self.scope = scope if scope is not None else platform.capture_scope
        self.barrier = barrier
        self.segments: list[Graph | EagerSegment] = []
        self._recorder: Recorder | None = None
        self.start_grad = torch.is_grad_enabled()
        self.grad_touched = False  # a break changes grad mode on replay: later breaks may enter in another mode
        #: the break point an error escaped from while it ran inline (a FULL capture): for the error message
        self.failed_in: str | None = None

    def begin(self) -> None:
        self._recorder = self.platform.begin()

    def end_before(self, what: str) -> None:
        """End the open segment before ``what`` (a break, or the capture's end); a failure says where."""
        try:
            self.end()
        except Exception as e:
            e.add_note(f"(the graph segment failed to end before {what})")
            raise

    def end(self) -> None:
        recorder = self._recorder
        if recorder is not None:
            graph = recorder.end()  # on failure the recorder stays set, and abort() closes it
            self._recorder = None
            self.segments.append(graph)

    def abort(self) -> None:
        recorder, self._recorder = self._recorder, None
        if recorder is not None:
            recorder.abort()

    def split(self) -> None:
        """End the open segment and open the next one, with no eager work between them (the
        barrier runs between them: a forced break is a break, as the peers' ``force_no_graph``)."""
        self.end_before("force_break()")
        if self.barrier is not None:
            self.barrier()
        self.begin()

    def run_break(
        self, fn: Callable[..., Any], args: tuple, kwargs: dict, stub: Callable[..., Any] | None = None, name: str = ""
    ) -> Any:
        """End the segment, run ``stub`` (if given) or ``fn`` eagerly, record ``fn`` for replay, begin the next."""
        name = name or break_name(fn)
        self.end_before(f"the break {name!r}")
        if self.barrier is not None:
            self.barrier()
        before = torch.is_grad_enabled()
        watch = self.watch
        if watch is not None:
            watch.enter_break(name)
        _state.in_break += 1
        out = None
        try:
            out = (fn if stub is None else stub)(*args, **kwargs)
            out = _dense_results(out, args, kwargs)
        finally:
            _state.in_break -= 1
            if watch is not None:
                watch.leave_break(out)
        force = before if before != self.start_grad or self.grad_touched else None
        # a forced break changes the mode on replay too: later breaks and the entry's end must set theirs
        self.grad_touched |= force is not None or torch.is_grad_enabled() != before
        self.segments.append(EagerSegment(fn, args, kwargs, out, force, name=name, stub=stub))
        counters["breaks"] += 1
        self.begin()
        return out


def _dense_results(out: Any, args: tuple, kwargs: dict) -> Any:
    """``out`` with each result in fresh memory whose elements share memory (an ``.expand()``ed
    tensor) copied into a dense one: a replay copies the break's new result into the capture-time
    tensor, and torch refuses to write a tensor whose elements overlap. A result sharing an input's
    memory is read in place by later segments and stays as it is."""
    leaves = [out] if isinstance(out, torch.Tensor) else [] if out is None else tree_leaves(out)
    overlapping = [i for i, t in fresh_outputs(args, kwargs, leaves) if torch._debug_has_internal_overlap(t) == 1]
    if not overlapping:  # MemOverlap.Yes above; the common case returns at once
        return out
    if isinstance(out, torch.Tensor):
        return out.clone(memory_format=torch.contiguous_format)
    for i in overlapping:
        leaves[i] = leaves[i].clone(memory_format=torch.contiguous_format)
    return tree_unflatten(leaves, tree_structure(out))


@contextlib.contextmanager
def session_scope(session: CaptureSession) -> Iterator[CaptureSession]:
    """Capture what runs inside into ``session``; on any error nothing stays open or recorded.

    One capture runs at a time per process (CUDA's capture mode is global: another
    thread's allocation or sync invalidates a capture): a second thread's capture
    waits here until the first one ends. Captures do not nest on one thread.
    """
    if _state.session is not None:
        raise RuntimeError(
            "a capture is already active on this thread; captures do not nest (a breakable_graph or a "
            "wrapper's capture was opened inside another): end the first capture before starting the next"
        )
    with _capture_lock:
        _hide_from_dynamo()
        _state.session = session
        try:
            with session.scope(), (session.watch or contextlib.nullcontext()):
                session.begin()
                try:
                    yield session
                    session.end_before("the end of the capture")
                except BaseException:
                    session.abort()
                    raise
        finally:
            _state.session = None


def run_session(session: CaptureSession, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """Run ``fn`` under ``session`` (see :func:`session_scope`)."""
    with session_scope(session):
        out = fn(*args, **kwargs)
    return out


def call_break(
    fn: Callable[..., Any], args: tuple, kwargs: dict, capture_stub: Callable[..., Any] | None = None, name: str = ""
) -> Any:
    """Run ``fn`` as a break point: a break inside a breakable capture, plain call elsewhere.

    ``capture_stub`` replaces ``fn``'s body during a breakable capture only (replays run ``fn``).
    Inside a capture that does not break (FULL), an error escaping ``fn`` records ``name`` on the
    session: the wrapper's error then says the failing code is a break point the graph holds inline.
    """
    session = _state.session
    if session is None or _state.in_break:
        return fn(*args, **kwargs)
    if not session.breakable:
        try:
            return fn(*args, **kwargs)
        except BaseException:
            if session.failed_in is None:
                session.failed_in = name or break_name(fn)
            raise
    return session.run_break(fn, args, kwargs, capture_stub, name)


# What a torch.compile'd model reaches through an eager_break: Dynamo breaks its graph here and
# runs the capture machinery eagerly, instead of tracing the session, the simulator's pool and its
# checks (recompiling them on every session change, up to its limit, and building torch's
# StorageWeakRef objects without their __init__, whose __del__ then raised at exit).
# Built when a session opens with Dynamo loaded (only then can a compiled model be tracing): the
# package's import loads no compiler, and a compile-free capture never imports one.
_call_break_eagerly: Callable[..., Any] = call_break


def _hide_from_dynamo() -> None:
    global _call_break_eagerly
    if _call_break_eagerly is call_break and "torch._dynamo" in sys.modules:
        _call_break_eagerly = torch.compiler.disable(call_break, recursive=True)


def force_break() -> None:
    """A split with no eager work: inside a breakable capture the open segment ends, the capture's
    ``barrier_fn`` runs, and the next segment begins; no eager segment is recorded (the peers'
    ``force_no_graph`` records an empty one). Anywhere else (no capture, a FULL capture, inside a
    break) it does nothing. ``pb.force_no_graph`` is this function."""
    session = _state.session
    if session is not None and session.breakable and not _state.in_break:
        session.split()


def is_in_breakable_graph() -> bool:
    """True while this thread captures with breaks: a :func:`~.graph.breakable_graph`, or a breakable
    wrapper's capture (not FULL), break bodies included (the capture is still open around them).
    ``pb.is_in_piecewise_graph`` is this function."""
    session = _state.session
    return session is not None and session.breakable


class BreakPoint:
    """A splitting piece turned into a break point (see :func:`call_break`)."""

    def __init__(self, fn: Callable[..., Any], name: str = ""):
        self.fn, self.name = fn, name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _state.session is None:  # hot path: serving replays never get here, eager runs do
            return self.fn(*args, **kwargs)
        return call_break(self.fn, args, kwargs, name=self.name)

    def __repr__(self) -> str:
        return f"BreakPoint({self.name or self.fn!r})"


def eager_break(
    fn: F | None = None, *, capture_stub: Callable[..., Any] | None = None, enable: bool = True
) -> Any:
    """Make ``fn`` a break point: breakable captures run it eagerly between graph segments.

    ``@pb.eager_break`` or ``@pb.eager_break(capture_stub=stub, enable=True)``. The compile-free
    path: inside :func:`~.graph.breakable_graph`, or a model wrapped in a
    ``BreakableCUDAGraphWrapper``, no torch.compile is needed. ``capture_stub`` (same
    arguments, a compatible result) runs instead of ``fn`` during a capture only, in both;
    replays run ``fn``. ``enable=False`` returns ``fn`` unchanged.

    Rules for ``fn`` (see :class:`EagerSegment`): a wrapper's capturing step runs it twice,
    the first time on garbage, and replays run it with the Python arguments of its capture,
    so it must be an idempotent write (``out.copy_(...)``, a KV-cache write at given slots),
    not an accumulation; it may return a fresh tensor (copied into place on replay), and if
    it returns one of its inputs, it must return that same one each call.
    """
    if capture_stub is not None and not callable(capture_stub):
        raise TypeError(f"eager_break: capture_stub must be callable, got {type(capture_stub).__name__}")
    if not isinstance(enable, bool):
        raise TypeError(f"eager_break: enable must be a bool, got {enable!r}")

    def decorate(fn: F) -> F:
        if not callable(fn):
            raise TypeError(f"eager_break decorates a callable, got {type(fn).__name__}")
        if not enable:
            return fn
        name = break_name(fn)  # a functools.partial or a callable object has no __qualname__

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if _state.session is None:
                return fn(*args, **kwargs)
            return _call_break_eagerly(fn, args, kwargs, capture_stub, name)

        wrapper.__pb_break_point__ = fn  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return decorate if fn is None else decorate(fn)


# The same objects under the names of piecewise-cuda-graphs (Meta's package, formerly
# breakable-cuda-graphs) and of PyTorch's proposed torch.cuda API (PR #191641).
no_graph = eager_break
force_no_graph = force_break
is_in_piecewise_graph = is_in_breakable_graph


# Capture switch, the one owner of "may a wrapper capture now": after startup capture a
# serving engine turns capture off so an unseen descriptor fails loudly instead of
# capturing (slowly) mid-serving. A single step can refuse capture too, through the
# forward-context attribute ``allow_capture=False`` (what a closed GraphRunner sets).
_capture_enabled = True


class CaptureDisabledError(RuntimeError):
    pass


def set_capture_enabled(enabled: bool) -> None:
    """Process-wide: when off, a wrapper without an entry for the step raises :class:`CaptureDisabledError`."""
    global _capture_enabled
    if not isinstance(enabled, bool):
        raise TypeError(f"set_capture_enabled takes a bool, got {enabled!r}")
    _capture_enabled = enabled


def capture_enabled() -> bool:
    return _capture_enabled


def capture_allowed(ctx: Any) -> bool:
    """True when a wrapper may capture for the step of forward context ``ctx``."""
    return _capture_enabled and getattr(ctx, "allow_capture", True)


# gc during capture: collecting per capture dominated capture time (vLLM), so a bulk
# capture collects once and freezes; platforms ask platforms.may_collect_garbage() (this probe) first.
_bulk_depth = 0
_bulk_lock = threading.Lock()


def gc_managed() -> bool:
    """True inside :func:`bulk_capture`: a platform must not collect garbage per capture."""
    return _bulk_depth > 0


set_gc_managed(gc_managed)  # platforms ask it before collecting (they do not import this module)


@contextlib.contextmanager
def bulk_capture(*, collect: bool = True) -> Iterator[None]:
    """Context manager around many captures: collect garbage once, then keep gc frozen.

    ``with pb.capture.bulk_capture(): ...`` (``GraphRunner.capture`` uses it). Nested uses
    are no-ops. ``collect=False`` freezes without collecting first (a lazy capture between
    steps: a full collection costs 0.2-0.6 s once Dynamo's objects live, more than the captures of
    a step's slice; what is frozen is unfrozen, and collectable again, on exit). On exit gc is unfrozen only if the application had frozen nothing itself
    (``gc.get_freeze_count() == 0`` on entry): an application's own ``gc.freeze()`` stays,
    together with what the capture froze.
    """
    global _bulk_depth
    with _bulk_lock:
        _bulk_depth += 1
        outermost = _bulk_depth == 1
        app_frozen = gc.get_freeze_count() > 0
        if outermost:
            if collect:
                gc.collect()
            gc.freeze()
    try:
        yield
    finally:
        with _bulk_lock:
            _bulk_depth -= 1
            if outermost and not app_frozen:
                gc.unfreeze()
