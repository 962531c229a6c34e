"""Capture orchestration: warm up and capture every descriptor, report it, estimate what it costs.

These functions take the :class:`~.buffers.StepBuffers` a step reads and the :class:`~.step.Step`
that runs the model (with the config it captures under), not a runner: :func:`capture_all` is
:meth:`GraphRunner.capture <piecewise_backend.GraphRunner.capture>` without a budget, resetting the
buffers and capturing the plan largest first (:func:`capture_one` per descriptor, with its warm-ups
on the capture stream) behind an optional progress bar; :func:`estimate_memory` measures what that
costs before capturing. The step path (padding, dispatch, replay) is GraphRunner's.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

try:
    from tqdm import tqdm
except ImportError:  # a bare GPU box may lack it: capture works, without a progress bar
    tqdm = None

from ..capture.memory import graphs_created, scratch_pool
from ..capture.session import bulk_capture
from ..config import CompilationConfig
from ..context import BatchDescriptor
from ..modes import CUDAGraphMode
from ..observability import counters, phase_seconds
from ..platforms.base import Platform
from ..platforms.registry import config_platform_name, get_platform, warmed_step, warmup_scope
from . import agreement as _parallel
from .buffers import StepBuffers
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


def capture_all(
    buffers: StepBuffers, step: Step, config: CompilationConfig, plan: Plan, *,
    progress: bool | None = None,
    on_capture: Callable[[CUDAGraphMode, BatchDescriptor, float], Any] | None = None,
) -> CaptureReport:
    """Capture every descriptor of ``plan``, in its order (largest first), on ``config``'s platform, after
    resetting ``buffers`` to their pads; ``on_capture(mode, desc, seconds)`` after each."""
    total = sum(len(descs) for _, descs in plan)
    platform_name = config_platform_name(config)
    platform = get_platform(platform_name) if platform_name and total else None
    before = platform.memory() if platform else 0
    buffers.reset()
    segments_before = graphs_created()
    start = time.perf_counter()
    per: list[DescriptorSeconds] = []
    bulk = bulk_capture()
    bulk.__enter__()  # gc.collect once, then frozen: timed as "gc"
    gc_seconds = time.perf_counter() - start
    try:
        with _progress(total, progress) as bar:
            for mode, descs in plan:
                for desc in descs:
                    began = time.perf_counter()
                    phases = capture_one(buffers, step, mode, desc, platform, config.num_warmups)
                    seconds = time.perf_counter() - began
                    per.append(DescriptorSeconds(mode, desc, seconds, phases))
                    if on_capture is not None:
                        on_capture(mode, desc, seconds)
                    bar.update(1)
                    bar.set_postfix_str(f"{mode.name} {desc.num_tokens}")
    except BaseException:
        bulk.__exit__(*sys.exc_info())
        raise
    exit_began = time.perf_counter()
    bulk.__exit__(None, None, None)
    gc_seconds += time.perf_counter() - exit_began
    seconds = time.perf_counter() - start
    added = platform.memory() - before if platform else 0
    stats = platform.describe(added) if platform else "no graphs"
    return CaptureReport(total, seconds, stats, added, graphs_created() - segments_before, per,
                         phase_totals(per, seconds, gc_seconds))


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
