"""Graph memory: entries that pin nothing, stale-output poisoning, clearing, the capture estimate.

Every graph of a process shares one pool and graphs never replay concurrently, so memory a
capture allocated may be reused by the next capture once nothing owns it. After a capture an
entry therefore keeps the tensors that capture created (its output, break arguments and
fresh break results, inputs that an earlier graph produced) only as weak views; what existed
before the capture (inputs, parameters, KV caches) stays strongly held. Captured largest
first, the whole ladder then costs about what its largest size costs.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_leaves, tree_map, tree_unflatten

from ..weak import is_weak, keep_strong

if TYPE_CHECKING:
    from ..platforms.base import Platform

# Wrappers holding entries; debug poisoning and the estimate walk them (weak: no leak).
_wrappers: weakref.WeakSet[Any] = weakref.WeakSet()
_graphs_created = [0]  # graph segments of every entry captured so far (CaptureReport reads it)


def captured_wrappers() -> list[Any]:
    """Every live wrapper that has captured (per-piece wrappers inside a backend included)."""
    return list(_wrappers)


def graphs_created() -> int:
    """Graph segments (one CUDA graph each) created by captures in this process."""
    return _graphs_created[0]


def owner_test(platform: Platform) -> Callable[[torch.Tensor], bool]:
    """A test "was this tensor allocated in ``platform``'s graph pool?" (a capture-time tensor):
    :meth:`Platform.owner_test <piecewise_backend.platforms.base.Platform.owner_test>`, built once per capture."""
    return platform.owner_test()


def _weakener(platform: Platform, pool: Any = None) -> Callable[[Any], Any]:
    """One weak view per capture-time tensor (pool memory), the same view for every reference to it,
    so identities a replay checks (a break returning its input) still hold. ``pool``: a private
    pool the capture used (``BreakableGraph.pool()``); None: the platform's own."""
    owns = platform.owner_test(pool)
    made: dict[int, tuple[Any, Any]] = {}

    def weaken(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if id(x) not in made:
            made[id(x)] = (x, platform.weak_ref(x, pool) if not is_weak(x) and owns(x) else x)
        return made[id(x)][1]

    return weaken


def weaken_segments(segments: list[Any], weaken: Callable[[Any], Any]) -> None:
    """Hold the capture-time tensors of the eager breaks among ``segments`` through ``weaken``."""
    from .session import EagerSegment

    for seg in segments:
        if isinstance(seg, EagerSegment):
            seg.args, seg.kwargs = tree_map(weaken, seg.args), tree_map(weaken, seg.kwargs)
            seg.fresh = [(i, weaken(t)) for i, t in seg.fresh]
            seg.returned = [(i, weaken(t)) for i, t in seg.returned]


def release_segments(platform: Platform, segments: list[Any], pool: Any = None) -> None:
    """After a compile-free capture (:func:`~.graph.breakable_graph`): its breaks hold pool memory weakly."""
    _graphs_created[0] += sum(not _is_break(s) for s in segments)
    if not keep_strong():
        weaken_segments(segments, _weakener(platform, pool))


def _is_break(segment: Any) -> bool:
    from .session import EagerSegment

    return isinstance(segment, EagerSegment)


def release_capture_memory(wrapper: Any, entry: Any) -> None:
    """After ``entry`` was captured: hold its capture-time tensors weakly (see module docstring).

    One weak view per tensor object, so identities the replay checks (a break returning its
    input) still hold between the entry's references.
    """
    _wrappers.add(wrapper)
    _graphs_created[0] += entry.num_graphs
    if keep_strong():
        return
    weaken = _weakener(wrapper.platform)
    leaves = [weaken(t) for t in entry.output_leaves]
    entry.output_leaves = leaves
    entry.output = tree_unflatten(leaves, entry.output_spec)
    weaken_segments(entry.segments, weaken)
    for spec_tensor in entry.spec.tensors:  # an input an earlier graph produced (per-piece chains)
        spec_tensor.captured = weaken(spec_tensor.captured)


# ------------------------------------------------------------------ debug: poison stale outputs


def _ranges(tree: Any) -> list[tuple[int, int]]:
    return [
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
        for t in tree_leaves(tree)
        if isinstance(t, torch.Tensor)
    ]


def poison(t: torch.Tensor) -> None:
    """Fill ``t`` with a value no computation returns by chance: NaN, or -1 (max for unsigned)."""
    if t.is_floating_point() or t.is_complex():
        value: Any = float("nan")
    elif t.dtype == torch.bool:
        value = True
    elif t.dtype == torch.uint8:
        value = 255
    else:
        value = -1
    with torch.no_grad(), torch._C._AutoDispatchBelowADInplaceOrView():
        t.fill_(value)


def poison_stale_outputs(wrapper: Any, mode_index: int, desc: Any, entry: Any) -> None:
    """``debug_checks``: before ``entry`` (captured for ``desc`` in runtime mode ``mode_index``)
    replays, poison the outputs of every entry captured for another (mode, descriptor), except
    memory ``entry`` reads as input.

    A real GPU overwrites an old output only where a later graph's memory overlaps it, which
    depends on the pool's layout; poisoning makes any read of a stale output fail loudly.
    Entries of the same (mode, descriptor) belong to one forward: per-piece wrappers chain
    their outputs into each other's inputs.
    """
    platform = wrapper.captured_on
    keep = _ranges([*entry.inputs, *entry.static_inputs])
    for other_wrapper in list(_wrappers):
        if other_wrapper.captured_on is not platform:
            continue
        for other_mode, other_desc, other in other_wrapper.captured():
            if other is entry or (other_mode.value == mode_index and other_desc == desc):
                continue
            for t in other.output_leaves:
                if is_weak(t) and t.numel():
                    lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
                    if not any(a < hi and lo < b for a, b in keep):
                        poison(t)


# ------------------------------------------------------------------ clearing and the estimate


def release_cached(platform: Platform | None) -> int:
    """Give free pool memory back (after entries were dropped); returns the bytes released."""
    return 0 if platform is None else platform.release_cached()


@contextlib.contextmanager
def fresh_pool(platform: Platform) -> Iterator[Any]:
    """Route the platform's captures to a new pool for the duration; yields that pool."""
    with platform.fresh_pool() as scratch:
        yield scratch


@contextlib.contextmanager
def scratch_pool(platform: Platform) -> Iterator[None]:
    """Capture into a fresh pool for the duration, then release it with the entries made in it.
    Entries captured before are set aside meanwhile, so every descriptor captures anew."""
    saved = {w: w.set_aside_entries() for w in list(_wrappers)}
    try:
        with fresh_pool(platform):
            try:
                yield
            finally:  # drop the scratch entries while their pool is current
                for w in list(_wrappers):
                    w.restore_entries(saved.get(w))
    finally:
        for w, entries in saved.items():
            w.restore_entries(entries)
    release_cached(platform)


