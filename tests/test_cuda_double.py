"""The CUDA double's rules (tests/cuda_double.py), checked on the double and, marked cuda, on a GPU.

Each rule is run twice with the same steps: on the double here, and on a real GPU by
scripts/gpu_check.sh, in a process of their own (they leave the allocator as CUDA does after
a failure). If a GPU twin fails, the double is wrong about that rule: fix the double first,
then the platform (tests/test_cuda_platform.py).
"""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

from piecewise_backend.platforms import cuda as cuda_platform
from tests import cuda_double


@pytest.fixture
def fake(monkeypatch):
    return cuda_double.install(monkeypatch)


# ---------------------------------------------------------------- on the double


def test_double_rule_dead_pool_cannot_be_captured_into(fake):
    pool, s = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        g.capture_begin(pool=pool)
        fake.malloc(1 << 20)  # a block of the pool outlives the graph
        fake.launch()
        g.capture_end()
    g.reset()
    with torch.cuda.stream(s), pytest.raises(RuntimeError, match="use_count"):
        torch.cuda.CUDAGraph().capture_begin(pool=pool)


def test_double_rule_invalidated_capture_keeps_routing_until_ended(fake):
    pool, s = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        g.capture_begin(pool=pool)
        with pytest.raises(RuntimeError, match="not permitted when stream is capturing"):
            fake.host_sync()
        with pytest.raises(RuntimeError):
            g.capture_end()
    g.reset()
    assert not torch.cuda.is_current_stream_capturing()
    with torch.cuda.stream(s), pytest.raises(RuntimeError, match="already recording"):
        torch.cuda.CUDAGraph().capture_begin(pool=pool)
    with pytest.raises(RuntimeError, match="captures_underway.empty"):
        torch.cuda.empty_cache()
    torch._C._cuda_endAllocateToPool(0, pool)
    torch.cuda.empty_cache()


def test_double_rule_another_threads_sync_invalidates_a_capture(fake):
    s, errors = torch.cuda.Stream(), []

    def sync():
        try:
            torch.cuda.synchronize()
        except RuntimeError as e:
            errors.append(e)

    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        g.capture_begin(pool=torch.cuda.graph_pool_handle())
        fake.launch()
        t = threading.Thread(target=sync)
        t.start()
        t.join()
        with pytest.raises(RuntimeError):
            g.capture_end()
    assert errors and "capturing" in str(errors[0])


def test_double_rule_an_empty_capture_warns(fake):
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(torch.cuda.Stream()), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        g.capture_begin(pool=torch.cuda.graph_pool_handle())
        g.capture_end()
    assert any(cuda_platform._EMPTY_WARNING in str(c.message) for c in caught)


# Rules of MemPool lifetime and use_mem_pool routing: one set of steps, given an allocator of
# n bytes (the double's ``empty`` here, ``torch.empty(device="cuda")`` on a GPU). 16 MiB each,
# so that on a GPU every allocation is a segment of its own (CCA rounds >= 10 MiB to 2 MiB).
BIG = 16 << 20


def _pool_bytes(pool_id) -> int:
    return sum(s["total_size"] for s in torch.cuda.memory_snapshot() if tuple(s["segment_pool_id"]) == tuple(pool_id))


def _rule_use_mem_pool_routes_and_excludes_a_capture_into_its_pool(alloc) -> None:
    pool, s = torch.cuda.MemPool(), torch.cuda.Stream()
    with torch.cuda.use_mem_pool(pool):
        t = alloc(BIG)  # MP/CCA: beginAllocateCurrentThreadToPool routes this thread's allocations
        assert _pool_bytes(pool.id) == BIG
        # CCA beginAllocateToPool: "already recording to mempool_id" while the thread routes to it
        with torch.cuda.stream(s), pytest.raises(RuntimeError, match="already recording"):
            torch.cuda.CUDAGraph().capture_begin(pool=pool.id)
    assert not torch.cuda.is_current_stream_capturing()
    del t


def _rule_a_pools_blocks_are_freed_only_once_it_is_dead(alloc) -> None:
    pool = torch.cuda.MemPool()
    pool_id = tuple(pool.id)
    with torch.cuda.use_mem_pool(pool):
        kept, dropped = alloc(BIG), alloc(BIG)
    del dropped
    torch.cuda.empty_cache()  # CCA release_cached_blocks: a live pool keeps its free blocks
    assert _pool_bytes(pool_id) == 2 * BIG
    del pool  # ~MemPool: releasePool (no use left), then emptyCache of the pool: its free blocks go
    assert _pool_bytes(pool_id) == BIG
    del kept  # the last block goes back once free, at the next empty_cache
    torch.cuda.empty_cache()
    assert _pool_bytes(pool_id) == 0


def test_double_rule_use_mem_pool_routes_and_excludes_a_capture_into_its_pool(fake):
    _rule_use_mem_pool_routes_and_excludes_a_capture_into_its_pool(lambda n: fake.empty(n, dtype=torch.uint8))


def test_double_rule_a_pools_blocks_are_freed_only_once_it_is_dead(fake):
    _rule_a_pools_blocks_are_freed_only_once_it_is_dead(lambda n: fake.empty(n, dtype=torch.uint8))


# ---------------------------------------------------------------- on a real GPU


def _cuda_bytes(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8, device="cuda")


@pytest.mark.cuda
def test_gpu_rule_use_mem_pool_routes_and_excludes_a_capture_into_its_pool():
    _rule_use_mem_pool_routes_and_excludes_a_capture_into_its_pool(_cuda_bytes)


@pytest.mark.cuda
def test_gpu_rule_a_pools_blocks_are_freed_only_once_it_is_dead():
    _rule_a_pools_blocks_are_freed_only_once_it_is_dead(_cuda_bytes)


@pytest.mark.cuda
def test_gpu_rule_dead_pool_cannot_be_captured_into():
    pool, s = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
    a = torch.randn(64, 64, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        g.capture_begin(pool=pool)
        kept = a @ a  # a block of the pool outlives the graph
        g.capture_end()
    g.reset()  # the pool's last use
    with torch.cuda.stream(s), pytest.raises(RuntimeError, match="use_count"):
        torch.cuda.CUDAGraph().capture_begin(pool=pool)
    del kept


@pytest.mark.cuda
def test_gpu_rule_invalidated_capture_keeps_routing_until_ended():
    pool, s = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
    x = torch.randn(8, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        g.capture_begin(pool=pool)
        with pytest.raises(RuntimeError, match="not permitted when stream is capturing"):
            x.sum().item()
        with pytest.raises(RuntimeError):
            g.capture_end()
    g.reset()
    assert not torch.cuda.is_current_stream_capturing()
    with torch.cuda.stream(s), pytest.raises(RuntimeError, match="already recording"):
        torch.cuda.CUDAGraph().capture_begin(pool=pool)
    with pytest.raises(RuntimeError, match="captures_underway"):
        torch.cuda.empty_cache()
    torch._C._cuda_endAllocateToPool(torch.cuda.current_device(), pool)  # what the platform does
    torch.cuda.empty_cache()
    g2 = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        g2.capture_begin(pool=torch.cuda.graph_pool_handle())
        y = x * 2
        g2.capture_end()
    g2.replay()
    torch.testing.assert_close(y, x * 2)


@pytest.mark.cuda
def test_gpu_rule_another_threads_sync_invalidates_a_capture():
    pool, s, x, errors = torch.cuda.graph_pool_handle(), torch.cuda.Stream(), torch.randn(8, device="cuda"), []

    def sync():
        try:
            torch.cuda.synchronize()
        except RuntimeError as e:
            errors.append(e)

    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        g.capture_begin(pool=pool)
        x.mul_(2)
        t = threading.Thread(target=sync)
        t.start()
        t.join(60)
        with pytest.raises(RuntimeError):
            g.capture_end()
    assert errors and "capturing" in str(errors[0])
    g.reset()
    torch._C._cuda_endAllocateToPool(torch.cuda.current_device(), pool)


@pytest.mark.cuda
def test_gpu_rule_an_empty_capture_warns():
    s = torch.cuda.Stream()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        g.capture_begin(pool=torch.cuda.graph_pool_handle())
        g.capture_end()
    assert any(cuda_platform._EMPTY_WARNING in str(c.message) for c in caught)
