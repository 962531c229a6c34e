"""A CPU test double of torch.cuda's graph API that enforces CUDA's capture rules.

A test tool, not a platform: :func:`install` patches it over ``torch.cuda`` so that
``platforms/cuda/platform.py`` runs on the CPU and its state machine is checked here. It checks
rules, not values (CPU tensors compute eagerly; a fake replay re-runs nothing; the
simulated platform checks values). Test models act on the "device" through ``launch``,
``malloc``, ``host_sync``, ``gemm`` and ``autotune`` of :func:`current`.

The double is only as good as its fidelity: each rule names its source, version-dependent
rules come from the table in tests/support/pbtest/cuda_double/rules.py (the installed torch's, or one a test
pins), and tests/platforms/test_cuda_double.py runs the same rule steps on the double and on a real GPU.
Streams (per-thread current stream, vector clocks), events (a wait on an event recorded in a
capture forks the waiting stream into it; capture_end fails unless the origin stream waited for
every joined stream's last operation), graphs and MemPools are in tests/support/pbtest/cuda_double/graph.py,
the allocators in tests/support/pbtest/cuda_double/allocator.py. ``launch(writes=, reads=)`` notes a read on a
stream that never waited for the value's producer (``races``), and a launch outside every capture
while one is underway (``stray``: legal, but missing from the graph). CG is
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
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from pbtest.cuda_double import graph as cuda_double_graph
from pbtest.cuda_double.allocator import NOT_PERMITTED, CachingAllocator, HostAllocator, Segment
from pbtest.cuda_double.graph import (  # noqa: F401 (re-exported)
    IMPLICIT,
    INVALIDATED,
    LT_WORKSPACE,
    WORKSPACE,
    Capture,
    FakeCUDAGraph,
    FakeEvent,
    FakeMemPool,
    FakeStream,
    current,
)
from pbtest.cuda_double.rules import holds, pinned


class FakeCuda(CachingAllocator):
    """The device, driver and caching allocator state of one test."""

    def __init__(self, num_devices: int = 2):
        self.num_devices = num_devices
        self.lock = threading.RLock()
        self._ids = itertools.count(1)
        self._local = threading.local()
        self.captures: dict[int, Capture] = {}
        CachingAllocator.__init__(self)
        self.host = HostAllocator()
        # CTX cublas_handle_stream_to_workspace: process-wide, keyed by (handle, stream); cuBLASLt's own map
        # (cublaslt_handle_stream_to_workspace) where its workspace is not the unified one
        self.workspaces: dict[tuple[int, FakeStream], Segment] = {}
        self.lt_workspaces: dict[tuple[int, FakeStream], Segment] = {}
        self.stream_pools: dict[tuple[int, int], list[FakeStream]] = {}  # (device, priority level) -> its 32 streams
        self.stream_draws: dict[tuple[int, int], int] = {}
        self.fatal: list[str] = []  # what would have terminated the process (a destructor that threw)
        self.autotuned: set[Any] = set()
        self.max_concurrent = self.replays = 0
        self.invalidations: list[str] = []
        self._defaults: dict[int, FakeStream] = {}
        # blas_handles_pooled: live thread ident -> the cuBLAS handle it reserved; handles of ended threads
        # wait in free_handles (last released first) with their workspaces, for the next thread
        self.handles: dict[int, int] = {}
        self._owners: dict[int, threading.Thread] = {}
        self.free_handles: list[int] = []
        self.unjoined: list[FakeStream] = []  # streams a capture_end found not joined back
        self.stray: list[tuple[str, FakeStream]] = []  # launches outside every capture while one was underway
        self.races: list[str] = []  # reads of a value whose producing launch the reading stream did not wait for
        self._writes: dict[str, tuple[FakeStream, int]] = {}

    # ---- streams and devices (current stream and device are per thread, as in c10)
    def current_device(self) -> int:
        return getattr(self._local, "device", 0)

    def set_device(self, index: Any) -> None:
        self._local.device = int(getattr(index, "index", index) or 0)

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
    def launch(self, writes: str | None = None, reads: str | None = None) -> None:
        """A kernel launch on the current stream: recorded while it captures. ``writes``/``reads``
        name a value it produces/consumes: a read on a stream that does not wait (by events) for
        the value's producer is a race (:attr:`races`), captured or not."""
        stream = self.current_stream()
        cap = stream.capture
        if cap is not None:
            if cap.invalid is not None:  # CUDA: work on an invalidated capture fails
                raise RuntimeError(INVALIDATED)
            cap.nodes += 1
        elif self.captures:  # legal (torch's streams are non-blocking), but the graph will lack this kernel
            self.stray.append((threading.current_thread().name, stream))
        with self.lock:
            if reads is not None and reads in self._writes:
                producer, seq = self._writes[reads]
                if not stream.covers(producer, seq):
                    self.races.append(f"{reads} read on {stream} before {producer} op {seq} that wrote it")
            seq = stream.tick()
            if writes is not None:
                self._writes[writes] = (stream, seq)

    def host_sync(self, what: str = ".item()") -> None:
        """``.item()``, ``nonzero``...: a sync of the current stream (illegal while it captures)."""
        self.current_stream().synchronize(what)

    def gemm(self, lt: bool = False) -> None:
        """A GEMM on the current stream; ``lt``: one cuBLASLt runs (addmm with a bias, most bf16 GEMMs).
        A captured GEMM bakes the address of its workspace into the graph."""
        stream = self.current_stream()
        workspace = self.lt_workspace() if lt else self.workspaces[(self.blas_handle(), stream)]
        if stream.capture is not None:
            stream.capture.workspaces.append(workspace)
        self.launch()

    def _handle(self) -> int:
        """This thread's cuBLAS handle (DeviceThreadHandlePool, blas_handles_pooled): reserved on its first
        use from the handles ended threads gave back, else created (cublasCreate: a plain cudaMalloc,
        unsafe during a capture, see _unsafe)."""
        me = threading.current_thread()
        with self.lock:
            for h, owner in list(self._owners.items()):  # an ended thread's PoolWindow gave its handle back
                if not owner.is_alive():
                    del self._owners[h]
                    self.handles = {i: k for i, k in self.handles.items() if k != h}
                    self.free_handles.append(h)
            h = self.handles.get(me.ident)
            if h is None or self._owners.get(h) is not me:
                if self.free_handles:
                    h = self.free_handles.pop()
                else:
                    self._unsafe("cublasCreate")
                    h = next(self._ids)
                self.handles[me.ident], self._owners[h] = h, me
            return h

    def blas_handle(self) -> int:
        """torch.cuda.current_blas_handle(): this thread's handle, set up for the current stream.

        cuBLAS keeps one workspace per (handle, stream): the first use on a stream allocates
        it, inside the capture (so into the pool) when that stream is capturing."""
        stream = self.current_stream()
        handle = self._handle()
        if (handle, stream) not in self.workspaces:
            self.workspaces[(handle, stream)] = self.malloc(WORKSPACE)
        return handle

    def lt_workspace(self) -> Segment:
        """The workspace a cuBLASLt GEMM uses (cublaslt_unified_workspace): torch >= 2.12 the cuBLAS one of
        (handle, stream), made if missing; 2.11 its own 1 MiB one per (handle, stream), made by the first Lt
        GEMM there (torch.cuda.current_blas_handle() does not make it)."""
        stream = self.current_stream()
        handle = self._handle()
        key = (handle, stream)
        if holds("cublaslt_unified_workspace"):
            if key not in self.workspaces:
                self.workspaces[key] = self.malloc(WORKSPACE)
            return self.workspaces[key]
        if key not in self.lt_workspaces:
            self.lt_workspaces[key] = self.malloc(LT_WORKSPACE)
        return self.lt_workspaces[key]

    def workspace(self, stream: FakeStream) -> Segment | None:
        """This thread's cuBLAS workspace on ``stream``."""
        return self.workspaces.get((self.handles.get(threading.get_ident()), stream))

    def is_workspace(self, seg: Segment) -> bool:
        return seg.allocated and any(w is seg for m in (self.workspaces, self.lt_workspaces) for w in m.values())

    def clear_workspaces_for_stream(self, stream: FakeStream | None) -> None:
        # CTX clearCublasWorkspacesForStream: every handle's workspaces on that stream (both maps) go back
        with self.lock:
            for m in (self.workspaces, self.lt_workspaces):
                for key in [k for k in m if k[1] is stream]:
                    self.free(m.pop(key))

    def autotune(self, key: Any) -> None:
        # Triton/Inductor autotuning benchmarks configs and syncs on the first call of a shape.
        if key not in self.autotuned:
            self.host_sync("autotuning")
            self.autotuned.add(key)
        self.launch()

    def _unsafe(self, what: str) -> None:
        """A potentially unsafe CUDA call (cudaMalloc outside the caching allocator's relaxed guard) from
        this thread. CUDA (cudaStreamCaptureMode): it fails, and invalidates the capture, if a capture in
        global mode is underway on any thread or one in thread_local mode on this thread; relaxed: never."""
        me = threading.get_ident()
        with self.lock:
            hit = [
                c for c in self.captures.values() if c.mode == "global" or c.mode == "thread_local" and c.thread == me
            ]
            for c in hit:
                self._invalidate(c, what)
        if hit:
            raise RuntimeError(NOT_PERMITTED)

    def _invalidate(self, cap: Capture, why: str) -> None:
        if cap.invalid is None:
            cap.invalid = why
            self.invalidations.append(why)


def install(monkeypatch: pytest.MonkeyPatch, num_devices: int = 2) -> FakeCuda:
    """Patch the double over torch.cuda until ``monkeypatch`` undoes it (a test, or a module with
    ``pytest.MonkeyPatch.context()``: one platform for the whole module, as on a GPU); returns its state."""
    fake = FakeCuda(num_devices)
    monkeypatch.setattr(cuda_double_graph, "_CURRENT", fake)
    cuda = torch.cuda
    patches = {
        "is_available": lambda: True, "is_initialized": lambda: True, "device_count": lambda: fake.num_devices,
        "current_device": fake.current_device, "set_device": fake.set_device,
        "device": fake.device, "get_device_name": lambda d=None: "CUDA double",
        "Stream": FakeStream, "stream": fake.stream, "current_stream": fake.current_stream,
        "default_stream": fake.default_stream, "synchronize": fake.synchronize,
        "is_current_stream_capturing": fake.is_current_stream_capturing,
        "CUDAGraph": FakeCUDAGraph, "Event": FakeEvent,
        "graph_pool_handle": lambda: (0, next(fake._ids)), "MemPool": FakeMemPool,
        "memory_snapshot": lambda *a, **k: fake.memory_snapshot(), "memory_reserved": fake.memory_reserved,
        "empty_cache": fake.empty_cache, "current_blas_handle": fake.blas_handle,
    }
    for name, value in patches.items():
        monkeypatch.setattr(cuda, name, value)
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", lambda device, pool: fake._end_allocate(tuple(pool)), raising=False)
    monkeypatch.setattr(torch._C, "_cuda_releasePool", lambda device, pool: fake._release(tuple(pool)), raising=False)
    monkeypatch.setattr(torch._C, "_host_emptyCache", fake.host.empty_cache, raising=False)
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
    from piecewise_backend.platforms.cuda import platform as cuda_platform
    from piecewise_backend.platforms.cuda import streams as cuda_streams

    monkeypatch.setattr(cuda_platform, "_platforms", {}, raising=False)  # a fresh platform per install
    # the one device op the platform issues itself: a cuBLASLt GEMM that makes a thread's Lt workspace
    monkeypatch.setattr(cuda_streams, "lt_gemm", lambda device: fake.gemm(lt=True))
    monkeypatch.setattr(cuda_streams, "_cleared", {})  # raw stream ids restart with each double
    getattr(platforms.get_platform, "cache_clear", lambda: None)()  # platform code that caches by name only
    return fake


@contextlib.contextmanager
def installed(release: tuple[int, int] | None = None, num_devices: int = 2) -> Iterator[FakeCuda]:
    """The double for longer than a test (a module: one platform throughout, as on a GPU),
    behaving as torch ``release`` does (default: the installed torch)."""
    with pytest.MonkeyPatch.context() as mp, (pinned(release) if release else contextlib.nullcontext()):
        yield install(mp, num_devices)


def check_clean(fake: FakeCuda) -> None:
    """After a test: nothing would have terminated the process, and no capture or routing is left open."""
    assert not fake.fatal, fake.fatal
    assert not fake.captures, f"captures left open: {list(fake.captures.values())}"
    assert not fake.routing and not fake.host.routing or _expected_leftover(fake), (fake.routing, fake.host.routing)


def _expected_leftover(fake: FakeCuda) -> bool:
    # torch 2.11 leaves the host allocator routing to a failed capture's pool on for good (no binding ends it)
    return not fake.routing and not holds("failed_capture_end_ends_routing")


def per_release_fixture() -> Any:
    """A module-scoped ``double`` fixture: the module runs once per torch release whose rules differ
    (2.11, 2.13), on one double for the whole module, as one process-wide platform is on a GPU."""

    @pytest.fixture(scope="module", params=[(2, 11), (2, 13)], ids=["torch2.11", "torch2.13"])
    def double(request: Any) -> Iterator[FakeCuda]:
        with installed(request.param) as fake:
            yield fake

    return double

