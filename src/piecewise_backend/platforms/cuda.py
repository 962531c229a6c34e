"""CUDA platform: torch.cuda.CUDAGraph segments in one shared pool per device, on a side stream.

The rules it keeps (each one checked on the CPU against ``tests/cuda_double.py``):

* Captures go to a pool the platform holds. A graph pool is alive only while something uses
  it (each ``capture_begin`` adds a use, each graph's reset drops one), and capturing into
  an id whose uses fell to 0 trips an allocator INTERNAL ASSERT. A ``torch.cuda.MemPool``
  held by the platform keeps one use, so a failed capture can be followed by another, and a
  pool the platform drops (see ``release_cached``) is never captured into again.
* A capture CUDA invalidated (a host sync, another thread's sync or cudaMalloc, an
  unjoined side stream) fails in ``capture_end`` before the allocator stops routing to the
  pool. The platform ends that routing, drops the graph and moves later captures to a fresh
  pool (graphs already captured keep theirs). If that cannot be done it refuses every later
  capture with an error that says so, instead of failing obscurely.
* Warm-ups run on the capture stream (cuBLAS workspaces are per stream), and a lazy capture
  warms up first (Inductor/Triton autotuning syncs, which a capture forbids).
* One capture at a time per process (global capture mode): captures, warm-ups on the capture
  stream and ``memory()`` (a device sync) wait for an open capture of another thread.
* Between the segments of a capture (while its eager breaks run) the capturing thread
  allocates from the pool too (``torch.cuda.use_mem_pool``), so a break's fresh result is
  pool memory that entries hold weakly, like the graphs' own tensors, instead of pinning a
  block per captured size. The routing ends before the next segment's ``capture_begin``
  (which refuses a pool something already routes to).
* ``release_cached()`` (called by ``clear_graphs()``) retires a pool no graph uses any more:
  the platform drops its ``MemPool``, the allocator frees the pool's free blocks and, once
  freed, the blocks a live tensor still holds; the next capture gets a fresh pool. A pool a
  graph still uses keeps its free blocks cached (CUDA frees them only when the pool dies).
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
        self.platform._route_breaks()  # a break may follow: its results come from the pool too
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
        # torch.cuda.MemPool: the current one last; before it, pools graphs captured before an
        # invalidated capture still use
        self.pools: list[Any] = []
        self._retired: set[tuple[int, int]] = set()  # dropped pools whose blocks may still be held
        self.broken: str | None = None
        self._local = threading.local()
        self._new_pool()

    @property
    def pool_id(self) -> tuple[int, int]:
        """The id of the pool the next capture allocates from."""
        return tuple(self.pools[-1].id)

    def _new_pool(self) -> None:
        with torch.cuda.device(self.device):
            pool = torch.cuda.MemPool()  # holds a use of its id while the platform holds it
        self.pools.append(pool)

    def _route_breaks(self) -> None:
        if getattr(self._local, "routing", None) is None:
            routing = torch.cuda.use_mem_pool(self.pools[-1], device=self.device)
            routing.__enter__()  # a use of the pool and a current-thread routing to it, until _stop_routing
            self._local.routing = routing

    def _stop_routing(self) -> None:
        routing, self._local.routing = getattr(self._local, "routing", None), None
        if routing is not None:
            routing.__exit__(None, None, None)

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
                    try:
                        yield
                    finally:
                        self._stop_routing()
            finally:
                _open.captures -= 1
                self._local.warmed = False

    @contextlib.contextmanager
    def _capture_stream(self) -> Iterator[None]:
        if not gc_managed():
            gc.collect()  # once per capture call, never per segment (it dominated capture time in vLLM)
        with torch.cuda.device(self.device):
            torch.cuda.synchronize()
            with self._on_stream():
                yield

    @contextlib.contextmanager
    def _on_stream(self) -> Iterator[None]:
        """Run on the capture stream, after the current stream's work and before what follows it."""
        current = torch.cuda.current_stream()
        self.stream.wait_stream(current)
        try:
            with torch.cuda.stream(self.stream):
                yield
        finally:
            current.wait_stream(self.stream)

    @contextlib.contextmanager
    def warmup_scope(self) -> Iterator[None]:
        """Run eager warm-up work on the capture stream, so per-stream state (the cuBLAS
        workspace, lazily initialized handles) exists before the capture, outside the pool."""
        self._usable()
        with _exclusive("warming up"), torch.cuda.device(self.device), self._on_stream():
            yield
        self._local.warmed = True  # consumed by the next capture on this thread, or by warmed_step's end

    @contextlib.contextmanager
    def warmed_step(self) -> Iterator[None]:
        """Around a caller's warm-ups and the capture they prepare (the runner's step for one
        descriptor): the warm-up mark ends with it, also when the step replayed instead of
        capturing, so it never lets a later capture of another shape skip its warm-up."""
        try:
            yield
        finally:
            self._local.warmed = False

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
        with self.warmed_step():  # the capture follows at once; if it cannot start, no mark is left
            for _ in range(times):
                with self.warmup_scope(), set_forward_context(CUDAGraphMode.NONE, desc, **attrs):
                    fn(*args, **kwargs)

    def begin(self) -> _CudaRecorder:
        self._stop_routing()  # capture_begin into a pool a thread still routes to fails
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
        held = {tuple(s["segment_pool_id"]) for s in segments}
        self._retired &= held  # a retired pool is gone once its last segment is
        ids = {tuple(p.id) for p in self.pools} | self._retired
        return sum(s["total_size"] for s in segments if tuple(s["segment_pool_id"]) in ids)

    def _drop(self, pools: list[Any]) -> None:
        self._retired.update(tuple(p.id) for p in pools)
        self.pools = [p for p in self.pools if all(p is not q for q in pools)]

    def release_cached(self) -> int:
        """Give back the graph memory no graph uses (see the module docstring); returns the
        bytes the allocator released."""
        if getattr(_open, "captures", 0):
            return 0  # inside a capture the pool is in use, and empty_cache is not allowed
        if not gc_managed():
            gc.collect()  # a graph in a reference cycle holds its pool until it is collected
        with _exclusive("releasing graph memory"), torch.cuda.device(self.device):
            before = torch.cuda.memory_reserved(self.device)
            # the platform's MemPool holds one use; a captured graph (or a routing) holds another
            current = self.pools[-1]
            self._drop([p for p in self.pools if p.use_count() <= 1])
            if not self.pools or self.pools[-1] is not current:
                self._new_pool()  # never back into an older pool (one kept after an invalidated capture)
            del current
            # dropped MemPools are gone now (~MemPool: releasePool, then emptyCache of the pool)
            torch.cuda.empty_cache()
            return before - torch.cuda.memory_reserved(self.device)

    @contextlib.contextmanager
    def fresh_pool(self) -> Iterator[tuple[int, int]]:
        """Capture into a new pool for the duration (the estimate's scratch pool); yields its id
        (not the MemPool: a caller holding it would keep release_cached() from retiring it).
        Afterwards the pools held before are current again; the new one lives on only in
        graphs still captured into it."""
        saved = list(self.pools)
        self._new_pool()
        try:
            yield self.pool_id
        finally:
            self._retired.update(tuple(p.id) for p in self.pools if all(p is not q for q in saved))
            self.pools = saved

    def describe(self, amount: int) -> str:
        return f"{amount / 2**20:.1f} MiB in the CUDA graph pool of cuda:{self.device}"
