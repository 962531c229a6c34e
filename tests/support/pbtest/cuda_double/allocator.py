"""The caching allocators of the CUDA double (tests/support/pbtest/cuda_double/fake.py): graph pools, their use
counts, capture routing and segments, after c10/cuda/CUDACachingAllocator.cpp (CCA), and the
host (pinned memory) allocator's pool registry, after ATen/core/CachingHostAllocator.h (CHA).
Version-dependent rules come from tests/support/pbtest/cuda_double/rules.py."""

from __future__ import annotations

import math
import threading
from typing import TYPE_CHECKING, Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from pbtest.cuda_double.rules import holds

if TYPE_CHECKING:
    from pbtest.cuda_double.fake import Capture, FakeStream

NOT_PERMITTED = "CUDA error: operation not permitted when stream is capturing"


class Segment:
    """One cudaMalloc'd segment; the double never splits one (one allocation each).

    A segment that :meth:`CachingAllocator.empty` made has device memory (``memory``, a CPU
    buffer the segment holds until it is freed back to the driver); while a tensor viewing
    it lives the segment is allocated, as a CUDA block is until its last tensor is freed.
    """

    def __init__(self, address: int, size: int, pool: tuple[int, int], stream: FakeStream, memory: Any = None):
        self.address, self.size, self.pool, self.stream, self.memory = address, size, pool, stream, memory
        self._held, self._user = True, None

    @property
    def allocated(self) -> bool:
        return self._held or (self._user is not None and not self._user.expired())

    @allocated.setter
    def allocated(self, value: bool) -> None:
        self._held, self._user = value, None


class PrivatePool:
    def __init__(self) -> None:
        self.use_count = 1  # CCA create_or_incref_pool: a new pool starts with one use


class HostAllocator:
    """CHA's graph-pool registry (host_pool_registration): CUDAGraph registers its pool here too.
    The pinned blocks themselves are not modelled (a graph of this library allocates none)."""

    def __init__(self) -> None:
        self.pools: dict[tuple[int, int], PrivatePool] = {}
        self.freeable: set[tuple[int, int]] = set()
        self.routing: list[tuple[tuple[int, int], Any]] = []

    def begin_allocate_to_pool(self, pool_id: tuple[int, int], owner: Any) -> None:
        # CHA create_or_incref_pool_under_lock, then the "already recording" check
        if pool_id not in self.pools:
            self.pools[pool_id] = PrivatePool()
        else:
            if self.pools[pool_id].use_count <= 0:
                raise RuntimeError(
                    f"INTERNAL ASSERT FAILED at CachingHostAllocator.h: it->second->use_count > 0 (host pool {pool_id} "
                    "reached 0 uses when its last graph was reset; torch.cuda.graph calls _host_emptyCache() first)"
                )
            self.pools[pool_id].use_count += 1
        if any(p == pool_id for p, _ in self.routing):
            raise RuntimeError("beginAllocateToPool: already recording to mempool_id (host allocator)")
        self.routing.append((pool_id, owner))

    def end_allocate_to_pool(self, pool_id: tuple[int, int]) -> None:
        for i, (p, _) in enumerate(self.routing):
            if p == pool_id:
                del self.routing[i]
                return
        raise RuntimeError("endAllocatePool: not currently recording to mempool_id (host allocator)")

    def release_pool(self, pool_id: tuple[int, int]) -> None:
        pool = self.pools[pool_id]
        pool.use_count -= 1
        if pool.use_count < 0:
            raise RuntimeError("INTERNAL ASSERT FAILED at CachingHostAllocator.h: uc >= 0")
        if pool.use_count == 0:
            self.freeable.add(pool_id)

    def empty_cache(self) -> None:
        # CHA empty_cache: a freeable pool without blocks (all of them here) is erased
        for pool_id in self.freeable:
            del self.pools[pool_id]
        self.freeable.clear()


class CachingAllocator:
    """Mixed into FakeCuda, which provides ``current_stream``, ``captures`` and ``_unsafe``."""

    lock: threading.RLock
    captures: dict[int, Capture]
    _ids: Any

    def __init__(self) -> None:
        self.pools: dict[tuple[int, int], PrivatePool] = {}
        # CCA captures_underway: (pool, filter); the filter is a capture (CUDAGraph capture_begin
        # routes the allocations of streams in that capture) or a thread id (use_mem_pool ->
        # beginAllocateCurrentThreadToPool routes every allocation of that thread, any stream).
        self.routing: list[tuple[tuple[int, int], Capture | int]] = []
        self.segments: list[Segment] = []

    def _create_or_incref(self, pool_id: tuple[int, int]) -> None:
        if pool_id not in self.pools:
            self.pools[pool_id] = PrivatePool()
            return
        pool = self.pools[pool_id]
        if pool.use_count <= 0:  # CCA: "Check this pool is live"; vLLM issue 28426
            raise RuntimeError(f"INTERNAL ASSERT FAILED: it->second->use_count > 0 (pool {pool_id} has no user left)")
        pool.use_count += 1

    def _begin_allocate(self, pool_id: tuple[int, int], cap: Capture | int) -> None:
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
        # CCA release_cached_blocks: free blocks of the default pool, and of private pools only
        # once they are freeable (graph_pools_freeable: use_count fell to 0); a live pool keeps
        # its free blocks cached for its own later allocations, whoever asks for empty_cache.
        with self.lock:
            pool_ids = {p for p in pool_ids if p == (0, 0) or (p in self.pools and self.pools[p].use_count == 0)}
            self.segments = [s for s in self.segments if s.allocated or s.pool not in pool_ids]
            for pid in pool_ids:  # a freeable pool with no segment left is erased
                if self.pools.get(pid) and self.pools[pid].use_count == 0 and not any(s.pool == pid for s in self.segments):
                    del self.pools[pid]

    def empty_cache(self) -> None:
        # empty_cache_skips_routed_pools: no error while a capture routes (routed pools hold a use, so
        # they are not freeable anyway); before that rule CCA asserted captures_underway.empty().
        if self.routing and not holds("empty_cache_skips_routed_pools"):
            raise RuntimeError("INTERNAL ASSERT FAILED: captures_underway.empty()")
        # empty_cache_default_pools_only_outside_capture: the default pools are left alone while anything
        # routes (2.11) or only while the caller's current stream captures (2.13).
        if holds("empty_cache_default_pools_only_outside_capture"):
            skip_default = bool(self.captures) and self.current_stream().capture is not None
        else:
            skip_default = bool(self.routing)
        freeable = {p for p, pool in self.pools.items() if pool.use_count == 0}
        self._free_unused(freeable if skip_default else {(0, 0)} | freeable)

    def empty_pool(self, pool_id: tuple[int, int]) -> None:
        """CCA emptyCache(pool), what ~MemPool runs: synchronize_and_free_events asserts no capture routes."""
        if self.routing:
            raise RuntimeError("INTERNAL ASSERT FAILED: captures_underway.empty()")
        self._free_unused({pool_id})

    def malloc(self, nbytes: int, *, backed: bool = False) -> Segment:
        """An allocation on the current stream (routed to a pool while that stream captures, or
        while a use_mem_pool of this thread is open); ``backed``: with memory (see ``empty``)."""
        stream = self.current_stream()
        with self.lock:
            cap = stream.capture
            pool = self._routed_pool(cap)
            for seg in self.segments:
                fits = seg.pool == pool and seg.size >= nbytes and (seg.memory is not None or not backed)
                if fits and not seg.allocated and seg.stream is stream:  # CCA: free blocks are per stream, any pool
                    seg.allocated = True
                    return seg
            # CCA cudaMallocMaybeCapturing: a cudaMalloc on a *capturing* stream (any thread: the check is
            # the current stream's capture status) runs under a relaxed capture-mode guard; elsewhere it
            # is a plain cudaMalloc, unsafe during a global capture (from any thread) or a thread_local
            # one (from the capturing thread).
            if cap is None:
                self._unsafe("cudaMalloc from a stream outside the capture")
            memory = torch.empty(nbytes, dtype=torch.uint8) if backed else None
            address = memory.data_ptr() if backed else next(self._ids) << 20
            seg = Segment(address, nbytes, pool, stream, memory)
            self.segments.append(seg)
            return seg

    def _routed_pool(self, cap: Capture | None) -> tuple[int, int]:
        # CCA malloc -> get_pool: the first routing entry whose filter accepts this allocation.
        me = threading.get_ident()
        for pool, f in self.routing:
            if (cap is not None and f is cap) or (isinstance(f, int) and f == me):
                return pool
        return (0, 0)

    def empty(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A tensor allocated as a CUDA tensor is: a block (here a whole segment) of the pool
        routing picks, reused once free, allocated while the tensor's storage lives. The tensor
        views the segment's memory without owning it, so graph pools are told apart by address
        as in ``torch.cuda.memory_snapshot()``, and a view kept past the block's free reads
        whatever reused it."""
        nbytes = max(math.prod(shape) * dtype.itemsize, 1)
        seg = self.malloc(nbytes, backed=True)
        storage = torch._C._construct_storage_from_data_pointer(seg.address, torch.device("cpu"), nbytes)
        t = torch.empty(0, dtype=dtype).set_(storage, 0, shape, torch.empty(shape, device="meta").stride())
        seg._held, seg._user = False, StorageWeakRef(t.untyped_storage())
        return t

    def segment_of(self, t: torch.Tensor) -> Segment | None:
        address = t.untyped_storage().data_ptr()
        with self.lock:
            return next((s for s in self.segments if s.address <= address < s.address + s.size), None)

    def allocated_bytes(self, pool_id: tuple[int, int]) -> int:
        with self.lock:
            return sum(s.size for s in self.segments if s.pool == tuple(pool_id) and s.allocated)

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
