"""Graph platforms: real CUDA graphs, or a faithful CPU simulator for tests and CI.

A platform opens capture *scopes* (one per wrapper capture call: stream, gc) and
records *segments* inside them; a finished segment is a graph with ``replay()``.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves


class Graph(Protocol):
    def replay(self) -> None: ...


class Recorder(Protocol):
    def end(self) -> Graph: ...

    def abort(self) -> None: ...


class Recording(Protocol):
    """What a capture session needs of a platform: a scope around one whole capture, and a recorder per
    graph segment (a test or a benchmark can stand in with these three alone)."""

    name: str

    def capture_scope(self) -> AbstractContextManager[None]: ...  # around one whole capture

    def begin(self) -> Recorder: ...  # start recording one segment


@runtime_checkable
class Platform(Recording, Protocol):
    """Everything the layers above use of a graph platform (``cuda`` or ``simulated``), called directly:
    none of them probes a platform with ``getattr``. ``tests/platforms`` checks both platforms against it.

    Pools: every capture of the process shares the platform's pool; :meth:`new_pool` makes a private one
    (a ``BreakableGraph`` of its own) that :meth:`capturing_into` captures into. What a platform holds
    beyond this (the CUDA platform's generations and streams, the simulator's knobs) is its own.
    """

    def memory(self) -> int:
        """A monotone measure of what captures hold: bytes of the platform's graph pools."""
        ...

    def describe(self, amount: int) -> str:
        """``amount`` of :meth:`memory` in words (the capture report's)."""
        ...

    def new_pool(self) -> Any:
        """A private graph pool, for :meth:`capturing_into` (``BreakableGraph.pool()``)."""
        ...

    def capturing_into(
        self, pool: Any, stream: Any = None, capture_error_mode: str = "global"
    ) -> AbstractContextManager[None]:
        """Around one capture into the private ``pool`` (instead of :meth:`Recording.capture_scope`)."""
        ...

    def pool_memory(self, pool: Any) -> int:
        """Bytes the private ``pool`` holds."""
        ...

    def fresh_pool(self) -> AbstractContextManager[Any]:
        """Captures go to a new shared pool meanwhile (the memory estimate's scratch pool); yields it."""
        ...

    def release_cached(self) -> int:
        """Give back the pool memory no graph uses any more; returns the bytes released."""
        ...

    def owner_test(self, pool: Any = None) -> Callable[[torch.Tensor], bool]:
        """A test "was this tensor allocated in the graph pool?" (``pool``: a private one), for one capture."""
        ...

    def weak_ref(self, t: torch.Tensor, pool: Any = None) -> torch.Tensor:
        """A view of the pool tensor ``t`` that keeps none of its memory alive."""
        ...

    def warmup_scope(self) -> AbstractContextManager[None]:
        """Where eager warm-ups for this platform's captures run (CUDA: the capture stream)."""
        ...

    def warmed_step(self) -> AbstractContextManager[None]:
        """Around the warm-ups of one capture and that capture: what they warmed counts for it only."""
        ...

    def warm_up(self, fn: Callable[..., Any], args: tuple, kwargs: dict, times: int) -> None:
        """Before a capture no caller warmed up: run ``fn`` ``times`` times eagerly where this platform needs it."""
        ...


_gc_probe: list[Callable[[], bool]] = [lambda: False]


def set_gc_managed(probe: Callable[[], bool]) -> None:
    """Tell platforms who owns garbage collection: ``probe()`` is true while a caller (the capture
    layer's bulk capture) collected once and froze gc, so a platform must not collect per capture.
    Set by ``piecewise_backend.capture`` at import: the platform layer never imports the layers above it."""
    _gc_probe[0] = probe


def may_collect_garbage() -> bool:
    """Whether a platform may collect garbage around a capture: no caller (a bulk capture) collected
    once and froze gc, as the probe :func:`set_gc_managed` installed says."""
    return not _gc_probe[0]()


def fresh_outputs(args: tuple, kwargs: dict, outs: list[Any]) -> list[tuple[int, torch.Tensor]]:
    """(position, tensor) of each output in memory none of the inputs own: a result a replay
    must copy into place, since later work reads the capture-time tensor."""
    if not any(isinstance(t, torch.Tensor) for t in outs):
        return []  # the common case of a break that writes in place: no input walk
    owned = {p for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) for p in _storage_ptrs(t)}
    return [(i, t) for i, t in enumerate(outs) if isinstance(t, torch.Tensor) and owned.isdisjoint(_storage_ptrs(t))]


def _storage_ptrs(t: torch.Tensor) -> list[int]:
    # A wrapper subclass (DTensor, AsyncCollectiveTensor) has no storage of its own: use its inner tensors'.
    if is_traceable_wrapper_subclass(t):
        return [p for name in t.__tensor_flatten__()[0] for p in _storage_ptrs(getattr(t, name))]
    return [t.untyped_storage().data_ptr()]


