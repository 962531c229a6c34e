"""Capture orchestration: warm up and capture every descriptor, report it, estimate what it costs.

These functions take the :class:`~.buffers.StepBuffers` a step reads and the :class:`~.step.Step`
that runs the model (with the config it captures under), not a runner. :func:`capture_keys` is the one
capture loop: :meth:`GraphRunner.capture <piecewise_backend.GraphRunner.capture>` (the dispatcher's plan,
largest first, with or without a ``graph_memory_budget``) and ``capture_idle`` (the demanded keys within a
time slice) both run it, with a :class:`CaptureBudget` and the runner's :class:`~.lazy.LazyCapture` as the
policy that orders and admits each capture (:func:`capture_one` per descriptor, with its warm-ups on the
capture stream, behind an optional progress bar); :func:`estimate_memory` measures what a capture costs
before capturing. The step path (padding, dispatch, replay) is GraphRunner's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

try:
    from tqdm import tqdm
except ImportError:  # a bare GPU box may lack it: capture works, without a progress bar
    tqdm = None

from ..capture.memory import graphs_created, release_cached, scratch_pool
from ..capture.session import bulk_capture
from ..config import CompilationConfig
from ..context import BatchDescriptor
from ..modes import CUDAGraphMode
from ..observability import counters, logger, phase_seconds
from ..platforms.base import Platform
from ..platforms.registry import config_platform_name, get_platform, warmed_step, warmup_scope
from . import agreement as _parallel
from .buffers import StepBuffers
from .lazy import Key, LazyCapture
from .step import Step

Plan = Sequence[tuple[CUDAGraphMode, Sequence[BatchDescriptor]]]  # (mode, descriptors largest first), as
# CudagraphDispatcher.capture_descriptors() returns it


#: What a capture's seconds are spent on (:attr:`CaptureReport.phases`): ``compile`` the warm-up that
#: traced and compiled the model (Dynamo, the pieces), ``warmup`` the other warm-ups, ``capture`` the
#: captures themselves (on the simulator: recording every op), ``checks`` the simulator's validation
#: replay of every segment (0 on CUDA), ``gc`` collecting and freezing garbage once before the captures,
#: ``other`` the rest (progress bar, buffers, bookkeeping).
PHASES = ("compile", "warmup", "capture", "checks", "gc", "other")


@dataclasses.dataclass(frozen=True)
class DescriptorSeconds:
    """One captured descriptor: its key, seconds, and their split by phase (``compile``, ``warmup``,
    ``capture``, ``checks``; see :data:`PHASES`)."""

    mode: CUDAGraphMode
    desc: BatchDescriptor
    seconds: float
    phases: dict[str, float]


@dataclasses.dataclass
class CaptureReport:
    graphs: int  # (mode, descriptor) entries captured; ``descriptors`` names it plainly
    seconds: float
    stats: str
    memory_bytes: int = 0  # graph pool bytes this capture added
    graph_segments: int = 0  # graphs the platform made: a breakable entry has one per segment
    #: Seconds per captured descriptor, in capture order, each split by phase.
    per_descriptor: list[DescriptorSeconds] = dataclasses.field(default_factory=list)
    #: ``seconds`` split by phase (:data:`PHASES`): they sum to ``seconds``.
    phases: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def descriptors(self) -> int:
        return self.graphs


def capture_one(
    buffers: StepBuffers, step: Step, mode: CUDAGraphMode, desc: BatchDescriptor, platform: Platform | None,
    num_warmups: int,
) -> dict[str, float]:
    """Warm up ``num_warmups`` times (on the capture stream) and capture one descriptor with the views a
    step of it reads; a FULL descriptor the step also runs micro-batched captures that graph too.
    Returns the seconds by phase: ``compile`` (a warm-up that traced the model), ``warmup``, ``capture``
    and ``checks`` (the simulator's validation replays, within the capture)."""
    phases = dict.fromkeys(("compile", "warmup", "capture", "checks"), 0.0)
    views = buffers.views(desc.num_tokens)
    with warmed_step(platform):  # the warm-ups count for this descriptor's capture only
        for _ in range(num_warmups):
            _warm_up(phases, platform, lambda: _mark_and_run(buffers, step, views, desc))
        _capture(phases, lambda: step(views, mode, desc, may_capture=True), mode, desc)
    halves = step.capture_halves(desc) if mode == CUDAGraphMode.FULL else None
    if halves is None:
        return phases
    views = buffers.views(desc.num_tokens)  # the same step micro-batched: one more graph
    plain = BatchDescriptor(desc.num_tokens)
    with warmed_step(platform):
        for _ in range(num_warmups):
            # the threads run on the launching thread's stream: the capture stream
            _warm_up(phases, platform, lambda: step(views, CUDAGraphMode.NONE, plain, may_capture=True, halves=halves))
        _capture(phases, lambda: step(views, CUDAGraphMode.FULL, desc, may_capture=True, halves=halves),
                 CUDAGraphMode.FULL, desc)
    return phases


def _mark_and_run(buffers: StepBuffers, step: Step, views: dict, desc: BatchDescriptor) -> Any:
    buffers.mark_token_views(views)  # one Dynamo graph for every size, 1 too
    return step(views, CUDAGraphMode.NONE, desc, may_capture=True)


def _warm_up(phases: dict[str, float], platform: Platform | None, run: Callable[[], Any]) -> None:
    """One warm-up, timed as ``compile`` when it traced the model (the backend received a graph), else ``warmup``."""
    graphs, began = counters["graphs"], time.perf_counter()
    with warmup_scope(platform):  # on the capture stream (CUDA)
        out = run()
    _parallel.wait_collectives(out)  # the warm-up's outputs are dropped unused
    phases["compile" if counters["graphs"] != graphs else "warmup"] += time.perf_counter() - began


def _capture(phases: dict[str, float], run: Callable[[], Any], mode: CUDAGraphMode, desc: BatchDescriptor) -> None:
    checks, began = phase_seconds["checks"], time.perf_counter()
    with _parallel.capture_agreement(mode, desc):  # a rank that fails stops its peers too
        run()
    checked = phase_seconds["checks"] - checks
    phases["checks"] += checked
    phases["capture"] += time.perf_counter() - began - checked


@dataclasses.dataclass(frozen=True)
class CaptureBudget:
    """The limits of one pass of :func:`capture_keys`: ``seconds`` (no capture starts that is predicted to
    overrun the time left) and ``memory`` (bytes the runner's graphs may add to the graph pool; None: no
    limit). ``startup``: an up-front capture of the dispatcher's whole plan without a memory limit: the keys
    in the plan's order, one gc collection first (timed as ``gc``), the pool's growth measured only in total."""

    seconds: float = math.inf
    memory: int | None = None
    startup: bool = False


def capture_keys(
    buffers: StepBuffers, step: Step, config: CompilationConfig, policy: LazyCapture, keys: Sequence[Key],
    budget: CaptureBudget, *, progress: bool | None = False, clock: Callable[[], float] = time.perf_counter,
) -> tuple[list[Key], CaptureReport]:
    """The one capture loop (``GraphRunner.capture``, with or without a memory budget, and ``capture_idle``):
    capture ``keys`` with ``step`` on ``buffers`` within ``budget``, as ``policy`` orders and admits them;
    returns the keys captured, in capture order, and the pass's :class:`CaptureReport`.

    Before the first capture: the model is compiled when ``step`` still runs it uncompiled (if the compile is
    predicted to fit the time left; :func:`compile_now`), the buffers are reset to their pads, and gc is
    frozen for the pass (``bulk_capture``). A capture that took the pool past ``budget.memory`` is dropped and
    its memory released; when the pool does not give it back, the pass stops. Steps must not run meanwhile."""
    if not budget.startup and _parallel.distributed():
        raise RuntimeError(
            "capture_idle in a process group: ranks would predict different times and capture different graphs, "
            "then dispatch different steps; capture up front with capture() on every rank instead"
        )
    start = clock()
    name = config_platform_name(config)
    plan = list(keys) if budget.startup else policy.order(policy.pending(keys), budget.memory)
    platform = get_platform(name) if name is not None and plan else None
    before, segments = (platform.memory() if platform else 0), graphs_created()
    captured: list[Key] = []
    per: list[DescriptorSeconds] = []
    gc_seconds, frozen_gc = 0.0, False
    if platform is not None and step.needs_compile and not budget.startup:  # serve before compiling: compile now
        if policy.predict_compile(config.compile_pieces) > budget.seconds - (clock() - start):
            plan = []
        else:
            try:
                compile_now(buffers, step, plan[-1][1], platform, policy, config.compile_pieces, clock)
            except Exception as error:  # noqa: BLE001 - recorded and said; the steps keep running eagerly
                _note_failure(policy, "compile", *plan[-1], error)
                plan = []
    with contextlib.ExitStack() as frozen, _progress(len(plan), progress if platform else False) as bar:
        for mode, desc in plan if platform is not None else ():
            if not budget.startup and not policy.admits(mode, desc, budget.seconds - (clock() - start), budget.memory):
                continue
            if not frozen_gc:  # the first capture of the pass
                frozen_gc, began = True, clock()
                frozen.enter_context(bulk_capture(collect=budget.startup))  # gc collected (startup) and frozen
                gc_seconds += clock() - began
                buffers.reset()  # never a previous step's data (real KV slots)
            mem, began = platform.memory(), clock()
            if budget.startup:  # capture() raises: the caller asked for these graphs
                phases = capture_one(buffers, step, mode, desc, platform, config.num_warmups)
            else:
                try:
                    phases = capture_one(buffers, step, mode, desc, platform, config.num_warmups)
                except Exception as error:  # noqa: BLE001 - recorded and said; this key's steps run eagerly
                    step.drop(mode, desc)  # nothing half-built stays (the wrappers keep no entry of a failed capture)
                    _note_failure(policy, "capture", mode, desc, error)
                    bar.update(1)
                    continue
            seconds = clock() - began
            policy.note_capture(mode, desc, seconds, None if budget.startup else platform.memory() - mem)
            per.append(DescriptorSeconds(mode, desc, seconds, phases))
            bar.update(1)
            bar.set_postfix_str(f"{mode.name} {desc.num_tokens}")
            if budget.memory is not None and policy.grown > budget.memory:
                step.drop(mode, desc)
                release_cached(platform)
                policy.note_dropped(mode, desc, platform.memory() - mem)
                logger.info("capture of %s %s took the pool past graph_memory_budget=%d: dropped", mode.name, desc,
                            budget.memory)
                if policy.grown > budget.memory:
                    break  # the pool did not give the memory back: stop here
                continue
            captured.append((mode, desc))
        began = clock()
        frozen.close()  # gc thawed: timed as gc
        gc_seconds += clock() - began
    seconds = clock() - start
    added = platform.memory() - before if platform else 0
    stats = platform.describe(added) if platform else "no graphs"
    if budget.memory is not None:
        stats += f"; {len(captured)} of {len(keys)} descriptors within graph_memory_budget={budget.memory}"
    if captured and not budget.startup:
        logger.info("captured %d graphs in %.2f s of %.2f s given", len(captured), seconds, budget.seconds)
    report = CaptureReport(len(captured), seconds, stats, added, graphs_created() - segments, per,
                           phase_totals(per, seconds, gc_seconds))
    return captured, report


def _note_failure(policy: LazyCapture, stage: str, mode: CUDAGraphMode, desc: BatchDescriptor,
                  error: Exception) -> None:
    """Record a failed idle-time compile or capture; warn once per distinct reason."""
    known = {f.reason for f in policy.failures.values()}
    failure = policy.note_failure(stage, mode, desc, error)
    counters["capture_failures"] += 1
    if failure.reason in known:
        logger.info("lazy %s of %s %s failed again (%s)", stage, mode.name, desc, failure.reason)
        return
    what = "every step runs eagerly" if stage == "compile" else f"steps of {mode.name} {desc} run eagerly"
    logger.warning("lazy %s of %s %s failed (%s): %s (reason capture_failed, GraphRunner.capture_failures); "
                   "capture_idle(retry_failed=True) tries again", stage, mode.name, desc, failure.reason, what)


def compile_now(
    buffers: StepBuffers, step: Step, desc: BatchDescriptor, platform: Any, policy: LazyCapture, compile_pieces: str,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Compile ``step``'s model (Dynamo's trace and the pieces): one warm-up of ``desc``'s size on the reset,
    marked buffers (no real KV slot); returns its seconds, recorded by ``policy``."""
    buffers.reset()
    views = buffers.views(desc.num_tokens)
    buffers.mark_token_views(views)  # the one graph every size uses, as a capture's warm-up traces it
    began = clock()
    with warmup_scope(platform):
        out = step(views, CUDAGraphMode.NONE, BatchDescriptor(desc.num_tokens), may_capture=True)
    _parallel.wait_collectives(out)
    seconds = clock() - began
    policy.note_compile(compile_pieces, seconds)
    logger.info("compiled the model in %.2f s (predicted %.2f s) before capturing", seconds,
                policy.predict_compile(compile_pieces))
    return seconds


def phase_totals(per: Sequence[DescriptorSeconds], seconds: float, gc_seconds: float = 0.0) -> dict[str, float]:
    """The phases of ``per`` summed, with ``gc`` and ``other`` (what no phase names) so that they sum to ``seconds``."""
    totals = dict.fromkeys(PHASES, 0.0)
    for d in per:
        for k, v in d.phases.items():
            totals[k] += v
    totals["gc"] = gc_seconds
    totals["other"] = max(0.0, seconds - sum(totals.values()))
    return totals


def estimate_memory(buffers: StepBuffers, step: Step, config: CompilationConfig, plan: Plan) -> int:
    """Bytes capturing ``plan`` will add to the pool (``GraphRunner.estimate_capture_memory``): the
    largest descriptor of each mode, captured into a scratch pool in capture order and released.
    Smaller sizes reuse that memory, so this is close to the real total (not a sum over sizes)."""
    largest = [(mode, descs[0]) for mode, descs in plan if descs]
    name = config_platform_name(config)
    if not largest or name is None:
        return 0
    platform = get_platform(name)
    with scratch_pool(platform):
        before = platform.memory()
        for mode, desc in largest:
            capture_one(buffers, step, mode, desc, platform, config.num_warmups)
        return platform.memory() - before


class _NoBar:
    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def update(self, n: int) -> None:
        pass

    def set_postfix_str(self, text: str) -> None:
        pass


def _progress(total: int, progress: bool | None) -> Any:
    """A tqdm bar (``progress=None``: only on a terminal), or a silent stand-in."""
    if tqdm is None or progress is False:
        return _NoBar()
    return tqdm(total=total, desc="capturing graphs", disable=None if progress is None else False)
