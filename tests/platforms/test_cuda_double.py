"""The CUDA double's rules (tests/support/pbtest/cuda_double/fake.py), checked on the double and, marked cuda, on a GPU.

Each rule is one function of steps run twice: on the double here, once per torch release of
the rule table (tests/support/pbtest/cuda_double/rules.py), and on a real GPU by scripts/gpu_check.sh (its
"rules" step, a process of its own), where it expects what the *installed* torch does. If a
GPU twin fails, the double (or its rule table) is wrong about that rule: fix the table first,
then the platform. The steps never leave a capture open, whatever the outcome: a capture left
open would invalidate everything the process runs after it.
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from collections.abc import Iterator

import pytest
import torch

from piecewise_backend.platforms.cuda import platform as cuda_platform
from pbtest import cuda_double
from pbtest.cuda_double.rules import RULES, holds
from pbtest.helpers import end_failed_capture

RELEASES = [(2, 11), (2, 13)]
BIG = 16 << 20  # on a GPU every allocation of this size is a segment of its own (CCA rounds >= 10 MiB to 2 MiB)


class Device:
    """What the steps do on the device: the double's calls, or real CUDA work."""

    def __init__(self, fake: cuda_double.FakeCuda | None = None) -> None:
        self.fake = fake
        if fake is None:
            self.x = torch.randn(8, device="cuda")
            self.a = torch.randn(256, 256, device="cuda")
            self.b16 = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
            self.bias = torch.randn(64, device="cuda", dtype=torch.bfloat16)

    def alloc(self, n: int) -> torch.Tensor:
        return self.fake.empty(n, dtype=torch.uint8) if self.fake else torch.empty(n, dtype=torch.uint8, device="cuda")

    def work(self) -> None:
        self.fake.launch() if self.fake else self.x.mul_(2)

    def sync(self) -> None:
        self.fake.host_sync() if self.fake else self.x.sum().item()

    def gemm(self, lt: bool = False) -> None:
        """A GEMM; ``lt``: one that runs cuBLASLt (addmm with a bias in bf16)."""
        if self.fake:
            self.fake.gemm(lt=lt)
        elif lt:
            torch.addmm(self.bias, self.b16, self.b16)
        else:
            self.a @ self.a

    def gemm_into(self, out: torch.Tensor | None) -> None:
        """A cuBLAS GEMM into preallocated memory (no allocation, so no cudaMalloc)."""
        self.fake.gemm() if self.fake else torch.mm(self.a, self.a, out=out)

    def pool_allocated(self, pool_id) -> int:
        """Bytes allocated (not merely cached) in the private pool ``pool_id``."""
        if self.fake:
            return self.fake.allocated_bytes(tuple(pool_id))
        torch.cuda.synchronize()
        return sum(b["size"] for s in torch.cuda.memory_snapshot() if tuple(s["segment_pool_id"]) == tuple(pool_id)
                   for b in s["blocks"] if b["state"] == "active_allocated")

    def default_reserved(self) -> int:
        """Bytes the default pool holds from the driver."""
        if self.fake:
            return self.fake.pool_bytes((0, 0))
        return pool_bytes((0, 0))

    def allocated(self) -> int:
        if self.fake:
            return sum(s.size for s in self.fake.segments if s.allocated)
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()


@contextlib.contextmanager
def closed(g: torch.cuda.CUDAGraph, s: torch.cuda.Stream) -> Iterator[None]:
    """Whatever the steps inside raise, the capture on ``s`` is over afterwards."""
    try:
        yield
    finally:
        with torch.cuda.stream(s):
            if torch.cuda.is_current_stream_capturing():
                with contextlib.suppress(RuntimeError):
                    g.capture_end()


def end_routing(pool) -> bool:
    """End the device allocator's routing to ``pool``; False if it was not on."""
    try:
        torch._C._cuda_endAllocateToPool(torch.cuda.current_device(), pool)
        return True
    except RuntimeError as e:
        assert "not currently recording" in str(e)
        return False


def pool_bytes(pool_id) -> int:
    return sum(s["total_size"] for s in torch.cuda.memory_snapshot() if tuple(s["segment_pool_id"]) == tuple(pool_id))


# ---------------------------------------------------------------- the rules, as steps


def rule_dead_pool_cannot_be_captured_into(dev: Device) -> None:
    pool, s, g = torch.cuda.graph_pool_handle(), torch.cuda.Stream(), torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), closed(g, s):
        g.capture_begin(pool=pool)
        kept = dev.alloc(BIG)  # a block of the pool outlives the graph
        dev.work()
        g.capture_end()
    g.reset()  # the pool's last use (device and host)
    with torch.cuda.stream(s), pytest.raises(RuntimeError, match="use_count"):
        torch.cuda.CUDAGraph().capture_begin(pool=pool)
    del kept


def rule_host_pool_use_reaches_zero_when_the_last_graph_is_reset(dev: Device) -> None:
    # A MemPool holds a device use only: once its last graph is reset, the host allocator's entry
    # for the id has 0 uses and the next capture_begin into it asserts there (host_pool_registration).
    mempool, s, g = torch.cuda.MemPool(), torch.cuda.Stream(), torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), closed(g, s):
        g.capture_begin(pool=mempool.id)
        dev.work()
        g.capture_end()
    g.reset()
    g2 = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), closed(g2, s):
        with pytest.raises(RuntimeError, match="use_count > 0"):
            g2.capture_begin(pool=mempool.id)
        assert not torch.cuda.is_current_stream_capturing()
        assert end_routing(mempool.id), "the device routing began before the host assert"
        torch._C._host_emptyCache()  # what torch.cuda.graph does before each capture: the host entry goes
        g3 = torch.cuda.CUDAGraph()
        g3.capture_begin(pool=mempool.id)
        dev.work()
        g3.capture_end()
    g3.replay()


def rule_failed_capture_end_and_routing(dev: Device) -> None:
    pool, s, g = torch.cuda.graph_pool_handle(), torch.cuda.Stream(), torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), closed(g, s):
        g.capture_begin(pool=pool)
        with pytest.raises(RuntimeError, match="not permitted when stream is capturing"):
            dev.sync()
        with pytest.raises(RuntimeError):
            g.capture_end()
    g.reset()
    assert not torch.cuda.is_current_stream_capturing()
    if holds("failed_capture_end_ends_routing"):
        assert not end_routing(pool), "torch >= 2.12 ends the routing before capture_end re-raises"
    else:  # 2.11: still routing; a capture into the pool is refused before it begins
        with torch.cuda.stream(s), pytest.raises(RuntimeError, match="already recording"):
            torch.cuda.CUDAGraph().capture_begin(pool=pool)
        torch.cuda.empty_cache()  # no error while a pool is routed (empty_cache_skips_routed_pools)
        assert end_routing(pool)
    g2 = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), closed(g2, s):
        g2.capture_begin(pool=torch.cuda.graph_pool_handle())
        dev.work()
        g2.capture_end()
    g2.replay()


def rule_another_threads_sync_invalidates_a_capture(dev: Device) -> None:
    pool, s, g, errors = torch.cuda.graph_pool_handle(), torch.cuda.Stream(), torch.cuda.CUDAGraph(), []

    def sync():
        try:
            torch.cuda.synchronize()
        except RuntimeError as e:
            errors.append(e)

    with torch.cuda.stream(s), closed(g, s):
        g.capture_begin(pool=pool)
        dev.work()
        t = threading.Thread(target=sync)
        t.start()
        t.join(60)
        with pytest.raises(RuntimeError):
            g.capture_end()
    assert errors and "capturing" in str(errors[0])
    g.reset()
    assert end_routing(pool) != holds("failed_capture_end_ends_routing")


def rule_an_empty_capture_warns(dev: Device) -> None:
    s, g = torch.cuda.Stream(), torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), closed(g, s), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        g.capture_begin(pool=torch.cuda.graph_pool_handle())
        g.capture_end()
    assert any(cuda_platform._EMPTY_WARNING in str(c.message) for c in caught)


def rule_reset_frees_the_capture_streams_cublas_workspace(dev: Device) -> None:
    s, g = torch.cuda.Stream(), torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        dev.gemm()  # warm: the (handle, stream) workspace exists before the capture
        with closed(g, s):
            g.capture_begin(pool=torch.cuda.graph_pool_handle())
            dev.gemm()
            g.capture_end()
    before = dev.allocated()
    g.reset()
    freed = before - dev.allocated()
    assert (freed > 0) == holds("reset_clears_cublas_workspace"), f"reset() freed {freed} bytes"


def rule_empty_cache_while_a_pool_is_routed(dev: Device) -> None:
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        t = dev.alloc(BIG)
        torch.cuda.empty_cache()  # not an error (only ~MemPool's emptyCache(pool) asserts)
    del t


def rule_concurrent_captures_on_two_streams(dev: Device) -> None:
    # CUDA allows it (one capture at a time is this library's policy, not CUDA's)
    (s1, s2), (g1, g2) = (torch.cuda.Stream(), torch.cuda.Stream()), (torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph())
    with closed(g1, s1), closed(g2, s2):
        with torch.cuda.stream(s1):
            g1.capture_begin(pool=torch.cuda.graph_pool_handle())
            dev.work()
        with torch.cuda.stream(s2):
            g2.capture_begin(pool=torch.cuda.graph_pool_handle())
            dev.work()
            g2.capture_end()
        with torch.cuda.stream(s1):
            g1.capture_end()
    g1.replay()
    g2.replay()


def rule_free_blocks_of_a_private_pool_are_per_stream(dev: Device) -> None:
    pool, (s1, s2) = torch.cuda.MemPool(), (torch.cuda.Stream(), torch.cuda.Stream())
    with torch.cuda.use_mem_pool(pool):
        with torch.cuda.stream(s1):
            t = dev.alloc(BIG)
        del t
        with torch.cuda.stream(s2):
            u = dev.alloc(BIG)  # the free block is s1's: a new segment
        assert pool_bytes(pool.id) == 2 * BIG
        with torch.cuda.stream(s1):
            v = dev.alloc(BIG)  # s1 reuses its own
        assert pool_bytes(pool.id) == 2 * BIG
    del u, v


def rule_legacy_stream_cannot_wait_on_a_capture(dev: Device) -> None:
    # cudaErrorStreamCaptureImplicit at once (a side stream waiting would join the capture instead).
    # Whether CUDA also invalidates the capture is not part of the rule: both endings are cleaned up.
    pool, s, g = torch.cuda.graph_pool_handle(), torch.cuda.Stream(), torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), closed(g, s):
        g.capture_begin(pool=pool)
        dev.work()
        with pytest.raises(RuntimeError):
            torch.cuda.default_stream().wait_stream(s)
        try:
            g.capture_end()
        except RuntimeError:
            end_routing(pool)
    g.reset()


def rule_new_streams_come_from_a_pool_of_32_per_priority(dev: Device) -> None:
    low = [torch.cuda.Stream() for _ in range(33)]
    assert len({s.cuda_stream for s in low[:32]}) == 32 and low[32].cuda_stream == low[0].cuda_stream
    high = [torch.cuda.Stream(priority=-1) for _ in range(32)]
    assert not {s.cuda_stream for s in high} & {s.cuda_stream for s in low}  # one pool per priority level
    with pytest.raises(RuntimeError, match="priority to be less than or equal to 0"):
        torch.cuda.Stream(priority=1)


def rule_cublaslt_workspace_is_the_cublas_one_from_2_12(dev: Device) -> None:
    # On a stream no Lt GEMM ran on yet (this step's own priority level), with its cuBLAS workspace made:
    # a captured Lt GEMM makes a workspace inside the capture (into the graph's pool) only where Lt has its own.
    s, g, pool = torch.cuda.Stream(priority=-2), torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle()
    with torch.cuda.stream(s):
        torch.cuda.current_blas_handle()
        with closed(g, s):
            g.capture_begin(pool=pool)
            dev.gemm(lt=True)
            g.capture_end()
    made = dev.pool_allocated(pool)
    unified = holds("cublaslt_unified_workspace")
    assert (made >= 1 << 20) != unified, f"the capture left {made} bytes allocated in its pool"
    g.replay()


def rule_a_pooled_handle_keeps_its_workspaces_for_the_next_thread(dev: Device) -> None:
    # A thread that ended gave its handle (and the workspaces keyed by it) back: another thread's first GEMM
    # on that stream reserves it and creates nothing, so it runs during another stream's global capture
    # without invalidating it. The second thread is alive before the first ends (a thread of its own).
    s, s2, g = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.CUDAGraph()
    out = None if dev.fake else torch.empty(256, 256, device="cuda")
    errors: list[BaseException] = []
    go = threading.Event()

    def gemm_on_s(wait: bool) -> None:
        try:
            if wait:
                assert go.wait(60)
            with torch.cuda.stream(s):
                dev.gemm_into(out)
        except BaseException as e:  # noqa: BLE001 - reported by the step
            errors.append(e)

    second = threading.Thread(target=gemm_on_s, args=(True,))
    second.start()
    first = threading.Thread(target=gemm_on_s, args=(False,))  # its handle is made and warmed on s
    first.start()
    first.join(60)
    torch.cuda.synchronize()
    time.sleep(0.2)  # the ended thread's thread-local PoolWindow gives its handle back
    with torch.cuda.stream(s2), closed(g, s2):
        g.capture_begin(pool=torch.cuda.graph_pool_handle())
        dev.work()
        go.set()  # outside the capture, on s: legal if it creates nothing
        second.join(60)
        g.capture_end()
    assert not errors, errors
    g.replay()


def rule_empty_cache_frees_the_default_pool_under_a_mempool_routing_from_2_13(dev: Device) -> None:
    torch.cuda.empty_cache()
    t = dev.alloc(BIG)
    del t  # a cached block of the default pool
    before = dev.default_reserved()
    with torch.cuda.use_mem_pool(torch.cuda.MemPool()):
        torch.cuda.empty_cache()
        freed = before - dev.default_reserved()
    assert (freed >= BIG) == holds("empty_cache_default_pools_only_outside_capture"), f"freed {freed} bytes"
    torch.cuda.empty_cache()  # outside any routing: freed on every release
    assert dev.default_reserved() <= before - BIG


def rule_event_and_stream_queries_from_another_thread_during_a_global_capture(dev: Device) -> None:
    other = torch.cuda.Stream()
    event = torch.cuda.Event()
    event.record(other)
    for mode in ("global", "thread_local"):
        s, g, pool = torch.cuda.Stream(), torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle()
        errors: list[str] = []

        def query() -> None:
            for q in (event.query, other.query):
                try:
                    q()
                except RuntimeError as e:
                    errors.append(str(e))

        with torch.cuda.stream(s), closed(g, s):
            g.capture_begin(pool=pool, capture_error_mode=mode)
            dev.work()
            t = threading.Thread(target=query)
            t.start()
            t.join(60)
            failed = False
            try:
                g.capture_end()
            except RuntimeError:
                failed = True
        if failed:
            end_failed_capture(g, pool)
        assert bool(errors) == failed == (mode == "global"), (mode, errors, failed)
        if not failed:
            g.replay()


STEPS = [
    rule_dead_pool_cannot_be_captured_into,
    rule_host_pool_use_reaches_zero_when_the_last_graph_is_reset,
    rule_failed_capture_end_and_routing,
    rule_another_threads_sync_invalidates_a_capture,
    rule_an_empty_capture_warns,
    rule_reset_frees_the_capture_streams_cublas_workspace,
    rule_empty_cache_while_a_pool_is_routed,
    rule_concurrent_captures_on_two_streams,
    rule_free_blocks_of_a_private_pool_are_per_stream,
    rule_legacy_stream_cannot_wait_on_a_capture,
    rule_new_streams_come_from_a_pool_of_32_per_priority,
    rule_cublaslt_workspace_is_the_cublas_one_from_2_12,
    rule_a_pooled_handle_keeps_its_workspaces_for_the_next_thread,
    rule_empty_cache_frees_the_default_pool_under_a_mempool_routing_from_2_13,
    rule_event_and_stream_queries_from_another_thread_during_a_global_capture,
]


# ---------------------------------------------------------------- on the double, per release


@pytest.mark.parametrize("release", RELEASES, ids=[f"torch{a}.{b}" for a, b in RELEASES])
@pytest.mark.parametrize("step", STEPS, ids=[f.__name__[5:] for f in STEPS])
def test_double_rule(step, release):
    with cuda_double.installed(release) as fake:
        step(Device(fake))
        assert not fake.fatal


def test_double_rule_mempool_dropped_while_a_capture_routes_is_fatal():
    # MP ~MemPool runs emptyCache(pool), which asserts no capture routes; thrown from a destructor,
    # that ends the process (std::terminate). Not run on a GPU: it would kill the check.
    with cuda_double.installed() as fake:
        pool, s, g = torch.cuda.MemPool(), torch.cuda.Stream(), torch.cuda.CUDAGraph()
        with torch.cuda.stream(s):
            g.capture_begin(pool=torch.cuda.graph_pool_handle())
            fake.launch()
            del pool
            g.capture_end()
        assert fake.fatal and "terminates" in fake.fatal[0]


def test_every_rule_cites_its_source():
    for name, rule in RULES.items():
        assert any(tag in rule.source for tag in ("CG ", "CCA ", "CHA ", "CTX", "PR ", "c10/", "ATen/", "CUDA runtime")), name


# ---------------------------------------------------------------- on a real GPU (the installed torch)


@pytest.mark.cuda
@pytest.mark.parametrize("step", STEPS, ids=[f.__name__[5:] for f in STEPS])
def test_gpu_rule(step):
    step(Device())
