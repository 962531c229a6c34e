"""CUDA platform: torch.cuda.CUDAGraph segments in one shared pool per device, on a side stream.

The rules it keeps (each one checked on the CPU against ``tests/cuda_double.py``):

* The pool lives as long as the platform. A graph pool is alive only while something uses
  it (each ``capture_begin`` adds a use, each graph's reset drops one), and capturing into
  an id whose uses fell to 0 trips an allocator INTERNAL ASSERT. A ``torch.cuda.MemPool``
  held by the platform keeps one use, so ``clear_graphs()`` or a failed capture can be
  followed by another capture.
* A capture CUDA invalidated (a host sync, another thread's sync or cudaMalloc, an
  unjoined side stream) fails in ``capture_end`` before the allocator stops routing to the
  pool. The platform ends that routing, drops the graph and moves later captures to a fresh
  pool (graphs already captured keep theirs). If that cannot be done it refuses every later
  capture with an error that says so, instead of failing obscurely.
* Warm-ups run on the capture stream (cuBLAS workspaces are per stream), and a lazy capture
  warms up first (Inductor/Triton autotuning syncs, which a capture forbids).
* One capture at a time per process (global capture mode): captures, warm-ups on the capture
  stream and ``memory()`` (a device sync) wait for an open capture of another thread.
* ``memory()`` is the bytes held by the platform's pools, measured on the pools themselves.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..capture import gc_managed  # capture.bulk_capture() owns gc during a bulk capture
from ..context import _CONTEXT, set_forward_context
from ..modes import CUDAGraphMode
from ..observability import logger

_platforms: dict[int, CudaPlatform] = {}
_platforms_lock = threading.Lock()
# CUDA's capture mode is per process and the capture stream is shared: a capture, a warm-up on
# that stream and memory()'s device sync each hold this, so another thread's warm-up (run on the
# stream being captured) or sync waits instead of joining or invalidating an open capture.
_device_lock = threading.RLock()
_WAIT_S = 600.0
_open = threading.local()  # .captures: captures open on this thread

_EMPTY_WARNING = "CUDA Graph is empty"
_RULES = (
    "keep host syncs (.item(), nonzero, torch.cuda.synchronize), other threads' GPU work and unjoined "
    "side streams out of a capture (see 'CUDA rules' in docs/troubleshooting.md)"
)


@contextlib.contextmanager
def _exclusive(what: str) -> Iterator[None]:
    if not _device_lock.acquire(timeout=_WAIT_S):
        raise RuntimeError(
            f"waited {_WAIT_S:.0f} s for another thread's CUDA graph capture before {what}: CUDA allows one capture "
            "at a time per process; capture from one thread, or make sure the other capture can finish"
        )
    try:
        yield
    finally:
        _device_lock.release()


def platform_for(device: int) -> CudaPlatform:
    """The CUDA platform of ``device`` (one per device per process)."""
    with _platforms_lock:
        if device not in _platforms:
            _platforms[device] = CudaPlatform(device)
        return _platforms[device]


class CaptureInvalidatedError(RuntimeError):
    """CUDA invalidated a capture; the platform recovered and the next capture can run."""


class _EmptyGraph:
    """A segment in which CUDA recorded no work (only views between two breaks)."""

    def replay(self) -> None:
        pass


class _CudaRecorder:
    def __init__(self, platform: CudaPlatform):
        self.platform, self.pool = platform, platform.pool_id
        self.graph = torch.cuda.CUDAGraph()
        self.done = False
        try:
            self.graph.capture_begin(pool=self.pool)
        except BaseException as e:
            self.done = True
            platform._recover(self.graph, self.pool, e)
            raise

    def _capture_end(self) -> None:
        with torch.cuda.stream(self.platform.stream):  # capture must end on the stream it began on
            self.graph.capture_end()

    def end(self) -> torch.cuda.CUDAGraph | _EmptyGraph:
        self.done = True
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                self._capture_end()
        except Exception as e:
            self.platform._recover(self.graph, self.pool, e)
            raise CaptureInvalidatedError(
                f"CUDA invalidated this graph capture ({e}); an illegal operation ran while it was open. "
                f"The platform released the capture and later captures use a fresh pool: {_RULES}, then capture again"
            ) from e
        empty = False
        for w in caught:
            if _EMPTY_WARNING in str(w.message):
                empty = True
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        if empty:  # CUDA warns on every capture of an empty graph; there is nothing to replay
            self.graph.reset()
            return _EmptyGraph()
        return self.graph

    def abort(self) -> None:
        if self.done:
            return
        self.done = True
        try:
            self._capture_end()
        except Exception as e:  # the capture was invalidated (the usual cause of the abort)
            self.platform._recover(self.graph, self.pool, e)
        else:
            with contextlib.suppress(Exception):
                self.graph.reset()


class CudaPlatform:
    name = "cuda"

    def __init__(self, device: int = 0) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)  # capture off the default stream, as CUDA requires
        self.pools: list[Any] = []  # torch.cuda.MemPool: the current one last, retired ones before it
        self.pool_id: tuple[int, int] = (0, 0)
        self.broken: str | None = None
        self._local = threading.local()
        self._new_pool()

    def _new_pool(self) -> None:
        with torch.cuda.device(self.device):
            pool = torch.cuda.MemPool()  # holds a use of its id for the platform's lifetime
        self.pools.append(pool)
        self.pool_id = tuple(pool.id)

    def _usable(self) -> None:
        if self.broken is not None:
            raise RuntimeError(self.broken)

    @contextlib.contextmanager
    def capture_scope(self) -> Iterator[None]:
        self._usable()
        with _exclusive("capturing"):
            _open.captures = getattr(_open, "captures", 0) + 1
            try:
                with self._capture_stream():
                    yield
            finally:
                _open.captures -= 1
                self._local.warmed = False

    @contextlib.contextmanager
    def _capture_stream(self) -> Iterator[None]:
        if not gc_managed():
            gc.collect()  # once per capture call, never per segment (it dominated capture time in vLLM)
        with torch.cuda.device(self.device):
            torch.cuda.synchronize()
            current = torch.cuda.current_stream()
            self.stream.wait_stream(current)
            try:
                with torch.cuda.stream(self.stream):
                    yield
            finally:
                current.wait_stream(self.stream)  # order the capture stream's eager work before what follows

    @contextlib.contextmanager
    def warmup_scope(self) -> Iterator[None]:
        """Run eager warm-up work on the capture stream, so per-stream state (the cuBLAS
        workspace, lazily initialized handles) exists before the capture, outside the pool."""
        self._usable()
        with _exclusive("warming up"), torch.cuda.device(self.device):
            current = torch.cuda.current_stream()
            self.stream.wait_stream(current)
            try:
                with torch.cuda.stream(self.stream):
                    yield
            finally:
                current.wait_stream(self.stream)
        self._local.warmed = True  # consumed by the next capture on this thread

    def warm_up(self, fn: Callable[..., Any], args: tuple, kwargs: dict, times: int) -> None:
        """Before a lazy capture: run ``fn`` ``times`` times eagerly (runtime mode NONE) on the
        capture stream, unless this thread warmed up since its last capture.

        Side effect: the step runs ``times`` extra times with the same inputs; state it
        updates in place (a counter, an accumulating cache) moves that many steps further.
        """
        if getattr(self._local, "warmed", False):
            return
        ctx = _CONTEXT.get()
        desc = ctx.batch_descriptor if ctx is not None else None
        attrs = {k: v for k, v in vars(ctx).items() if not k.startswith("_") and k != "batch_descriptor"} if ctx else {}
        for _ in range(times):
            with self.warmup_scope(), set_forward_context(CUDAGraphMode.NONE, desc, **attrs):
                fn(*args, **kwargs)

    def begin(self) -> _CudaRecorder:
        return _CudaRecorder(self)

    def _recover(self, graph: torch.cuda.CUDAGraph, pool: tuple[int, int], error: BaseException) -> None:
        """After a capture that failed inside CUDA: stop the allocator routing to ``pool`` (a
        failed capture_end skips that, and reset() skips releasing the pool), drop the graph,
        and move to a fresh pool. Refuse later captures if the state cannot be restored."""
        with contextlib.suppress(Exception):
            graph.reset()
        problems = []
        try:
            torch._C._cuda_endAllocateToPool(self.device, pool)
        except Exception as e:  # RuntimeError, or AttributeError from a torch without the binding
            if "not currently recording" not in str(e):
                problems.append(f"ending the allocator's routing to pool {pool} failed ({e})")
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            if torch.cuda.is_current_stream_capturing():
                problems.append("the capture stream is still capturing")
        if problems:
            self.broken = (
                f"CUDA graph capture on cuda:{self.device} cannot be used again in this process: a capture failed "
                f"({error}) and {'; '.join(problems)}. Restart the process; to prevent it, {_RULES}"
            )
            raise RuntimeError(self.broken) from error
        self._new_pool()
        logger.warning("CUDA graph capture failed (%s); allocator routing ended, later captures use pool %s", error, self.pool_id)

    def memory(self) -> int:
        """Bytes of the platform's graph pools, after a synchronize (warm-up activations, the
        default pool's cache and other runners' pools are not counted)."""
        with _exclusive("measuring memory"), torch.cuda.device(self.device):
            if getattr(_open, "captures", 0):
                raise RuntimeError("CudaPlatform.memory() synchronizes the device, which invalidates an open capture; call it outside captures")
            torch.cuda.synchronize()
            segments = torch.cuda.memory_snapshot()
        ids = {tuple(p.id) for p in self.pools}
        return sum(s["total_size"] for s in segments if tuple(s["segment_pool_id"]) in ids)

    def describe(self, amount: int) -> str:
        return f"{amount / 2**20:.1f} MiB in the CUDA graph pool of cuda:{self.device}"
