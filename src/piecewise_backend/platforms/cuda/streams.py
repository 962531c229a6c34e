"""CUDA platform: one capture at a time per process, capture streams, running work on them.

CUDA's default capture mode is global: while a capture is open, another thread's sync or
cudaMalloc invalidates it, and work launched on the stream being captured lands in the graph.
A capture, a warm-up on a capture stream and ``memory()``'s device sync each hold
:func:`exclusive`, so another thread waits instead of joining or invalidating an open capture.
One capture at a time is this library's policy: CUDA itself allows concurrent captures on
different streams (each other's unsafe calls then invalidate both).

``torch.cuda.Stream()`` hands out one of 32 streams per device and priority level, round robin: two
"new" streams can be one stream. What is keyed by a stream (cuBLAS workspaces, a thread's warm-up)
goes by its raw ``cuda_stream``, and :func:`workspaces_cleared` counts how often a stream's cuBLAS
workspaces were freed (a generation ending resets its graphs), so "warmed on this stream" can expire.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import torch

_device_lock = threading.RLock()
_cleared: dict[int, int] = {}  # raw stream -> times its cuBLAS workspaces were freed (pools.py, Generation.end)
_WAIT_S = 600.0
_open = threading.local()  # .captures: captures open on this thread


@contextlib.contextmanager
def exclusive(what: str) -> Iterator[None]:
    if not _device_lock.acquire(timeout=_WAIT_S):
        raise RuntimeError(
            f"waited {_WAIT_S:.0f} s for another thread's CUDA graph capture before {what}: this library runs one "
            "capture at a time per process; capture from one thread, or make sure the other capture can finish"
        )
    try:
        yield
    finally:
        _device_lock.release()


def captures_open() -> int:
    """Captures open on this thread (0 or 1)."""
    return getattr(_open, "captures", 0)


@contextlib.contextmanager
def capture_open() -> Iterator[None]:
    _open.captures = captures_open() + 1
    try:
        yield
    finally:
        _open.captures -= 1


@contextlib.contextmanager
def on_stream(stream: Any) -> Iterator[None]:
    """Run on ``stream``, after the current stream's work and before what follows it."""
    current = torch.cuda.current_stream()
    stream.wait_stream(current)
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        current.wait_stream(stream)


def new_capture_stream(device: int, taken: Iterable[int]) -> Any:
    """A stream for a new generation of graphs, other than the raw streams in ``taken``.

    ``torch.cuda.Stream()`` hands out streams from a small per-device pool, round robin: two
    generations on one raw stream would share cuBLAS workspaces, and the end of one would free
    the other's (see pools.py). Drawing again walks the pool until a free one comes up.
    """
    taken = set(taken)
    for _ in range(256):
        stream = torch.cuda.Stream(device=device)
        if stream.cuda_stream not in taken:
            return stream
    raise RuntimeError(
        f"every pooled CUDA stream of cuda:{device} already carries a live generation of graphs ({len(taken)}); "
        "clear_graphs() on wrappers no longer used, or restart the process"
    )


def new_comm_stream(device: int, compute: Any) -> Any:
    """A stream for micro-batch communication on ``device``, never the raw stream of ``compute``.

    Drawn at high priority: c10 keeps one stream pool per priority, so it cannot be a capture
    stream of a generation (priority 0, :func:`new_capture_stream`) on a GPU with more than one
    priority level, and communication kernels get scheduled ahead of the compute they overlap.
    """
    for _ in range(256):
        stream = torch.cuda.Stream(device=device, priority=-1)
        if stream.cuda_stream != compute.cuda_stream:
            return stream
    raise RuntimeError(
        f"no CUDA stream of cuda:{device} other than the compute stream {compute} is free for communication"
    )


class ForkTracker:
    """Side streams that joined an open capture and were not joined back, to name them when CUDA
    refuses a segment's end ("capture sequence contains a fork that was not joined").

    A stream joins a capture by waiting on an event recorded on a stream of the capture (a fork);
    it is joined back once the capture stream waits on an event recorded on it, directly or
    through another side stream that is joined back. Work a side stream launches after its join
    is not seen (no launch is traced): CUDA still refuses that capture, and the error says so.
    """

    def __init__(self, origin: Any) -> None:
        self.origin = origin.cuda_stream
        self.reset()

    def reset(self) -> None:
        """A segment ended (CUDA checked its joins): start over for the next one."""
        self.members: set[int] = {self.origin}
        self.forked: dict[int, Any] = {}  # raw stream -> the stream object, in fork order
        self.into: dict[int, int] = {}  # side stream -> the side stream that waited on it
        self._events: dict[int, tuple[Any, Any, bool]] = {}  # id -> (event kept alive, stream, capturing)

    def recorded(self, event: Any, stream: Any) -> None:
        self._events[id(event)] = (event, stream, stream.cuda_stream in self.members)

    def waited(self, event: Any, stream: Any) -> None:
        seen = self._events.get(id(event))
        if seen is None or seen[0] is not event:
            return
        _, source, in_capture = seen
        sid, src = stream.cuda_stream, source.cuda_stream
        if in_capture and sid not in self.members:  # a fork: the waiting stream joins the capture
            self.members.add(sid)
            self.forked[sid] = stream
        elif sid == self.origin:
            self._joined(src)
        elif sid in self.forked and src in self.forked and src != sid:
            self.into[src] = sid

    def _joined(self, sid: int) -> None:
        self.forked.pop(sid, None)
        for side in [s for s, target in self.into.items() if target == sid]:
            del self.into[side]
            self._joined(side)

    def unjoined(self) -> list[Any]:
        return list(self.forked.values())


@contextlib.contextmanager
def tracking_forks(origin: Any) -> Iterator[ForkTracker]:
    """For the duration, ``torch.cuda.Event.record`` / ``.wait`` (every Python path of stream
    synchronization: ``Stream.wait_stream``, ``wait_event``, ``record_event`` go through them) also
    tell a :class:`ForkTracker` of the capture on ``origin``."""
    tracker = ForkTracker(origin)
    cls = torch.cuda.Event
    saved = {name: cls.__dict__.get(name) for name in ("record", "wait")}
    record, wait = cls.record, cls.wait

    def traced_record(self: Any, stream: Any = None) -> None:
        stream = torch.cuda.current_stream() if stream is None else stream
        record(self, stream)
        tracker.recorded(self, stream)

    def traced_wait(self: Any, stream: Any = None) -> None:
        stream = torch.cuda.current_stream() if stream is None else stream
        wait(self, stream)
        tracker.waited(self, stream)

    cls.record, cls.wait = traced_record, traced_wait
    try:
        yield tracker
    finally:
        for name, value in saved.items():
            if value is None:
                delattr(cls, name)
            else:
                setattr(cls, name, value)


def note_workspaces_cleared(stream: Any) -> None:
    """``stream``'s cuBLAS workspaces were freed (torch >= 2.12 frees them when a graph captured on it is reset)."""
    _cleared[stream.cuda_stream] = _cleared.get(stream.cuda_stream, 0) + 1


def workspaces_cleared(stream: Any) -> int:
    """How often ``stream``'s cuBLAS workspaces were freed in this process (keys what a warm-up made)."""
    return _cleared.get(stream.cuda_stream, 0)


def lt_gemm(device: int) -> None:
    """One cuBLASLt GEMM on the current stream (addmm with a bias in bf16): makes this thread's Lt workspace
    for the stream, which torch 2.11 keeps apart from the cuBLAS one and makes on the first Lt GEMM only."""
    a = torch.ones(8, 8, device=f"cuda:{device}", dtype=torch.bfloat16)
    torch.addmm(a[0], a, a)


def warm_blas(stream: Any) -> None:
    """This thread's cuBLAS handle and both its workspaces (cuBLAS and cuBLASLt) on ``stream``, outside any capture."""
    with torch.cuda.stream(stream):
        torch.cuda.current_blas_handle()  # the thread's handle (a pooled one or a new one) and its workspace here
        lt_gemm(stream.device_index)
