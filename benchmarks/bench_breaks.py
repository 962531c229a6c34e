"""Capture time of a workload with many breaks: ``pb.breakable_graph`` against one graph per segment.

The workload: ``N`` (64) segments of a few small kernels on one buffer, an eager break between each
pair (an in-place clamp, the kind of work a graph segment may not hold).

* On a GPU: ``pb.breakable_graph`` (one capture session, one gc collection, segments captured
  back to back into one private pool) against one ``torch.cuda.graph`` per segment, the approach of
  Meta's breakable-cuda-graphs (each ``torch.cuda.graph`` synchronizes, collects garbage and empties
  the allocator's cache on entry), and against that package itself when it is installed. Capture
  seconds and the ratio, side by side in one run; then replay time of the whole workload.
* On the CPU there is no CUDA graph to compare with: the table gives the capture machinery's own
  cost per segment (the capture session ending a segment, recording the break, opening the next,
  on a platform that records nothing), and the simulated platform's capture cost per segment.
"""

from __future__ import annotations

import contextlib
import gc
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.dirname(__file__)))

import torch

import piecewise_backend as pb
from benchmarks.common import Section, fmt_spread, quartiles, table
from piecewise_backend.capture import CaptureSession, session_scope

SEGMENTS = 64


@pb.eager_break
def clamp_break(h: torch.Tensor) -> None:
    h.clamp_(-4.0, 4.0)


def segment(h: torch.Tensor, w: torch.Tensor) -> None:
    h.copy_(torch.tanh(h @ w) * 1.5 + 0.25)


def workload(h: torch.Tensor, w: torch.Tensor, segments: int) -> None:
    for _ in range(segments - 1):
        segment(h, w)
        clamp_break(h)
    segment(h, w)


class _NullGraph:
    def replay(self) -> None:
        pass


class _NullRecorder:
    def end(self) -> _NullGraph:
        return _NullGraph()

    def abort(self) -> None:
        pass


class NullPlatform:
    """Records nothing: what a capture costs beyond the platform's own work."""

    name = "null"

    def capture_scope(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def begin(self) -> _NullRecorder:
        return _NullRecorder()


def _interleaved(variants: dict[str, Callable[[], float]], reps: int, deadline: float | None) -> dict[str, list[float]]:
    """Seconds per variant and repetition, the variants in a fresh random order every repetition."""
    rng = random.Random(0)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(reps):
        order = list(variants)
        rng.shuffle(order)
        for name in order:
            times[name].append(variants[name]())
        if deadline is not None and time.monotonic() > deadline and len(times[order[0]]) >= 3:
            break
    return times


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def cpu_section(quick: bool, deadline: float | None) -> Section:
    h, w = torch.randn(8, 8), torch.randn(8, 8) / 8
    reps = 5 if quick else 15

    def plain() -> float:  # the same calls, no capture: the baseline the machinery adds to
        return _timed(lambda: workload(h, w, SEGMENTS))

    def null_session() -> float:
        return _timed(lambda: _capture_on(NullPlatform(), h, w))

    def simulated() -> float:
        return _timed(lambda: _capture(pb.BreakableGraph(platform="simulated"), h, w))

    times = _interleaved({"eager (no capture)": plain, "null platform": null_session, "simulated": simulated},
                         reps, deadline)
    base = times["eager (no capture)"]
    rows = []
    for name, ts in times.items():
        per = [(t - b) / SEGMENTS for t, b in zip(ts, base)]
        rows.append([name, fmt_spread(ts, 1e3, 2), "-" if name.startswith("eager") else fmt_spread(per, 1e6, 1)])
    body = (
        f"A workload of {SEGMENTS} segments (an 8x8 matmul, tanh, scale, copy) with an eager break (an in-place "
        f"clamp) between each pair, captured with `pb.breakable_graph`. `null platform`: the capture session on a "
        "platform that records nothing (the machinery: ending a segment, recording the break, opening the next); "
        "`simulated`: the CPU simulator (recording ATen ops, undoing writes, its pool). Added per segment: the "
        f"capture's time minus the uncaptured run's, paired per repetition, over {SEGMENTS}. No CUDA graph is "
        "compared on the CPU (see the GPU results).\n\n"
        + table(["capture", "ms per capture [p25, p75]", "added per segment, us"], rows)
    )
    return Section("Breaks anywhere: capture cost per segment (CPU)", body,
                   {"times": times, "per_segment_us": {r[0]: r[2] for r in rows}})


def _capture_on(platform: Any, h: torch.Tensor, w: torch.Tensor) -> None:
    with session_scope(CaptureSession(platform, breakable=True)):
        workload(h, w, SEGMENTS)


def _capture(g: pb.BreakableGraph, h: torch.Tensor, w: torch.Tensor, stream: Any = None) -> pb.BreakableGraph:
    with pb.breakable_graph(g, stream=stream):
        workload(h, w, SEGMENTS)
    return g


# ----------------------------------------------------------------------------- GPU


class PerSegmentGraphs:
    """One ``torch.cuda.graph`` per segment, breaks run between them (the peer's approach)."""

    def __init__(self) -> None:
        self.items: list[Any] = []
        self.pool = torch.cuda.graph_pool_handle()

    @contextlib.contextmanager
    def segment(self, stream: Any) -> Iterator[None]:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool, stream=stream):
            yield
        self.items.append(g)

    def capture(self, h: torch.Tensor, w: torch.Tensor, stream: Any) -> None:
        for i in range(SEGMENTS):
            with self.segment(stream):
                segment(h, w)
            if i < SEGMENTS - 1:
                clamp_break.__pb_break_point__(h)
                self.items.append(lambda: clamp_break.__pb_break_point__(h))

    def replay(self) -> None:
        for item in self.items:
            item.replay() if isinstance(item, torch.cuda.CUDAGraph) else item()


def gpu_section(quick: bool, deadline: float | None, device: str = "cuda") -> Section:
    """``device``: where the tensors live (a test runs this on the CPU double of torch.cuda)."""
    dim = 1024 if device == "cuda" else 8
    h, w = torch.randn(64, dim, device=device), torch.randn(dim, dim, device=device) / dim**0.5
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up on the capture stream (cuBLAS workspace, kernels)
        for _ in range(3):
            workload(h, w, SEGMENTS)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    peer = _peer_module()
    keep: dict[str, Any] = {}

    def ours() -> float:
        g = pb.BreakableGraph()
        t = _timed(lambda: (_capture(g, h, w, stream), torch.cuda.synchronize()))
        keep["breakable_graph"] = g
        return t

    def per_segment() -> float:
        seq = PerSegmentGraphs()
        t = _timed(lambda: (seq.capture(h, w, stream), torch.cuda.synchronize()))
        keep["per-segment torch.cuda.graph"] = seq
        return t

    variants: dict[str, Callable[[], float]] = {"breakable_graph": ours, "per-segment torch.cuda.graph": per_segment}
    if peer is not None:
        @peer.no_graph
        def peer_clamp(x: torch.Tensor) -> None:
            x.clamp_(-4.0, 4.0)

        def peer_workload() -> None:
            for _ in range(SEGMENTS - 1):
                segment(h, w)
                peer_clamp(h)
            segment(h, w)

        def peer_capture() -> float:
            g = peer.BreakableCUDAGraph()
            def run() -> None:
                with peer.breakable_graph(g, stream=stream):
                    peer_workload()
                torch.cuda.synchronize()
            t = _timed(run)
            keep["breakable-cuda-graphs"] = g
            return t

        variants["breakable-cuda-graphs"] = peer_capture
    times = _interleaved(variants, 3 if quick else 10, deadline)
    base = times["per-segment torch.cuda.graph"]
    rows = []
    for name, ts in times.items():
        ratios = [b / t for t, b in zip(ts, base)]
        lo, hi = quartiles(ratios)
        rows.append([name, fmt_spread(ts, 1e3, 1), f"{statistics.median(ratios):.2f}x ({lo:.2f}..{hi:.2f})"])
    replay_rows = []
    for name, obj in keep.items():
        reps = []
        for _ in range(20):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            obj.replay()
            torch.cuda.synchronize()
            reps.append(time.perf_counter() - t0)
        replay_rows.append([name, fmt_spread(reps, 1e3, 2)])
    gc.collect()
    body = (
        f"The same workload on cuda: {SEGMENTS} segments (a 64x{dim} by {dim}x{dim} matmul, tanh, scale, copy), an "
        "eager in-place clamp between each pair, captured on one warmed-up side stream. Speed-up: the per-segment "
        "capture's seconds over each variant's, paired per repetition."
        + ("" if peer is not None else " breakable-cuda-graphs is not installed: its row is absent.")
        + "\n\n" + table(["capture", "ms per capture [p25, p75]", "speed-up vs per-segment"], rows)
        + "\n\nReplay of the whole workload (graphs and breaks):\n\n" + table(["captured with", "ms per replay"], replay_rows)
    )
    return Section("Breaks anywhere: capture time with 64 breaks (GPU)", body, {"times": times})


def _peer_module() -> Any:
    try:
        import breakable_cuda_graphs
    except ImportError:
        return None
    return breakable_cuda_graphs


def run(quick: bool = False, deadline: float | None = None, cuda: bool | None = None) -> list[Section]:
    sections = [cpu_section(quick, deadline)]
    if torch.cuda.is_available() if cuda is None else cuda:
        sections.append(gpu_section(quick, deadline))
    return sections


if __name__ == "__main__":
    for s in run(quick="--quick" in sys.argv, cuda=False if "--cpu" in sys.argv else None):
        print(s.markdown())
