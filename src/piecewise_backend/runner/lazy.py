"""Lazy capture: serve before any capture, then capture what traffic asked for in idle time.

A runner with ``lazy_capture=True`` (or a ``graph_memory_budget``) never captures inside a step.
A step whose dispatched ``(mode, descriptor)`` has no graph yet runs eagerly (or, for a FULL key,
on the PIECEWISE graph of its size when that one is captured) and counts as *demand* for the
graph it wanted. ``GraphRunner.capture_idle`` then captures demanded descriptors between steps, on
the serving thread, through the one capture loop (:func:`~.orchestration.capture_keys`), which asks
this module's :class:`LazyCapture` (the policy: it alone changes its state) what to start, under two
limits:

* **time**: no capture starts that is predicted to overrun the time left. A capture is predicted to
  take as long as the slowest one measured so far in its mode (any mode before that), and the very
  first one :data:`CAPTURE_COST_STEPS` times the fastest eager step that asked for it (warm-ups,
  the capture itself and its replay);
* **memory**: no capture starts that is predicted to take the bytes this runner's graphs added to
  the pool past the budget. The pool's growth is measured after every capture; a capture larger
  than every graph so far is predicted as the largest capture that grew the pool, scaled by tokens
  (an overestimate: part of a capture's cost is fixed), and one within that size at the most a
  capture within the pool's largest added (before any was measured: as a growing one).
  With a budget and nothing measured yet, the smallest demanded descriptor goes first: its growth
  is the measurement the rest are predicted from (measuring with the capture estimator instead
  would capture too, and spend the slice). A capture that overran the budget anyway is dropped.

**Compile first.** A runner given the uncompiled model (``GraphRunner(eager_model=...)``, as every
engine's is) serves its first steps on it: no Dynamo trace, no pieces. Before its first capture,
:func:`~.orchestration.capture_keys` compiles: one warm-up step through the compiled model (Dynamo's trace, the
split, the pieces). That compile cannot be cut short, so it starts only when its predicted cost
fits the time left: :attr:`LazyCapture.compile_estimate_s`, by default
:data:`COMPILE_ESTIMATE_S` for the config's ``compile_pieces`` (measured here: a tiny model's trace
and eager pieces take 1-2 s cold, Inductor pieces 5-30 s), or what the last compile in this process
took when that is larger; set it to what your model measures. Until it fits, nothing is captured.

**Failures.** A compile or capture that raises in idle time is recorded (:class:`CaptureFailure`,
``GraphRunner.capture_failures``) and not tried again until asked (``capture_idle(retry_failed=True)``):
the steps it would serve run eagerly (reason ``capture_failed``) and stop counting as demand, so a
failure is paid once, not before every step. A failed compile stops every capture of the runner.

Order: largest first, as at startup (section 4.6): entries hold their capture memory weakly, so a
smaller capture reuses what a larger one left in the pool and the pool costs about its largest
capture; a capture larger than all before it is the one that grows the pool.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

from ..context import BatchDescriptor
from ..modes import CUDAGraphMode

_NONE, _PIECEWISE, _FULL = CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL
#: The first capture's predicted seconds, in eager steps of its descriptor: warm-ups, the capture
#: (the simulator records every op: about 3 eager steps), its replay, and margin.
CAPTURE_COST_STEPS = 8
#: The predicted seconds of the compile before the first capture (Dynamo's trace and the pieces), by
#: ``compile_pieces``, until one is measured: a tiny model's cold trace with eager pieces took 1.3-1.5 s
#: on a 2-core CPU, Inductor pieces add the first Inductor compile of the process (about 7 s) and more.
COMPILE_ESTIMATE_S = {"eager": 2.0, "inductor": 20.0, "none": 0.0}  # "none": nothing is compiled
_last_compile: dict[str, float] = {}  # compile_pieces -> seconds the last compile in this process took

Key = tuple[CUDAGraphMode, BatchDescriptor]


@dataclasses.dataclass
class Demand:
    """Steps that wanted a graph that was not captured, and the fastest eager one (host seconds)."""

    steps: int = 0
    eager_seconds: float = math.inf


@dataclasses.dataclass(frozen=True)
class CaptureRecord:
    """One capture: its key, seconds, pool bytes it added (None: not measured), whether it was larger
    than every capture before it."""

    mode: CUDAGraphMode
    desc: BatchDescriptor
    seconds: float
    growth: int | None
    frontier: bool


@dataclasses.dataclass(frozen=True)
class CaptureFailure:
    """A compile or capture that raised in idle time: its ``stage`` ("compile": the warm-up that compiles the
    model before the first capture, run at ``descriptor``'s size; "capture"), the key it was for, and the
    error as text (``reason``: its type and message)."""

    stage: str
    mode: CUDAGraphMode
    descriptor: BatchDescriptor
    reason: str


class LazyCapture:
    """A runner's captured keys, the demand for the others, and the measurements predictions use."""

    def __init__(self) -> None:
        self.captured: set[Key] = set()
        self.demand: dict[Key, Demand] = {}
        self.history: list[CaptureRecord] = []
        self.grown = 0  # pool bytes this runner's measured captures added
        self.too_large: set[Key] = set()  # captured once, overran the budget, dropped
        #: Seconds the compile before the first capture is predicted to take (None: the default of
        #: :meth:`predict_compile`); set it to what this model's compile measures.
        self.compile_estimate_s: float | None = None
        self.compile_seconds: float | None = None  # what this runner's compile took (None: not compiled here)
        self.failures: dict[Key, CaptureFailure] = {}  # in the order they happened
        self.compile_failed = False  # a failure of stage "compile" is recorded: nothing is captured
        self._parked: dict[Key, Demand] = {}  # the demand of failed keys (and all of it after a failed compile)

    # ------------------------------------------------------------------ the step path

    def route(
        self, mode: CUDAGraphMode, desc: BatchDescriptor, n: int
    ) -> tuple[CUDAGraphMode, BatchDescriptor, Key | None]:
        """What a step of ``n`` tokens dispatched to ``(mode, desc)`` runs: the graph when captured, else the
        PIECEWISE graph of its size (for a FULL key) when that one is captured, else eagerly; the third item
        is the key it wanted (None: captured). Only dispatcher keys are ever captured, so a captured relaxed
        key is the one the dispatcher would answer for a mixed batch of that size."""
        key = (mode, desc)
        if key in self.captured:
            return mode, desc, None
        if not self.compile_failed and key not in self.failures:
            self.demand.setdefault(key, Demand()).steps += 1
        if mode == _FULL:
            relaxed = BatchDescriptor(desc.num_tokens)
            if (_PIECEWISE, relaxed) in self.captured:
                return _PIECEWISE, relaxed, None
        return _NONE, BatchDescriptor(n), key

    def note_eager(self, key: Key, seconds: float) -> None:
        demand = self.demand.get(key)
        if demand is not None:  # a failed key is not demand
            demand.eager_seconds = min(demand.eager_seconds, seconds)

    def failed(self, key: Key) -> bool:
        """Is ``key`` served eagerly because its capture (or the runner's compile) failed?"""
        return self.compile_failed or key in self.failures

    # ------------------------------------------------------------------ bookkeeping

    def note_capture(self, mode: CUDAGraphMode, desc: BatchDescriptor, seconds: float, growth: int | None) -> None:
        frontier = desc.num_tokens > self.frontier
        self.history.append(CaptureRecord(mode, desc, seconds, growth, frontier))
        self.captured.add((mode, desc))
        self.demand.pop((mode, desc), None)
        if growth is not None:
            self.grown += growth

    def note_failure(self, stage: str, mode: CUDAGraphMode, desc: BatchDescriptor, error: BaseException) -> CaptureFailure:
        """The ``stage`` for ``(mode, desc)`` raised ``error``: recorded, and its demand (all of it, for a
        compile) parked until :meth:`retry_failed`; returns the record."""
        failure = CaptureFailure(stage, mode, desc, f"{type(error).__name__}: {error}")
        key = (mode, desc)
        self.failures[key] = failure
        parked = list(self.demand) if stage == "compile" else [key]
        for k in parked:
            if k in self.demand:
                self._parked[k] = self.demand.pop(k)
        self.compile_failed = self.compile_failed or stage == "compile"
        return failure

    def retry_failed(self) -> list[CaptureFailure]:
        """Forget the failures: their keys are demand again (the next pass tries them); returns what was forgotten."""
        forgotten = list(self.failures.values())
        self.failures.clear()
        self.compile_failed = False
        for k, d in self._parked.items():
            self.demand.setdefault(k, d)
        self._parked.clear()
        return forgotten

    def forget(self) -> None:
        """The runner's graphs were dropped: nothing is captured (measurements are kept)."""
        self.captured.clear()
        self.grown = 0

    @property
    def frontier(self) -> int:
        """The most tokens of any graph captured so far (0: none)."""
        return max((d.num_tokens for _, d in self.captured), default=0)

    # ------------------------------------------------------------------ predictions

    def predict_seconds(self, mode: CUDAGraphMode, desc: BatchDescriptor) -> float:
        same = [r.seconds for r in self.history if r.mode == mode] or [r.seconds for r in self.history]
        if same:
            return max(same)
        eager = self.demand.get((mode, desc), Demand()).eager_seconds
        return CAPTURE_COST_STEPS * eager if math.isfinite(eager) else 0.0

    def predict_compile(self, compile_pieces: str) -> float:
        """Seconds the compile before the first capture is predicted to take: :attr:`compile_estimate_s`
        when set, else :data:`COMPILE_ESTIMATE_S` (or the last compile measured in this process, if longer)."""
        if self.compile_estimate_s is not None:
            return self.compile_estimate_s
        return max(COMPILE_ESTIMATE_S.get(compile_pieces, 20.0), _last_compile.get(compile_pieces, 0.0))

    def costliest_start(self, compile_pieces: str, needs_compile: bool) -> float:
        """Predicted seconds of the longest single start the demand waits for: the compile when it is still
        needed, else the costliest demanded capture (0: no demand)."""
        if not self.demand:
            return 0.0
        if needs_compile:
            return self.predict_compile(compile_pieces)
        pending = [k for k in self.demand if k not in self.captured and k not in self.too_large]
        return max((self.predict_seconds(mode, desc) for mode, desc in pending), default=0.0)

    def note_compile(self, compile_pieces: str, seconds: float) -> None:
        self.compile_seconds = seconds
        _last_compile[compile_pieces] = seconds

    def predict_growth(self, mode: CUDAGraphMode, desc: BatchDescriptor) -> int | None:
        """Pool bytes the capture of ``(mode, desc)`` is predicted to add (None: nothing measured)."""
        measured = [r for r in self.history if r.growth is not None]
        same = [r for r in measured if r.mode == mode] or measured
        if not same:
            return None
        if desc.num_tokens <= self.frontier:
            reusing = [r.growth for r in same if not r.frontier]
            if reusing:  # within the pool's largest graph: what such captures added
                return max(reusing)
        growing = [r for r in same if r.frontier] or same
        ref = max(growing, key=lambda r: r.desc.num_tokens)  # scaled from the largest: fixed costs make it an overestimate
        return math.ceil(ref.growth * desc.num_tokens / ref.desc.num_tokens)

    def order(self, keys: Iterable[Key], budget: int | None) -> list[Key]:
        """Largest first (PIECEWISE before FULL at one size); with a budget and nothing measured, the smallest first."""
        ordered = sorted(keys, key=lambda k: (-k[1].num_tokens, k[0] != _PIECEWISE, not k[1].uniform))
        if budget is not None and ordered and not any(r.growth is not None for r in self.history):
            ordered.insert(0, ordered.pop())
        return ordered

    # ------------------------------------------------------------------ the capture loop's questions

    def pending(self, keys: Iterable[Key]) -> list[Key]:
        """``keys`` that are neither captured, refused as too large nor failed, in their order."""
        if self.compile_failed:
            return []
        return [k for k in keys if k not in self.captured and k not in self.too_large and k not in self.failures]

    def admits(self, mode: CUDAGraphMode, desc: BatchDescriptor, seconds_left: float, budget: int | None) -> bool:
        """May the capture of ``(mode, desc)`` start with ``seconds_left`` and ``budget`` (bytes this runner's
        graphs may add to the pool; None: no limit)? Not when predicted to overrun either."""
        if seconds_left <= 0 or self.predict_seconds(mode, desc) > seconds_left:
            return False
        predicted = self.predict_growth(mode, desc) if budget is not None else None
        return predicted is None or self.grown + predicted <= budget  # type: ignore[operator]

    def note_dropped(self, mode: CUDAGraphMode, desc: BatchDescriptor, remaining: int) -> None:
        """The capture of ``(mode, desc)`` just noted took the pool past the budget and was dropped; ``remaining``
        is what it still adds to the pool after the release (0 when the pool gave everything back)."""
        key = (mode, desc)
        self.captured.discard(key)
        self.too_large.add(key)
        self.grown += remaining - (self.history[-1].growth or 0)
