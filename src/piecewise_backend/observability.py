"""Logging, counters and debug dumps: how a user sees what the backend and wrappers did."""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from collections.abc import Iterator

logger = logging.getLogger("piecewise_backend")

# Public counters; every key a test may read is listed here (missing keys read 0).
COUNTER_KEYS = (
    "graphs",  # FX graphs the backend received
    "pieces",  # pieces produced by splitting
    "splitting_pieces",  # pieces that became break points
    "compiled_pieces",  # pieces that run compiled code (Inductor or eager GraphModule)
    "compiles",  # Inductor compilations actually run (identical pieces share one)
    "compile_cache_hits",  # pieces that reused an identical piece's compiled code
    "cache_loads",  # compiled pieces loaded from disk (cache_dir or an AOT file) instead of compiled
    "cache_saves",  # compiled pieces written to cache_dir
    "cache_rejects",  # cache entries ignored (corrupt, truncated, unloadable): those pieces compiled
    "captures",  # graph entries captured (one per wrapper and descriptor)
    "replays",  # entry replays
    "breaks",  # eager segments recorded during breakable captures
    "eager_NONE",  # wrapper calls that ran eagerly: no context or runtime mode NONE
    "eager_PIECEWISE",  # ... a PIECEWISE step a FULL-only wrapper let through
    "eager_FULL",  # ... a FULL step a PIECEWISE-only wrapper let through
    "eager_steps_above_ladder",  # runner steps run eagerly: more tokens than the largest capture size
    "eager_steps_inputs_too_wide",  # ... an input wider than the static buffers
    "eager_steps_not_captured",  # ... their graph not captured yet (lazy capture, graph_memory_budget)
    "eager_steps_capture_failed",  # ... their graph's idle-time capture (or the compile before it) failed
    "capture_failures",  # idle-time captures and compiles that raised (recorded in GraphRunner.capture_failures)
    "prefix_cache_hits",  # prompt tokens a request found cached when first scheduled (prefix caching)
    "prefix_cache_misses",  # ... and those it computed
)


# Eager fall-throughs are counted on the wrappers' passthrough path, which has a 500 ns
# budget: a list slot indexed by CUDAGraphMode value costs a third of a Counter increment.
# ``counters["eager_<MODE>"]`` reads these slots (the keys are never stored in the dict).
eager_counts = [0, 0, 0]
_EAGER_INDEX = {"eager_NONE": 0, "eager_PIECEWISE": 1, "eager_FULL": 2}


class _Counters(collections.Counter):
    """A Counter whose item assignment is dict's own, for the wrappers' hot path.

    ``collections.Counter`` defines ``__delitem__`` in Python, which sends every
    ``counters[k] += 1`` through a slow generic slot (about twice a dict's cost, measured in
    docs/benchmarks.md). Deleting a missing key here raises KeyError, as for a dict.
    """

    __setitem__ = dict.__setitem__
    __delitem__ = dict.__delitem__

    def __missing__(self, key: str) -> int:
        i = _EAGER_INDEX.get(key)
        return 0 if i is None else eager_counts[i]

    def clear(self) -> None:
        super().clear()
        eager_counts[:] = [0, 0, 0]

    def snapshot(self) -> dict[str, int]:
        """Every non-zero counter, eager fall-throughs included."""
        return {**self, **{k: eager_counts[i] for k, i in _EAGER_INDEX.items() if eager_counts[i]}}

    def __repr__(self) -> str:
        return f"counters({self.snapshot()})"


counters: collections.Counter[str] = _Counters()


@contextlib.contextmanager
def expect(**deltas: int) -> Iterator[None]:
    """Assert that the block changes each named counter by exactly the given amount."""
    unknown = sorted(set(deltas) - set(COUNTER_KEYS))
    if unknown:
        raise ValueError(f"unknown counter(s) {unknown}; valid: {', '.join(COUNTER_KEYS)}")
    before = {k: counters[k] for k in deltas}
    yield
    wrong = {k: (counters[k] - before[k], v) for k, v in deltas.items() if counters[k] - before[k] != v}
    if wrong:
        detail = ", ".join(f"{k}: changed by {got}, expected {want}" for k, (got, want) in wrong.items())
        raise AssertionError(f"counter mismatch: {detail}")


#: Seconds spent per named phase of capture work, accumulated (``timed_phase``): a capture reads the
#: difference around each descriptor (the simulator's "checks": its validation replays).
phase_seconds: collections.Counter[str] = collections.Counter()


@contextlib.contextmanager
def timed_phase(name: str) -> Iterator[None]:
    """Add the block's wall seconds to ``phase_seconds[name]``."""
    began = time.perf_counter()
    try:
        yield
    finally:
        phase_seconds[name] += time.perf_counter() - began


def reset_counters() -> None:
    counters.clear()


