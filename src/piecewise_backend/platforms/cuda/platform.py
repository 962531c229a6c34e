"""CUDA platform: torch.cuda.CUDAGraph segments in one shared pool per generation, on a side stream.

It follows what torch's allocators really do on 2.11 and 2.13 (each rule is checked on the CPU
against tests/support/pbtest/cuda_double/fake.py, whose rule table tests/support/pbtest/cuda_double/rules.py cites the sources):

* Graphs are grouped in *generations* (pools.py): one ``torch.cuda.MemPool`` and one capture
  stream each. A graph is destroyed only with its whole generation, since ``reset()`` frees the
  cuBLAS workspace of its capture stream (torch >= 2.12) and would drop the host allocator's
  use of the pool to 0 (the next capture into it would fail an INTERNAL ASSERT).
* A capture CUDA invalidated fails in ``capture_end``; on 2.11 the allocators still route to the
  pool. The platform ends what it can, keeps the pool uses that leak on builds without PR 190348
  bounded (given back when the generation ends, counted in :meth:`CudaPlatform.retired_pools`),
  and moves later captures to a new generation (recovery.py). If it cannot, it refuses every
  later capture with an error that says so.
* Warm-ups run on the capture stream (cuBLAS workspaces are per (handle, stream)), make this
  thread's cuBLAS and cuBLASLt workspaces there (torch 2.11 keeps Lt's apart, made by the first Lt
  GEMM: a FULL-only path would make it inside the capture), and a lazy capture warms up first
  (Inductor/Triton autotuning syncs, which a capture forbids).
* One capture at a time per process (streams.py): captures, warm-ups on the capture stream and
  ``memory()`` (a device sync) wait for an open capture of another thread.
* Between the segments of a capture (while its eager breaks run) the capturing thread allocates
  from the pool too (``torch.cuda.use_mem_pool``), so a break's fresh result is pool memory that
  entries hold weakly. The routing ends before the next segment's ``capture_begin``.
* ``release_cached()`` (called by ``clear_graphs()``) ends the generations none of whose graphs
  is used any more and lets the allocator free their pools; the next capture gets a fresh one.
* ``memory()`` is the bytes held by the platform's pools, retired ones still held included.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ...context import context_attributes, current_forward_context, set_forward_context
from ...modes import CUDAGraphMode
from ...weak import weak_ref_tensor
from ..base import may_collect_garbage
from .graphs import _EMPTY_WARNING, CudaGraphSegment, CudaRecorder, EmptyGraph  # noqa: F401 (re-exported)
from .pools import Generations, PrivatePool
from .recovery import CaptureInvalidatedError  # noqa: F401 (re-exported: pb.CaptureInvalidatedError)
from .streams import capture_open, captures_open, exclusive, on_stream, tracking_forks, warm_blas, workspaces_cleared

_platforms: dict[int, CudaPlatform] = {}
_platforms_lock = threading.Lock()


def platform_for(device: int) -> CudaPlatform:
    """The CUDA platform of ``device`` (one per device per process)."""
    with _platforms_lock:
        if device not in _platforms:
            _platforms[device] = CudaPlatform(device)
        return _platforms[device]


class CudaPlatform:
    name = "cuda"

    def __init__(self, device: int = 0) -> None:
        self.device = device
        self.generations = Generations(device)
        self.broken: str | None = None
        self._local = threading.local()

    @property
    def pool_id(self) -> tuple[int, int]:
        """The id of the pool the next capture allocates from."""
        return self.generations.current.id

    @property
    def stream(self) -> Any:
        """The stream the next capture runs on (the current generation's)."""
        return self.generations.current.stream

    @property
    def pools(self) -> list[Any]:
        """The ``MemPool`` of every generation alive (the current one last)."""
        return [g.mempool for g in self.generations.all()]

    def route_breaks(self) -> None:
        """Between two segments of this thread's capture: allocate from the pool (a break's fresh
        results are pool memory), until the next segment begins."""
        if getattr(self._local, "routing", None) is None:
            routing = torch.cuda.use_mem_pool(self.generations.current.mempool, device=self.device)
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
    def capture_scope(self, collect: bool | None = None) -> Iterator[None]:
        """Around one whole capture; ``collect``: collect garbage first (None: unless a bulk capture manages gc)."""
        self._usable()
        with exclusive("capturing"):
            if collect if collect is not None else may_collect_garbage():
                gc.collect()  # once per capture call, never per segment (it dominated capture time in vLLM)
            with torch.cuda.device(self.device):
                # outside any capture (ending a generation drops its MemPool); the current one stays: this
                # capture's warm-up made its stream's workspace (a gc between them may have freed its graphs)
                self.generations.collect(current=False)
                torch.cuda.synchronize()
                with capture_open():
                    try:
                        with on_stream(self.stream), tracking_forks(self.stream) as self._local.forks:
                            try:
                                yield
                            finally:
                                self._stop_routing()
                    finally:
                        self._local.warmed = self._local.forks = None

    def unjoined_streams(self) -> list[Any]:
        """Side streams that joined this thread's open capture and were not joined back (see ForkTracker)."""
        forks = getattr(self._local, "forks", None)
        return [] if forks is None else forks.unjoined()

    def segment_ended(self) -> None:
        forks = getattr(self._local, "forks", None)
        if forks is not None:
            forks.reset()

    def capture_error_mode(self) -> str:
        """CUDA's stream-capture error mode for this thread's next segment (``breakable_graph`` sets it)."""
        return getattr(self._local, "error_mode", "global")

    def new_pool(self) -> PrivatePool:
        """A private graph pool (a ``pb.BreakableGraph`` of its own): captures use it inside :meth:`capturing_into`."""
        return PrivatePool()

    @contextlib.contextmanager
    def capturing_into(self, pool: PrivatePool, stream: Any = None, capture_error_mode: str = "global") -> Iterator[None]:
        """One capture into ``pool`` (on ``stream``, or the pool's own capture stream), with CUDA's
        ``capture_error_mode``. A pool keeps the stream of its first capture: graphs of one stream share its
        cuBLAS workspace. A capture CUDA invalidated retires the pool's generation; the next one makes a new."""
        if not isinstance(pool, PrivatePool):
            raise TypeError(f"the CUDA platform captures into a PrivatePool (BreakableGraph.pool()), got {type(pool).__name__}")
        gens = self.generations
        with exclusive("switching pools"), torch.cuda.device(self.device):
            if stream is not None:
                _check_stream(stream, self.device)
            if pool.gen is None:
                pool.gen = gens.new_private(pool, stream)
            elif stream is not None and stream.cuda_stream != pool.gen.stream.cuda_stream:
                raise ValueError(
                    f"this graph pool captures on {pool.gen.stream} (the stream of its first capture; graphs of one "
                    f"pool share that stream's cuBLAS workspace), not {stream}: pass stream=None or that stream, or "
                    "give this graph a pool of its own"
                )
            gen, shared = pool.gen, gens.current
            gens.current = gen
        self._local.error_mode = capture_error_mode
        # as torch.cuda.graph: no gc.collect() unless torch asks for one (force_cudagraph_gc)
        collect = bool(getattr(torch.compiler.config, "force_cudagraph_gc", False)) and may_collect_garbage()
        try:
            with self.capture_scope(collect):
                yield
        finally:
            self._local.error_mode = "global"
            with exclusive("switching pools"), torch.cuda.device(self.device):
                if gens.current is not gen:  # a failed capture retired the pool's generation (recovery.py)
                    gens.forget_private(gen)
                    pool.gen = None
                    unused, gens.current = gens.current, shared
                    gens.retire(unused, "made after a failed capture, never used")
                gens.current = shared

    def pool_memory(self, pool: PrivatePool) -> int:
        """Bytes ``pool`` holds (a device sync: call it outside captures)."""
        if pool.gen is None:
            return 0
        with exclusive("measuring memory"), torch.cuda.device(self.device):
            if captures_open():
                raise RuntimeError("CudaPlatform.pool_memory() synchronizes the device, which invalidates an open capture")
            torch.cuda.synchronize()
            return self.generations.pool_bytes(torch.cuda.memory_snapshot()).get(pool.gen.id, 0)

    @contextlib.contextmanager
    def warmup_scope(self) -> Iterator[None]:
        """Run eager warm-up work on the capture stream, so per-stream state (the cuBLAS
        workspace, lazily initialized handles) exists before the capture, outside the pool."""
        self._usable()
        with exclusive("warming up"), torch.cuda.device(self.device):
            if not captures_open():
                self.generations.collect()  # the stream warmed up is the one the capture will use
            stream = self.stream
            with on_stream(stream):
                blas = (threading.get_ident(), stream.cuda_stream, workspaces_cleared(stream))
                if not captures_open() and getattr(self._local, "blas", None) != blas:
                    warm_blas(stream)  # also a path the capture takes but this warm-up does not (FULL-only)
                    self._local.blas = blas
                yield
        self._local.warmed = stream  # consumed by the next capture on this thread, or by warmed_step's end

    @contextlib.contextmanager
    def warmed_step(self) -> Iterator[None]:
        """Around a caller's warm-ups and the capture they prepare (the runner's step for one
        descriptor): the warm-up mark ends with it, also when the step replayed instead of
        capturing, so it never lets a later capture of another shape skip its warm-up."""
        try:
            yield
        finally:
            self._local.warmed = None

    def warm_up(self, fn: Callable[..., Any], args: tuple, kwargs: dict, times: int) -> None:
        """Before a lazy capture: run ``fn`` ``times`` times eagerly (runtime mode NONE) on the
        capture stream, unless this thread warmed up on that stream since its last capture (a new
        generation's stream has no cuBLAS workspace yet: made inside the capture, it would sit in the
        pool for good on torch 2.11, whose reset() never frees it).

        Side effect: the step runs ``times`` extra times with the same inputs; state it
        updates in place (a counter, an accumulating cache) moves that many steps further.
        """
        if getattr(self._local, "warmed", None) is self.stream:
            return
        ctx = current_forward_context()
        desc = ctx.batch_descriptor if ctx is not None else None
        attrs = context_attributes(ctx) if ctx is not None else {}
        with self.warmed_step():  # the capture follows at once; if it cannot start, no mark is left
            for _ in range(times):
                with self.warmup_scope(), set_forward_context(CUDAGraphMode.NONE, desc, **attrs):
                    fn(*args, **kwargs)

    def begin(self) -> CudaRecorder:
        self._stop_routing()  # capture_begin into a pool a thread still routes to fails
        return CudaRecorder(self)

    def memory(self) -> int:
        """Bytes of the platform's graph pools, after a synchronize (warm-up activations, the
        default pool's cache and other runners' pools are not counted)."""
        with exclusive("measuring memory"), torch.cuda.device(self.device):
            if captures_open():
                raise RuntimeError("CudaPlatform.memory() synchronizes the device, which invalidates an open capture; call it outside captures")
            torch.cuda.synchronize()
            return self.generations.memory(torch.cuda.memory_snapshot())

    def retired_pools(self) -> list[tuple[tuple[int, int], int, str]]:
        """(pool id, bytes still held, why) of each pool the platform no longer captures into
        whose memory is not all back (a tensor still views it). ``memory()`` counts them."""
        with exclusive("measuring memory"), torch.cuda.device(self.device):
            return self.generations.retired_pools(torch.cuda.memory_snapshot())

    def leaks(self) -> dict[str, int]:
        """Failed captures in this process, and the host-allocator pool uses they leaked (torch
        without PR 190348 gives them back nowhere; each is bookkeeping, no memory)."""
        g = self.generations
        return {"failed_captures": g.failed_captures, "leaked_host_uses": g.leaked_host_uses}

    def release_cached(self) -> int:
        """Give back the graph memory no graph uses (see the module docstring); returns the
        bytes the allocator released."""
        if captures_open():
            return 0  # inside a capture the pool is in use
        if may_collect_garbage():
            gc.collect()  # a graph in a reference cycle holds its generation until it is collected
        with exclusive("releasing graph memory"), torch.cuda.device(self.device):
            before = torch.cuda.memory_reserved(self.device)
            self.generations.collect()
            torch.cuda.empty_cache()
            return before - torch.cuda.memory_reserved(self.device)

    @contextlib.contextmanager
    def fresh_pool(self) -> Iterator[tuple[int, int]]:
        """Capture into a new generation for the duration (the estimate's scratch pool); yields its
        pool id (not the MemPool: a caller holding it would keep it alive). Afterwards the
        generation held before is current again; the scratch one lives on only in graphs still
        captured into it."""
        with exclusive("switching pools"), torch.cuda.device(self.device):
            self.generations.push_scratch()
        try:
            yield self.pool_id
        finally:
            with exclusive("switching pools"), torch.cuda.device(self.device):
                self.generations.pop_scratch()

    def describe(self, amount: int) -> str:
        return f"{amount / 2**20:.1f} MiB in the CUDA graph pool of cuda:{self.device}"

    def owner_test(self, pool: Any = None) -> Callable[[torch.Tensor], bool]:
        """A test "was this tensor allocated in one of this platform's pools?", from one
        ``torch.cuda.memory_snapshot()`` (call it once per capture, not per tensor): a tensor in one of the
        pools the platform holds is pool memory (the graphs' tensors, and a break's results, which the
        platform routes to the pool while breaks run); a tensor outside them (allocated before the capture,
        or by another thread) stays strongly held, never weakened into memory nobody owns. ``pool`` (a
        private pool) is among them."""
        ids = {tuple(p.id) for p in self.pools}
        ranges = [
            (s["address"], s["address"] + s["total_size"])
            for s in torch.cuda.memory_snapshot()
            if tuple(s.get("segment_pool_id", ())) in ids
        ]

        def owns(t: torch.Tensor) -> bool:
            # by address alone: host and device addresses never overlap (one unified address space)
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                return False
            ptr = t.untyped_storage().data_ptr()
            return any(lo <= ptr < hi for lo, hi in ranges)

        return owns

    def weak_ref(self, t: torch.Tensor, pool: Any = None) -> torch.Tensor:
        """A view of ``t``'s memory that owns none of it (:func:`~piecewise_backend.weak.weak_ref_tensor`)."""
        return weak_ref_tensor(t)


def _check_stream(stream: Any, device: int) -> None:
    if not hasattr(stream, "cuda_stream"):
        raise TypeError(f"stream must be a torch.cuda.Stream or None, got {type(stream).__name__}")
    if stream.device_index != device:
        raise ValueError(f"stream {stream} is on cuda:{stream.device_index}, but this capture runs on cuda:{device}")
    if stream.cuda_stream == torch.cuda.default_stream(device).cuda_stream:
        raise ValueError(
            f"stream {stream} is the default stream: CUDA graphs are captured on a side stream "
            "(pass torch.cuda.Stream(), or stream=None for the pool's own)"
        )
