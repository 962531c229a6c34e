"""The caching allocator part of the CUDA double (tests/cuda_double.py): graph pools, their
use counts, capture routing and segments, after c10/cuda/CUDACachingAllocator.cpp (CCA)."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tests.cuda_double import Capture, FakeStream

NOT_PERMITTED = "CUDA error: operation not permitted when stream is capturing"


class Segment:
    """One cudaMalloc'd segment; the double never splits one (one allocation each)."""

    def __init__(self, address: int, size: int, pool: tuple[int, int], stream: FakeStream):
        self.address, self.size, self.pool, self.stream, self.allocated = address, size, pool, stream, True


class PrivatePool:
    def __init__(self) -> None:
        self.use_count = 1  # CCA create_or_incref_pool: a new pool starts with one use


class CachingAllocator:
    """Mixed into FakeCuda, which provides ``current_stream``, ``captures`` and ``_invalidate``."""

    lock: threading.RLock
    captures: dict[int, Capture]
    _ids: Any

    def __init__(self) -> None:
        self.pools: dict[tuple[int, int], PrivatePool] = {}
        self.routing: list[tuple[tuple[int, int], Capture]] = []  # CCA captures_underway
        self.segments: list[Segment] = []

    def _create_or_incref(self, pool_id: tuple[int, int]) -> None:
        if pool_id not in self.pools:
            self.pools[pool_id] = PrivatePool()
            return
        pool = self.pools[pool_id]
        if pool.use_count <= 0:  # CCA: "Check this pool is live"; vLLM issue 28426
            raise RuntimeError(f"INTERNAL ASSERT FAILED: it->second->use_count > 0 (pool {pool_id} has no user left)")
        pool.use_count += 1

    def _begin_allocate(self, pool_id: tuple[int, int], cap: Capture) -> None:
        self._create_or_incref(pool_id)  # CCA beginAllocateToPool: incref first, then the check
        if any(p == pool_id for p, _ in self.routing):
            raise RuntimeError("beginAllocateToPool: already recording to mempool_id")
        self.routing.append((pool_id, cap))

    def _end_allocate(self, pool_id: tuple[int, int]) -> None:
        with self.lock:
            for i, (p, _) in enumerate(self.routing):
                if p == pool_id:
                    del self.routing[i]
                    return
        raise RuntimeError("endAllocatePool: not currently recording to mempool_id")

    def _release(self, pool_id: tuple[int, int]) -> None:
        with self.lock:
            pool = self.pools[pool_id]
            pool.use_count -= 1
            if pool.use_count < 0:
                raise RuntimeError("INTERNAL ASSERT FAILED: uc >= 0")

    def _free_unused(self, pool_ids: set[tuple[int, int]]) -> None:
        with self.lock:
            self.segments = [s for s in self.segments if s.allocated or s.pool not in pool_ids]
            for pid in pool_ids:  # a freeable pool with no segment left is erased
                if self.pools.get(pid) and self.pools[pid].use_count == 0 and not any(s.pool == pid for s in self.segments):
                    del self.pools[pid]

    def empty_cache(self) -> None:
        # CCA synchronize_and_free_events: TORCH_INTERNAL_ASSERT(captures_underway.empty()).
        if self.routing:
            raise RuntimeError("INTERNAL ASSERT FAILED: captures_underway.empty()")
        self._free_unused({(0, 0)} | {p for p, pool in self.pools.items() if pool.use_count == 0})

    def malloc(self, nbytes: int) -> Segment:
        """An allocation on the current stream (routed to a pool while that stream captures)."""
        stream = self.current_stream()
        with self.lock:
            cap = stream.capture
            pool = next((p for p, c in self.routing if cap is not None and c is cap), (0, 0))
            for seg in self.segments:
                if not seg.allocated and seg.pool == pool and seg.size >= nbytes and (pool != (0, 0) or seg.stream is stream):
                    seg.allocated = True
                    return seg
            # CCA cudaMallocMaybeCapturing: a cudaMalloc on a *capturing* stream runs under a relaxed
            # capture-mode guard; elsewhere it is a plain cudaMalloc, unsafe during a global capture.
            others = [c for c in self.captures.values() if c is not cap and c.mode == "global"]
            if others:
                for c in others:
                    self._invalidate(c, "cudaMalloc from another stream")
                raise RuntimeError(NOT_PERMITTED)
            seg = Segment(next(self._ids) << 20, nbytes, pool, stream)
            self.segments.append(seg)
            return seg

    def free(self, seg: Segment) -> None:
        seg.allocated = False

    def memory_snapshot(self) -> list[dict[str, Any]]:
        with self.lock:
            return [
                {"device": s.stream.device_index, "address": s.address, "total_size": s.size, "stream": s.stream.id,
                 "segment_pool_id": s.pool, "allocated_size": s.size if s.allocated else 0}
                for s in self.segments
            ]

    def memory_reserved(self, device: Any = None) -> int:
        return sum(s.size for s in self.segments)

    def pool_bytes(self, pool_id: tuple[int, int]) -> int:
        return sum(s.size for s in self.segments if s.pool == tuple(pool_id))
