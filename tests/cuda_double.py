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

from tests.cuda_double_allocator import NOT_PERMITTED, CachingAllocator, HostAllocator, Segment
from tests.cuda_double_rules import cite, holds, pinned

INVALIDATED = "CUDA error: operation failed due to a previous error during capture"
IMPLICIT = "CUDA error: operation would make the legacy stream depend on a capturing blocking stream"
WORKSPACE = 32 << 20  # a cuBLAS workspace on Hopper (CTX getChosenWorkspaceSize)
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
        self.workspaces: list[Segment] = []


class FakeStream:
    def __init__(self, device: int | None = None, priority: int = 0, *, _default: bool = False):
        fake = current()
        self.device_index = fake.current_device() if device is None else int(device)
        self.id = next(fake._ids)
        self.capture: Capture | None = None
        self.is_default = _default

    @property
    def cuda_stream(self) -> int:  # the raw cudaStream_t (what cuBLAS keys its workspaces by)
        return self.id

    def wait_stream(self, other: FakeStream) -> None:
        # CUDA: a stream that waits on a capturing stream joins its capture (a fork); the
        # origin stream waiting on it joins it back. cudaStreamEndCapture fails on an unjoined fork.
        fake = current()
        with fake.lock:
            if other.capture is not None and self.is_default:
                # CUDA: the legacy default stream cannot depend on a capturing stream
                fake._invalidate(other.capture, "legacy stream waited on a capturing stream")
                raise RuntimeError(IMPLICIT)
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
        self.stream: FakeStream | None = None
        self.began = self.capture_ended = self.has_graph_exec = False
        self.pool_id: tuple[int, int] | None = None
        self.device = 0
        self.replays = 0
        self.workspaces: list[Segment] = []  # cuBLAS workspaces the captured kernels address

    def capture_begin(self, pool: tuple[int, int] | None = None, capture_error_mode: str = "global") -> None:
        fake = self.fake
        # CG capture_begin: one graph per instance, never on the default stream.
        if self.has_graph_exec:
            raise RuntimeError("This CUDAGraph instance already owns a captured graph. To capture a new graph, create a new instance.")
        stream = fake.current_stream()
        if stream.is_default:
            raise RuntimeError("CUDA graphs must be captured on a non-default stream.")
        self.device, self.stream = fake.current_device(), stream
        with fake.lock:
            if pool is not None and (pool[0] or pool[1]):
                if pool[0] and pool[1]:
                    raise RuntimeError("INTERNAL ASSERT FAILED: !(pool.first && pool.second)")
                self.pool_id = tuple(pool)
            else:
                self.pool_id = (next(fake._ids), 0)  # a private pool of this graph
            # CG: beginAllocateToPool (device, then host) runs *before* cudaStreamBeginCapture, so a
            # failure after it leaves the device routing (and its use) behind.
            cap = Capture(next(fake._ids), stream, self.pool_id, capture_error_mode)
            fake._begin_allocate(self.pool_id, cap)
            self.began = True
            fake.host.begin_allocate_to_pool(self.pool_id, cap)  # host_pool_registration
            # CUDA: a stream captures one sequence at a time (cudaErrorIllegalState). Captures on
            # other streams may run concurrently: one capture at a time is the platform's policy.
            if stream.capture is not None:
                raise RuntimeError(NOT_PERMITTED)
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
            if cap.invalid is not None:
                if holds("failed_capture_end_ends_routing"):  # 2.12+: routing ends before the re-raise
                    fake._end_allocate(self.pool_id)
                    fake.host.end_allocate_to_pool(self.pool_id)
                if cap.invalid == "unjoined":
                    raise RuntimeError("CUDA error: capture sequence contains a fork that was not joined to the primary stream")
                raise RuntimeError(INVALIDATED)
            fake._end_allocate(self.pool_id)
            fake.host.end_allocate_to_pool(self.pool_id)
        if cap.nodes == 0:  # CG: TORCH_WARN on an empty graph
            warnings.warn("The CUDA Graph is empty. This usually means that the graph was attempted to be captured on wrong device or stream.")
        self.workspaces = list(cap.workspaces)
        self.capture_ended = self.has_graph_exec = True

    def replay(self) -> None:
        if not self.capture_ended:  # CG replay
            raise RuntimeError("Called CUDAGraph::replay without a preceding successful capture.")
        for ws in self.workspaces:  # the kernels write the workspace address baked in at capture
            if not self.fake.is_workspace(ws):
                raise RuntimeError(
                    f"CUDA error: an illegal memory access was encountered (the cuBLAS workspace at {ws.address:#x} this "
                    f"graph captured was freed: {cite('reset_clears_cublas_workspace')})"
                )
        self.replays += 1
        self.fake.replays += 1

    def reset(self) -> None:
        fake = self.fake
        self.capture = None
        if self.capture_ended:
            if holds("reset_clears_cublas_workspace"):
                fake.clear_workspaces_for_stream(self.stream)
            fake._release(self.pool_id)
            fake.host.release_pool(self.pool_id)
            self.capture_ended = False
        elif self.began and holds("failed_capture_releases_pool"):
            with contextlib.suppress(RuntimeError):  # a routing the failed capture_end left on
                fake._end_allocate(self.pool_id)
                fake.host.end_allocate_to_pool(self.pool_id)
            fake._release(self.pool_id)
            fake.host.release_pool(self.pool_id)
        self.began = False
        self.has_graph_exec = False

    def pool(self) -> tuple[int, int]:
        if not self.capture_ended:
            raise RuntimeError("Called CUDAGraph::pool() without a preceding successful capture.")
        return self.pool_id

    def __del__(self) -> None:
        try:  # no module globals here: it may run at interpreter exit
            self.reset()
        except Exception:
            pass


class FakeMemPool:
    """MP: the pool object holds one use of its id for its lifetime (``MemPool`` -> createOrIncrefPool),
    on the device allocator only."""

    def __init__(self, allocator: Any = None, use_on_oom: bool = False, no_split: bool = False):
        self.fake = current()
        self.id = (0, next(self.fake._ids))  # user-created ids set the second value
        self.device = self.fake.current_device()
        with self.fake.lock:
            self.fake._create_or_incref(self.id)

    def use_count(self) -> int:
        return self.fake.pools[self.id].use_count if self.id in self.fake.pools else 0

    def __del__(self) -> None:
        fake = self.fake
        try:
            fake._release(self.id)  # MP ~MemPool: releasePool, then emptyCache(id)
        except Exception:
            return
        try:
            fake.empty_pool(self.id)
        except RuntimeError as e:  # thrown from a destructor: std::terminate in real torch
            fake.fatal.append(f"~MemPool {self.id} while a capture routes: the process terminates ({e})")


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
        # CTX cublas_handle_stream_to_workspace: process-wide, keyed by (handle, stream); a handle per thread
        self.workspaces: dict[tuple[int, FakeStream], Segment] = {}
        self.fatal: list[str] = []  # what would have terminated the process (a destructor that threw)
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
        # it, inside the capture (so into the pool) when that stream is capturing. A captured gemm
        # bakes the workspace address into the graph.
        stream = self.current_stream()
        key = (threading.get_ident(), stream)
        if key not in self.workspaces:
            self.workspaces[key] = self.malloc(WORKSPACE)
        if stream.capture is not None:
            stream.capture.workspaces.append(self.workspaces[key])
        self.launch()

    def workspace(self, stream: FakeStream) -> Segment | None:
        """This thread's cuBLAS workspace on ``stream``."""
        return self.workspaces.get((threading.get_ident(), stream))

    def is_workspace(self, seg: Segment) -> bool:
        return seg.allocated and any(w is seg for w in self.workspaces.values())

    def clear_workspaces_for_stream(self, stream: FakeStream | None) -> None:
        # CTX clearCublasWorkspacesForStream: every handle's workspace on that stream goes back to the allocator
        with self.lock:
            for key in [k for k in self.workspaces if k[1] is stream]:
                self.free(self.workspaces.pop(key))

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
    """Patch the double over torch.cuda until ``monkeypatch`` undoes it (a test, or a module with
    ``pytest.MonkeyPatch.context()``: one platform for the whole module, as on a GPU); returns its state."""
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
    from piecewise_backend.platforms import cuda as cuda_platform

    monkeypatch.setattr(cuda_platform, "_platforms", {}, raising=False)  # a fresh platform per install
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
