"""The CUDA double's streams, events, graphs and MemPools (see tests/support/pbtest/cuda_double/fake.py, which installs them).

CG is aten/src/ATen/cuda/CUDAGraph.cpp, MP aten/src/ATen/cuda/MemPool.cpp; version-dependent
behaviour follows tests/support/pbtest/cuda_double/rules.py.
"""

from __future__ import annotations

import threading
import warnings
from typing import TYPE_CHECKING, Any

import torch

from pbtest.cuda_double.allocator import NOT_PERMITTED, Segment
from pbtest.cuda_double.rules import cite, holds

if TYPE_CHECKING:
    from pbtest.cuda_double.fake import FakeCuda

INVALIDATED = "CUDA error: operation failed due to a previous error during capture"
IMPLICIT = "CUDA error: operation would make the legacy stream depend on a capturing blocking stream"
WORKSPACE = 32 << 20  # a cuBLAS workspace on Hopper (CTX getChosenWorkspaceSize)
LT_WORKSPACE = 1 << 20  # cuBLASLt's own workspace where it is not unified (CUBLASLT_WORKSPACE_SIZE default)
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
        self.members: set[FakeStream] = {stream}  # streams that joined it (CUDA: they capture until it ends)
        self.thread = threading.get_ident()
        self.workspaces: list[Segment] = []


STREAMS_PER_POOL = 32  # c10/cuda/CUDAStream.cpp kStreamsPerPool
PRIORITY_LEVELS = 4  # c10 max_compile_time_stream_priorities (a Hopper GPU has more levels than that)


class FakeStream:
    """A stream with a vector clock: ``clock[s.id]`` is how far this stream's next work depends on
    stream ``s``'s work (its own entry: the ops it ran). Events carry a copy; waiting merges it.

    ``torch.cuda.Stream()`` hands out one of 32 streams per (device, priority level), round robin
    (stream_pool_of_32): the 33rd "new" stream is the first one again, the same object here."""

    def __new__(cls, device: int | None = None, priority: int = 0, *, _default: bool = False) -> FakeStream:
        fake = current()
        if _default:
            return super().__new__(cls)
        if priority > 0:  # c10 getStreamFromPool: TORCH_CHECK(priority <= 0)
            raise RuntimeError(f"Expected cuda stream priority to be less than or equal to 0, got {priority}")
        index = fake.current_device() if device is None else int(getattr(device, "index", device) or 0)
        level = min(-priority, PRIORITY_LEVELS - 1)
        with fake.lock:
            pool = fake.stream_pools.setdefault((index, level), [])
            count = fake.stream_draws.get((index, level), 0)
            fake.stream_draws[(index, level)] = count + 1
            if len(pool) < STREAMS_PER_POOL:
                stream = super().__new__(cls)
                stream._setup(index, -level, False)
                pool.append(stream)
                return stream
            return pool[count % STREAMS_PER_POOL]

    def __init__(self, device: int | None = None, priority: int = 0, *, _default: bool = False):
        if _default:
            self._setup(current().current_device() if device is None else int(device), 0, True)

    def _setup(self, device: int, priority: int, default: bool) -> None:
        self.device_index = device
        self.id = next(current()._ids)
        self.priority = priority
        self.capture: Capture | None = None
        self.is_default = default
        self.seq = 0
        self.clock: dict[int, int] = {}

    def __eq__(self, other: object) -> bool:  # torch.cuda.Stream compares the stream it wraps
        return isinstance(other, FakeStream) and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)

    def query(self) -> bool:
        """cudaStreamQuery: illegal on a capturing stream; a potentially unsafe call during a capture
        (event_query_unsafe_in_global_capture). Work on the double is done at once: True."""
        fake = current()
        if self.capture is not None:
            fake._invalidate(self.capture, "cudaStreamQuery of a capturing stream")
            raise RuntimeError(NOT_PERMITTED)
        fake._unsafe("cudaStreamQuery")
        return True

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.device_index)

    @property
    def cuda_stream(self) -> int:  # the raw cudaStream_t (what cuBLAS keys its workspaces by)
        return self.id

    def tick(self) -> int:
        """One more operation on this stream (a kernel, a wait node)."""
        self.seq += 1
        self.clock[self.id] = self.seq
        return self.seq

    def covers(self, other: FakeStream, seq: int) -> bool:
        """Whether this stream's next work runs after ``other``'s ``seq``-th operation."""
        return other is self and self.seq >= seq or self.clock.get(other.id, 0) >= seq

    def record_event(self, event: FakeEvent | None = None) -> FakeEvent:
        event = FakeEvent() if event is None else event
        event.record(self)
        return event

    def wait_event(self, event: FakeEvent) -> None:
        event.wait(self)  # torch.cuda.Stream.wait_event is event.wait(self)

    def _wait(self, event: FakeEvent) -> None:
        # CUDA cudaStreamWaitEvent: an event recorded in a capture makes the waiting stream join
        # that capture (a fork); the legacy default stream cannot (cudaErrorStreamCaptureImplicit).
        fake = current()
        with fake.lock:
            cap = event.capture if event.capture is not None and event.capture.id in fake.captures else None
            if cap is not None and self.is_default:
                fake._invalidate(cap, "legacy stream waited on a capturing stream")
                raise RuntimeError(IMPLICIT)
            if cap is not None and self.capture is None:
                self.capture = cap
                cap.members.add(self)
            for sid, seq in event.clock.items():
                self.clock[sid] = max(self.clock.get(sid, 0), seq)
            self.tick()

    def wait_stream(self, other: FakeStream) -> None:
        # torch.cuda.Stream.wait_stream is self.wait_event(other.record_event())
        self.wait_event(other.record_event())

    def synchronize(self, why: str = "cudaStreamSynchronize") -> None:
        if self.capture is not None:
            current()._invalidate(self.capture, why)
            raise RuntimeError(NOT_PERMITTED)

    def __repr__(self) -> str:
        return f"FakeStream(id={self.id}, device={self.device_index}{', default' if self.is_default else ''})"


class FakeEvent:
    """torch.cuda.Event: ``record`` copies the stream's clock (and the capture it records into)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.clock: dict[int, int] = {}
        self.capture: Capture | None = None
        self.stream: FakeStream | None = None

    def record(self, stream: FakeStream | None = None) -> None:
        stream = current().current_stream() if stream is None else stream
        with current().lock:
            self.stream, self.capture, self.clock = stream, stream.capture, dict(stream.clock)
            self.clock[stream.id] = stream.seq

    def wait(self, stream: FakeStream | None = None) -> None:
        (current().current_stream() if stream is None else stream)._wait(self)

    def query(self) -> bool:
        """cudaEventQuery: illegal on an event recorded in an open capture; a potentially unsafe call while
        a capture is underway (event_query_unsafe_in_global_capture). The double's work is done: True."""
        fake = current()
        if self.capture is not None and self.capture.id in fake.captures:
            fake._invalidate(self.capture, "cudaEventQuery of an event recorded in the capture")
            raise RuntimeError(NOT_PERMITTED)
        fake._unsafe("cudaEventQuery")
        return True

    def synchronize(self) -> None:
        if self.capture is not None and self.capture.id in current().captures:  # CUDA: cudaEventSynchronize
            current()._invalidate(self.capture, "cudaEventSynchronize")
            raise RuntimeError(NOT_PERMITTED)


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

    def capture_begin(
        self, pool: tuple[int, int] | None = None, capture_error_mode: str = "global", check_input_liveness: bool = False
    ) -> None:  # check_input_liveness: torch 2.13 torch.cuda.graph passes it (debug checks the double does not model)
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
            fake.captures.pop(cap.id, None)
            # CUDA: every stream that joined must be joined back: the origin's last work depends on its last op
            unjoined = [s for s in cap.members if s is not cap.stream and not cap.stream.covers(s, s.seq)]
            for s in cap.members:
                s.capture = None
            if unjoined:
                cap.invalid = cap.invalid or "unjoined"
                fake.unjoined.extend(unjoined)
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
        self.streams = set(cap.members)  # every stream the capture recorded work of
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
            try:  # a routing the failed capture_end left on
                fake._end_allocate(self.pool_id)
                fake.host.end_allocate_to_pool(self.pool_id)
            except RuntimeError:
                pass
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
