"""Graph platforms: real CUDA graphs, or a faithful CPU simulator for tests and CI.

A platform opens capture *scopes* (one per wrapper capture call: stream, gc) and
records *segments* inside them; a finished segment is a graph with ``replay()``.
"""

from __future__ import annotations

import contextlib
import functools
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
    owned = {p for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) for p in _storage_ptrs(t)}
    return [(i, t) for i, t in enumerate(outs) if isinstance(t, torch.Tensor) and owned.isdisjoint(_storage_ptrs(t))]


def _storage_ptrs(t: torch.Tensor) -> list[int]:
    # A wrapper subclass (DTensor, AsyncCollectiveTensor) has no storage of its own: use its inner tensors'.
    if is_traceable_wrapper_subclass(t):
        return [p for name in t.__tensor_flatten__()[0] for p in _storage_ptrs(getattr(t, name))]
    return [t.untyped_storage().data_ptr()]


def resolve_platform_name(name: str) -> str | None:
    """'auto' -> 'cuda' when a GPU is present, else None (no graphs on a real CPU run)."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else None
    return name


def get_platform(name: str) -> Platform:
    if name == "cuda":  # one per device: the current one
        if not torch.cuda.is_available():
            raise RuntimeError(
                "platform='cuda' was asked for but torch.cuda.is_available() is False; "
                "use platform='simulated' (with compile_pieces='eager') to run graph capture on the CPU"
            )
        from .cuda import platform_for

        return platform_for(torch.cuda.current_device())
    return _named_platform(name)


@functools.cache
def _named_platform(name: str) -> Platform:
    if name == "simulated":
        from .simulated import SimulatedPlatform

        return SimulatedPlatform()
    raise ValueError(f"unknown platform {name!r}; valid: 'cuda', 'simulated'")


def warmup_scope(platform: Platform | None) -> contextlib.AbstractContextManager[None]:
    """Where eager warm-ups for ``platform``'s captures run (CUDA: its capture stream)."""
    scope = getattr(platform, "warmup_scope", None)
    return contextlib.nullcontext() if scope is None else scope()


def warmed_step(platform: Platform | None) -> contextlib.AbstractContextManager[None]:
    """Around warm-ups and the capture they prepare: what they warmed up counts for that
    capture only, whether or not one happens (CUDA: skips the lazy warm-up; elsewhere a no-op)."""
    scope = getattr(platform, "warmed_step", None)
    return contextlib.nullcontext() if scope is None else scope()


def warm_up(platform: Platform, fn: Any, args: tuple, kwargs: dict, times: int) -> None:
    """Before a lazy capture, warm ``fn`` up ``times`` times where ``platform`` needs it (CUDA)."""
    hook = getattr(platform, "warm_up", None)
    if hook is not None:
        hook(fn, args, kwargs, times)
