"""GraphRunner's capture orchestration: warm up and capture every descriptor, and report it.

:func:`capture_all` is :meth:`GraphRunner.capture <piecewise_backend.GraphRunner.capture>`: it resets
the runner's buffers, captures the dispatcher's descriptors largest first (:func:`capture_one` per
descriptor, with its warm-ups on the capture stream) behind an optional progress bar, and returns a
:class:`CaptureReport`. :func:`estimate_memory` measures what that will cost before capturing.
The step path (padding, dispatch, replay) stays in :mod:`.runner`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

try:
    from tqdm import tqdm
except ImportError:  # a bare GPU box may lack it: capture works, without a progress bar
    tqdm = None

from ..capture.memory import graphs_created, scratch_pool
from ..capture.session import bulk_capture
from ..context import BatchDescriptor
from ..modes import CUDAGraphMode
from ..observability import logger
from ..platforms.registry import get_platform, config_platform_name, warmed_step, warmup_scope
from ..shapes import mark_token_views
from . import agreement as _parallel
from . import ubatch_step as _ubatch


@dataclasses.dataclass
class CaptureReport:
    graphs: int  # (mode, descriptor) entries captured; ``descriptors`` names it plainly
    seconds: float
    stats: str
    memory_bytes: int = 0  # graph pool bytes this capture added
    graph_segments: int = 0  # graphs the platform made: a breakable entry has one per segment

    @property
    def descriptors(self) -> int:
        return self.graphs


def capture_all(runner: Any, disable_after: bool, progress: bool | None) -> CaptureReport:
    """Capture every descriptor of ``runner``'s dispatcher, largest first (``GraphRunner.capture``)."""
    plan = runner.dispatcher.capture_descriptors()
    total = sum(len(descs) for _, descs in plan)
    platform_name = config_platform_name(runner.config)
    platform = get_platform(platform_name) if platform_name and total else None
    before = platform.memory() if platform else 0
    for name, buf in runner.buffers.items():
        buf.fill_(runner.inputs[name].pad)
    segments_before = graphs_created()
    start = time.perf_counter()
    with bulk_capture(), _progress(total, progress) as bar:
        for mode, descs in plan:
            for desc in descs:
                began = time.perf_counter()
                runner._capture_one(mode, desc, platform)
                runner.lazy.note_capture(mode, desc, time.perf_counter() - began, None)  # growth: only the total
                bar.update(1)
                bar.set_postfix_str(f"{mode.name} {desc.num_tokens}")
    added = platform.memory() - before if platform else 0
    stats = platform.describe(added) if platform else "no graphs"
    runner.report = CaptureReport(total, time.perf_counter() - start, stats, added, graphs_created() - segments_before)
    logger.info(
        "captured %d graphs in %.2f s (%s); attention: %s", total, runner.report.seconds, stats,
        runner.attention_backend or "the model's own",
    )
    runner.capture_closed = disable_after
    return runner.report


def capture_one(runner: Any, mode: CUDAGraphMode, desc: BatchDescriptor, platform: Any) -> None:
    """Warm up (on the capture stream) and capture one descriptor with the step's own views."""
    views = runner._views(desc.num_tokens)
    with warmed_step(platform):  # the warm-ups count for this descriptor's capture only
        for _ in range(runner.config.num_warmups):
            mark_token_views(views, runner.inputs)  # one Dynamo graph for every size, 1 too
            with warmup_scope(platform):  # on the capture stream (CUDA)
                out = runner._call(views, CUDAGraphMode.NONE, desc, {}, capturing=True)
            _parallel.wait_collectives(out)  # the warm-up's outputs are dropped unused
        with _parallel.capture_agreement(mode, desc):  # a rank that fails stops its peers too
            runner._call(views, mode, desc, {}, capturing=True)
    if runner._ubatching and mode == CUDAGraphMode.FULL:  # the same step micro-batched: one more graph
        _ubatch.capture_ubatched(runner, desc, platform, warmed_step, warmup_scope, _parallel.capture_agreement)


def estimate_memory(runner: Any) -> int:
    """Bytes ``runner.capture()`` will add to the pool (``GraphRunner.estimate_capture_memory``): the
    largest descriptor of each mode, captured into a scratch pool in capture order and released.
    Smaller sizes reuse that memory, so this is close to the real total (not a sum over sizes)."""
    plan = [(mode, descs[0]) for mode, descs in runner.dispatcher.capture_descriptors() if descs]
    name = config_platform_name(runner.config)
    if not plan or name is None:
        return 0
    platform = get_platform(name)
    with scratch_pool(platform):
        before = platform.memory()
        for mode, desc in plan:
            runner._capture_one(mode, desc, platform)
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
