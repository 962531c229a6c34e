"""Compile-free breakable capture: ``torch.cuda.graph``'s shape, with breaks (design.md 4.10).

``with pb.breakable_graph(g): workload()`` captures what runs inside into ``g`` as graph
segments; every break point called inside (an ``eager_break`` function, a splitting piece of
the backend, ``force_break()``) ends the open segment, runs eagerly, is recorded, and opens the
next one. ``g.replay()`` walks the segments, running the breaks again on live data. No
torch.compile, no forward context. It is a capture session like a wrapper's
(:func:`~.session.session_scope`), so everything a wrapper's capture guarantees holds here too:
one capture at a time per process, nothing left open after a failure, fresh break results
copied into place on replay, capture-time memory held only weakly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..config import PLATFORMS
from ..observability import counters, logger
from ..platforms.base import Graph, Platform
from ..platforms.registry import get_platform, resolve_platform_name
from .memory import release_segments
from .session import CaptureSession, EagerSegment, capture_active, session_scope

CAPTURE_ERROR_MODES = ("global", "thread_local", "relaxed")


class GraphPool:
    """The graph memory pool of one or more :class:`BreakableGraph` (``g.pool()``).

    Pass it to another graph, ``BreakableGraph(pool=g.pool())``, to share the memory: graphs of
    one pool must then replay in the order they were captured, never concurrently, and an
    output of one is valid only until the next replay of any of them (as with torch's pools).
    """

    __slots__ = ("platform", "handle", "__weakref__")

    def __init__(self, platform: Platform, handle: Any):
        self.platform, self.handle = platform, handle

    def memory_bytes(self) -> int:
        """Bytes the pool holds now (on CUDA a device sync: call it outside captures)."""
        return self.platform.pool_memory(self.handle)

    def __repr__(self) -> str:
        return f"GraphPool({self.platform.name}, {self.handle!r})"


class BreakableGraph:
    """Graph segments and eager breaks captured by :func:`breakable_graph`; ``replay()`` runs them in order.

    ``pool=None``: a pool of its own; ``pool=other.pool()`` shares ``other``'s. ``platform``:
    ``"auto"`` (CUDA when available, else the simulator), ``"cuda"`` or ``"simulated"``.
    After a capture, ``memory_bytes`` is what the capture added to the pool, ``segments`` the
    list replayed. ``pb.BreakableCUDAGraph`` is this class.
    """

    def __init__(self, pool: GraphPool | None = None, *, platform: str = "auto"):
        if platform not in PLATFORMS:
            raise ValueError(f"BreakableGraph platform must be one of {PLATFORMS}, got {platform!r}")
        name: str = resolve_platform_name(platform, simulate=True)  # type: ignore[assignment]  # never None here
        if pool is not None:
            if not isinstance(pool, GraphPool):
                raise TypeError(
                    f"BreakableGraph pool must be another graph's pool() (a GraphPool) or None for a pool of its "
                    f"own, got {type(pool).__name__}"
                )
            if pool.platform.name != name:
                raise ValueError(
                    f"BreakableGraph(platform={platform!r}) resolves to {name!r}, but the pool given belongs to the "
                    f"{pool.platform.name!r} platform: share pools between graphs of one platform"
                )
        self._platform_name = name
        self._pool = pool
        self.segments: list[Graph | EagerSegment] = []
        self._state = "empty"  # "empty" -> "captured" -> "reset" (-> "captured" again)
        self._grad_touched = False
        self._inference = False
        self.memory_bytes = 0

    @property
    def platform(self) -> Platform:
        return get_platform(self._platform_name)

    def pool(self) -> GraphPool:
        """This graph's pool (made on first use); pass it to another ``BreakableGraph`` to share it."""
        if self._pool is None:
            platform = self.platform
            self._pool = GraphPool(platform, platform.new_pool())
        return self._pool

    @property
    def num_graphs(self) -> int:
        return sum(not isinstance(s, EagerSegment) for s in self.segments)

    @property
    def num_breaks(self) -> int:
        return sum(isinstance(s, EagerSegment) for s in self.segments)

    def replay(self) -> None:
        """Run every segment in capture order: graphs replay, breaks run eagerly on live data."""
        if self._state != "captured":
            raise RuntimeError(
                "BreakableGraph.replay() after reset(): its segments were dropped; capture it again with "
                "pb.breakable_graph(g)" if self._state == "reset" else
                "BreakableGraph.replay() before any capture: capture it first with `with pb.breakable_graph(g): ...`"
            )
        if capture_active():
            raise RuntimeError(
                "BreakableGraph.replay() inside a capture: a replay would run its breaks inside the open graph "
                "segment; replay after the capture ends"
            )
        grad = torch.is_grad_enabled()
        try:
            with torch.inference_mode() if self._inference and not torch.is_inference_mode_enabled() else contextlib.nullcontext():
                for seg in self.segments:
                    seg.replay()
        finally:
            if self._grad_touched and torch.is_grad_enabled() is not grad:
                torch._C._set_grad_enabled(grad)
        counters["replays"] += 1

    def adopt(self, segments: list[Graph | EagerSegment], *, grad_touched: bool, memory_bytes: int) -> None:
        """Hold what a capture into this graph made (``breakable_graph`` calls it when its body returns):
        ``segments`` to replay, whether they touch grad mode, the pool bytes they added. The capture's
        inference mode is the replay's."""
        self.segments = segments
        self._grad_touched = grad_touched
        self._inference = torch.is_inference_mode_enabled()
        self._state = "captured"
        self.memory_bytes = memory_bytes

    def reset(self) -> None:
        """Drop the captured segments (their pool memory goes back to the pool); the graph can capture again."""
        self.segments = []
        self.memory_bytes = 0
        if self._state == "captured":
            self._state = "reset"

    def __repr__(self) -> str:
        return (
            f"BreakableGraph({self._platform_name}, {self._state}, graphs={self.num_graphs}, "
            f"breaks={self.num_breaks}, memory_bytes={self.memory_bytes})"
        )


BreakableCUDAGraph = BreakableGraph  # breakable-cuda-graphs' first name for it
CUDAGraphSequence = BreakableGraph  # the name of piecewise-cuda-graphs and PyTorch's proposed torch.cuda API


def _the_graph(g: Any, cuda_graph: Any, cuda_graph_sequence: Any) -> Any:
    named = (("g", g), ("cuda_graph", cuda_graph), ("cuda_graph_sequence", cuda_graph_sequence))
    given = [(name, v) for name, v in named if v is not None]
    if not given:
        raise TypeError(
            "breakable_graph needs the pb.BreakableGraph to capture into: pass it first, or as cuda_graph= "
            "(or cuda_graph_sequence=)"
        )
    if len(given) > 1:
        raise TypeError(
            f"breakable_graph got the graph to capture into twice ({' and '.join(n for n, _ in given)}): pass it once"
        )
    return given[0][1]


def _check_capture_args(g: Any, stream: Any, capture_error_mode: Any, barrier_fn: Any) -> None:
    if not isinstance(g, BreakableGraph):
        raise TypeError(f"breakable_graph captures into a pb.BreakableGraph, got {type(g).__name__}")
    if g.segments:
        raise RuntimeError(
            f"breakable_graph: {g!r} already holds a capture; call g.reset() first, or capture into a new BreakableGraph"
        )
    if capture_error_mode not in CAPTURE_ERROR_MODES:
        raise ValueError(f"breakable_graph capture_error_mode must be one of {CAPTURE_ERROR_MODES}, got {capture_error_mode!r}")
    if barrier_fn is not None and not callable(barrier_fn):
        raise TypeError(f"breakable_graph barrier_fn must be a callable of no arguments or None, got {type(barrier_fn).__name__}")


@contextlib.contextmanager
def breakable_graph(
    g: BreakableGraph | None = None,
    stream: Any = None,
    capture_error_mode: str = "global",
    barrier_fn: Callable[[], Any] | None = None,
    *,
    cuda_graph: BreakableGraph | None = None,
    cuda_graph_sequence: BreakableGraph | None = None,
) -> Iterator[BreakableGraph]:
    """Capture the body into ``g`` like ``torch.cuda.graph``, splitting it at every break point.

    ``g`` (or, by the peers' keywords, ``cuda_graph=`` / ``cuda_graph_sequence=``): the
    :class:`BreakableGraph` to capture into. ``stream``: the CUDA stream to capture on (None:
    the pool's own capture stream; warm up on the stream you capture on).
    ``capture_error_mode``: CUDA's (``"global"``, ``"thread_local"``, ``"relaxed"``).
    ``barrier_fn()`` runs before each break at capture only (to re-align ranks),
    ``force_break()`` included. The arguments may be passed positionally in this order, as
    breakable-cuda-graphs' ``breakable_graph(cuda_graph, stream, capture_error_mode,
    barrier_fn)`` takes them. As with ``torch.cuda.graph`` the body is captured, not
    executed: replay to compute. On any error nothing stays open, ``g`` stays empty, and the
    next capture works. ``pb.piecewise_graph`` is this function.
    """
    g = _the_graph(g, cuda_graph, cuda_graph_sequence)
    _check_capture_args(g, stream, capture_error_mode, barrier_fn)
    platform = g.platform
    pool = g.pool()
    before = pool.memory_bytes()
    session = CaptureSession(
        platform,
        breakable=True,
        scope=lambda: platform.capturing_into(pool.handle, stream, capture_error_mode),
        barrier=barrier_fn,
        watch_escapes=platform.name == "simulated",
    )
    with session_scope(session):
        yield g
    release_segments(platform, session.segments, pool.handle)
    g.adopt(session.segments, grad_touched=session.grad_touched, memory_bytes=max(0, pool.memory_bytes() - before))
    counters["captures"] += 1
    logger.debug("breakable_graph captured %d segments (%d breaks), %d bytes", len(g.segments), g.num_breaks, g.memory_bytes)


piecewise_graph = breakable_graph  # the name of piecewise-cuda-graphs and PyTorch's proposed torch.cuda API
