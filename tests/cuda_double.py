"""A CPU test double of torch.cuda's graph API that enforces CUDA's capture rules.

A test tool, not a platform: :func:`install` patches it over ``torch.cuda`` so that
``platforms/cuda.py`` runs on the CPU and its state machine is checked here. It checks
rules, not values (CPU tensors compute eagerly; a fake replay re-runs nothing; the
simulated platform checks values). Test models act on the "device" through ``launch``,
``malloc``, ``host_sync``, ``gemm`` and ``autotune`` of :func:`current`.

The double is only as good as its fidelity: each rule names its source, and
tests/test_cuda_double.py runs the same rule steps on the double and on a real GPU. CG is
aten/src/ATen/cuda/CUDAGraph.cpp, CCA c10/cuda/CUDACachingAllocator.cpp, MP
aten/src/ATen/cuda/MemPool.cpp; "CUDA" is the runtime's stream-capture rules
(cudaStreamCaptureModeGlobal: a potentially unsafe call from any thread fails and
invalidates the capture; an invalidated capture fails at cudaStreamEndCapture).
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.cuda_double_allocator import NOT_PERMITTED, CachingAllocator, Segment

INVALIDATED = "CUDA error: operation failed due to a previous error during capture"
WORKSPACE = 4 << 20  # a cuBLAS workspace
_CURRENT: FakeCuda | None = None


def current() -> FakeCuda:
    if _CURRENT is None:
        raise RuntimeError("no CUDA double is installed: call tests.cuda_double.install(monkeypatch) first")
    return _CURRENT


class Capture:
    """One stream capture underway (what cudaStreamBeginCapture started)."""

    def __init__(self, cid: int, stream: FakeStream, pool: tuple[int, int], mode: str):
        self.id, self.stream, self.pool, self.mode = cid, stream, pool, mode
        self.nodes = 0
        self.invalid: str | None = None  # why CUDA invalidated it
        self.forks: set[FakeStream] = set()
        self.thread = threading.get_ident()


class FakeStream:
    def __init__(self, device: int | None = None, priority: int = 0, *, _default: bool = False):
        fake = current()
        self.device_index = fake.current_device() if device is None else int(device)
        self.id = next(fake._ids)
        self.capture: Capture | None = None
        self.is_default = _default

    def wait_stream(self, other: FakeStream) -> None:
        # CUDA: a stream that waits on a capturing stream joins its capture (a fork); the
        # origin stream waiting on it joins it back. cudaStreamEndCapture fails on an unjoined fork.
        fake = current()
        with fake.lock:
            if other.capture is not None and self.capture is None:
                self.capture = other.capture
                other.capture.forks.add(self)
            elif self.capture is not None and other in self.capture.forks and self.capture.stream is self:
                self.capture.forks.discard(other)
                other.capture = None

    def synchronize(self, why: str = "cudaStreamSynchronize") -> None:
        if self.capture is not None:
            current()._invalidate(self.capture, why)
            raise RuntimeError(NOT_PERMITTED)

    def __repr__(self) -> str:
        return f"FakeStream(id={self.id}, device={self.device_index}{', default' if self.is_default else ''})"


class FakeCUDAGraph:
    def __init__(self, keep_graph: bool = False):
        self.fake = current()
        self.capture: Capture | None = None
        self.capture_ended = self.has_graph_exec = False
        self.pool_id: tuple[int, int] | None = None
        self.device = 0
        self.replays = 0

    def capture_begin(self, pool: tuple[int, int] | None = None, capture_error_mode: str = "global") -> None:
        fake = self.fake
        # CG capture_begin: one graph per instance, never on the default stream.
        if self.has_graph_exec:
            raise RuntimeError("This CUDAGraph instance already owns a captured graph. To capture a new graph, create a new instance.")
        stream = fake.current_stream()
        if stream.is_default:
            raise RuntimeError("CUDA graphs must be captured on a non-default stream.")
        self.device = fake.current_device()
        with fake.lock:
            if pool is not None and (pool[0] or pool[1]):
                if pool[0] and pool[1]:
                    raise RuntimeError("INTERNAL ASSERT FAILED: !(pool.first && pool.second)")
                self.pool_id = tuple(pool)
            else:
                self.pool_id = (next(fake._ids), 0)  # a private pool of this graph
            # CG: beginAllocateToPool runs *before* cudaStreamBeginCapture, so a failed begin leaves routing on.
            cap = Capture(next(fake._ids), stream, self.pool_id, capture_error_mode)
            fake._begin_allocate(self.pool_id, cap)
            # CUDA: a stream captures one sequence at a time (cudaErrorIllegalState).
            if stream.capture is not None:
                raise RuntimeError(NOT_PERMITTED)
            # torch/cuda/graphs.py (graph.__init__): "only one capture may be underway at a time in
            # the process". Stricter than CUDA itself, which lets the second begin and then fails
            # on the unsafe calls (sync, cudaMalloc) either one makes: both count as invalidated.
            if fake.captures:
                for other in fake.captures.values():
                    fake._invalidate(other, "a second capture began in the process")
                raise RuntimeError(f"{NOT_PERMITTED} (a second capture began while another is underway)")
            stream.capture = cap
            fake.captures[cap.id] = cap
            fake.max_concurrent = max(fake.max_concurrent, len(fake.captures))
            self.capture = cap

    def capture_end(self) -> None:
        fake, cap = self.fake, self.capture
        # CG capture_end: checked before cudaStreamEndCapture (the stream stays capturing).
        if cap is None or fake.current_stream() is not cap.stream:
            raise RuntimeError("Capture must end on the same stream it began on.")
        with fake.lock:
            # CUDA cudaStreamEndCapture: the stream leaves capture mode whatever happened.
            cap.stream.capture = None
            fake.captures.pop(cap.id, None)
            for s in cap.forks:
                s.capture = None
            if cap.forks:
                cap.invalid = cap.invalid or "unjoined"
                raise RuntimeError("CUDA error: capture sequence contains a fork that was not joined to the primary stream")
            # CG: AT_CUDA_CHECK(cudaStreamEndCapture) throws *before* endAllocateToPool: routing stays on.
            if cap.invalid is not None:
                raise RuntimeError(INVALIDATED)
            fake._end_allocate(self.pool_id)
        if cap.nodes == 0:  # CG: TORCH_WARN on an empty graph
            warnings.warn("The CUDA Graph is empty. This usually means that the graph was attempted to be captured on wrong device or stream.")
        self.capture_ended = self.has_graph_exec = True

    def replay(self) -> None:
        if not self.capture_ended:  # CG replay
            raise RuntimeError("Called CUDAGraph::replay without a preceding successful capture.")
        self.replays += 1
        self.fake.replays += 1

    def reset(self) -> None:
        # CG reset: releasePool only when capture_ended_; a failed capture_end leaks its pool use.
        self.capture = None
        if self.capture_ended:
            self.fake._release(self.pool_id)
            self.capture_ended = False
        self.has_graph_exec = False

    def pool(self) -> tuple[int, int]:
        if not self.capture_ended:
            raise RuntimeError("Called CUDAGraph::pool() without a preceding successful capture.")
        return self.pool_id

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.reset()


class FakeMemPool:
    """MP: the pool object holds one use of its id for its lifetime (``MemPool`` -> createOrIncrefPool)."""

    def __init__(self, allocator: Any = None, use_on_oom: bool = False, no_split: bool = False):
        self.fake = current()
        self.id = (0, next(self.fake._ids))  # user-created ids set the second value
        self.device = self.fake.current_device()
        with self.fake.lock:
            self.fake._create_or_incref(self.id)

    def use_count(self) -> int:
        return self.fake.pools[self.id].use_count if self.id in self.fake.pools else 0

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # MP ~MemPool: releasePool, then emptyCache(id)
            self.fake._release(self.id)
            self.fake._free_unused({self.id})


class FakeCuda(CachingAllocator):
    """The device, driver and caching allocator state of one test."""

    def __init__(self, num_devices: int = 2):
        self.num_devices = num_devices
        self.lock = threading.RLock()
        self._ids = itertools.count(1)
        self._local = threading.local()
        self.captures: dict[int, Capture] = {}
        CachingAllocator.__init__(self)
        self.workspaces: dict[FakeStream, Segment] = {}
        self.autotuned: set[Any] = set()
        self.max_concurrent = self.replays = 0
        self.invalidations: list[str] = []
        self._defaults: dict[int, FakeStream] = {}

    # ---- streams and devices (current stream and device are per thread, as in c10)
    def current_device(self) -> int:
        return getattr(self._local, "device", 0)

    @contextlib.contextmanager
    def device(self, index: Any) -> Iterator[None]:
        old = self.current_device()
        self._local.device = old if index is None else int(getattr(index, "index", index) or 0)
        try:
            yield
        finally:
            self._local.device = old

    def default_stream(self, device: Any = None) -> FakeStream:
        index = self.current_device() if device is None else int(getattr(device, "index", device) or 0)
        with self.lock:
            if index not in self._defaults:
                self._defaults[index] = FakeStream(index, _default=True)
            return self._defaults[index]

    def current_stream(self, device: Any = None) -> FakeStream:
        return getattr(self._local, "stream", None) or self.default_stream(device)

    @contextlib.contextmanager
    def stream(self, stream: FakeStream | None) -> Iterator[None]:
        if stream is None:  # torch.cuda.stream(None) is a no-op
            yield
            return
        old = getattr(self._local, "stream", None)
        self._local.stream = stream
        try:
            yield
        finally:
            self._local.stream = old

    def is_current_stream_capturing(self) -> bool:
        return self.current_stream().capture is not None  # an invalidated capture still counts

    def synchronize(self, device: Any = None) -> None:
        # CUDA: cudaDeviceSynchronize is unsafe during a global-mode capture from any thread.
        with self.lock:
            underway = [c for c in self.captures.values() if c.mode == "global" or c.thread == threading.get_ident()]
            for cap in underway:
                self._invalidate(cap, "cudaDeviceSynchronize")
        if underway:
            raise RuntimeError(NOT_PERMITTED)

    # ---- what test models do on the device
    def launch(self) -> None:
        """A kernel launch on the current stream: recorded while it captures."""
        cap = self.current_stream().capture
        if cap is not None:
            if cap.invalid is not None:  # CUDA: work on an invalidated capture fails
                raise RuntimeError(INVALIDATED)
            cap.nodes += 1

    def host_sync(self, what: str = ".item()") -> None:
        """``.item()``, ``nonzero``...: a sync of the current stream (illegal while it captures)."""
        self.current_stream().synchronize(what)

    def gemm(self) -> None:
        # cuBLAS keeps one workspace per (handle, stream): the first gemm on a stream allocates
        # it, inside the capture (so into the pool, for good) when that stream is capturing.
        stream = self.current_stream()
        if stream not in self.workspaces:
            self.workspaces[stream] = self.malloc(WORKSPACE)
        self.launch()

    def autotune(self, key: Any) -> None:
        # Triton/Inductor autotuning benchmarks configs and syncs on the first call of a shape.
        if key not in self.autotuned:
            self.host_sync("autotuning")
            self.autotuned.add(key)
        self.launch()

    def _invalidate(self, cap: Capture, why: str) -> None:
        if cap.invalid is None:
            cap.invalid = why
            self.invalidations.append(why)


def install(monkeypatch: pytest.MonkeyPatch, num_devices: int = 2) -> FakeCuda:
    """Patch the double over torch.cuda for one test; returns its state."""
    fake = FakeCuda(num_devices)
    monkeypatch.setattr(sys.modules[__name__], "_CURRENT", fake)
    cuda = torch.cuda
    patches = {
        "is_available": lambda: True, "device_count": lambda: fake.num_devices,
        "current_device": fake.current_device, "device": fake.device, "get_device_name": lambda d=None: "CUDA double",
        "Stream": FakeStream, "stream": fake.stream, "current_stream": fake.current_stream,
        "default_stream": fake.default_stream, "synchronize": fake.synchronize,
        "is_current_stream_capturing": fake.is_current_stream_capturing,
        "CUDAGraph": FakeCUDAGraph, "graph_pool_handle": lambda: (0, next(fake._ids)), "MemPool": FakeMemPool,
        "memory_snapshot": lambda *a, **k: fake.memory_snapshot(), "memory_reserved": fake.memory_reserved,
        "empty_cache": fake.empty_cache,
    }
    for name, value in patches.items():
        monkeypatch.setattr(cuda, name, value)
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", lambda device, pool: fake._end_allocate(tuple(pool)), raising=False)
    monkeypatch.setattr(torch._C, "_cuda_releasePool", lambda device, pool: fake._release(tuple(pool)), raising=False)
    # torch/cuda/memory.py use_mem_pool (run as it is) calls these through its module globals:
    # CCA beginAllocateToPool with a current-thread filter (incref, "already recording" check),
    # then endAllocateToPool and releasePool (a decref) on exit.
    memory = sys.modules["torch.cuda.memory"]

    def begin_thread(device: int, pool: tuple[int, int]) -> None:
        with fake.lock:
            fake._begin_allocate(tuple(pool), threading.get_ident())

    monkeypatch.setattr(memory, "_cuda_beginAllocateCurrentThreadToPool", begin_thread)
    monkeypatch.setattr(memory, "_cuda_endAllocateToPool", lambda device, pool: fake._end_allocate(tuple(pool)))
    monkeypatch.setattr(memory, "_cuda_releasePool", lambda device, pool: fake._release(tuple(pool)))
    from piecewise_backend import platforms
    from piecewise_backend.platforms import cuda as cuda_platform

    monkeypatch.setattr(cuda_platform, "_platforms", {}, raising=False)  # a fresh platform per test
    getattr(platforms.get_platform, "cache_clear", lambda: None)()  # platform code that caches by name only
    return fake
