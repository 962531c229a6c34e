"""Graph platforms: real CUDA graphs, or a faithful CPU simulator for tests and CI.

A platform opens capture *scopes* (one per wrapper capture call: stream, gc) and
records *segments* inside them; a finished segment is a graph with ``replay()``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves


class Graph(Protocol):
    def replay(self) -> None: ...


class Recorder(Protocol):
    def end(self) -> Graph: ...

    def abort(self) -> None: ...


class Platform(Protocol):
    name: str

    def capture_scope(self): ...  # context manager around one whole capture

    def begin(self) -> Recorder: ...

    def memory(self) -> int: ...  # a monotone measure of what captures hold (bytes, or recorded ops)

    def describe(self, amount: int) -> str: ...  # ``amount`` of memory() in words


_gc_probe: list[Callable[[], bool]] = [lambda: False]


def set_gc_managed(probe: Callable[[], bool]) -> None:
    """Tell platforms who owns garbage collection: ``probe()`` is true while a caller (the capture
    layer's bulk capture) collected once and froze gc, so a platform must not collect per capture.
    Set by ``piecewise_backend.capture`` at import: the platform layer never imports the layers above it."""
    _gc_probe[0] = probe


def gc_managed() -> bool:
    return _gc_probe[0]()


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


