"""Graph memory on the CUDA platform (capture/memory.py with platforms/cuda/platform.py), against the CPU double.

What a real GPU does and the double models (tests/support/pbtest/cuda_double/fake.py): a capture's tensors are
blocks of the platform's graph pool, so entries hold them weakly and a later capture reuses
them; breaks run between segments, where no capture routes the allocator, so the platform
routes them to the pool itself. A pool's free blocks go back to the driver only once the
pool is dead (no MemPool and no graph uses it). tests/gpu/test_cuda.py has the real-GPU twins.
One platform for the module (as on a GPU), once per torch release of the double's rule table.
"""

from __future__ import annotations

import pytest
import torch

import piecewise_backend as pb
from piecewise_backend.capture import EagerSegment
from piecewise_backend.capture.memory import fresh_pool
from piecewise_backend.platforms import base as platforms_base
from piecewise_backend.platforms.cuda import platform as cuda_platform
from piecewise_backend.platforms import get_platform
from piecewise_backend.weak import is_weak
from pbtest import cuda_double
from pbtest.helpers import run

M = pb.CUDAGraphMode
D4, D8 = pb.BatchDescriptor(4), pb.BatchDescriptor(8)
CFG = pb.CompilationConfig(platform="cuda", compile_pieces="eager", num_warmups=0)


double = cuda_double.per_release_fixture()


@pytest.fixture
def fake(double, monkeypatch):
    monkeypatch.setattr(platforms_base, "_gc_probe", [lambda: True])  # no gc.collect per capture
    get_platform("cuda").release_cached()  # each test measures from a platform without dead graphs
    yield double
    cuda_double.check_clean(double)


@pb.eager_break
def doubled(x: torch.Tensor) -> torch.Tensor:
    """A break with a fresh result, allocated wherever the allocator routes this thread."""
    return cuda_double.current().empty(*x.shape).copy_(x * 2)


@pb.eager_break
def failing(x: torch.Tensor) -> torch.Tensor:
    cuda_double.current().empty(*x.shape)
    raise KeyError("boom in a break")


class DeviceBreakModel(torch.nn.Module):
    """G E G: each segment allocates its result as a CUDA kernel's output is allocated
    (``empty`` of the double), the break between them returns a fresh tensor."""

    def __init__(self, brk=doubled):
        super().__init__()
        self.brk = brk

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fake = cuda_double.current()
        fake.launch()
        h = self.brk(fake.empty(*x.shape).copy_(x + 1))
        fake.launch()
        return fake.empty(*x.shape).copy_(h - 1)


def x8(n: int = 8) -> torch.Tensor:
    return torch.randn(n, 8)


def platform() -> cuda_platform.CudaPlatform:
    return get_platform("cuda")


def test_break_results_come_from_the_pool_and_pin_nothing(fake):
    w = pb.BreakableCUDAGraphWrapper(DeviceBreakModel(), config=CFG)
    p = platform()
    out = run(w, M.PIECEWISE, D8, x8())
    entry = w.entries[D8]
    (brk,) = [s for s in entry.segments if isinstance(s, EagerSegment)]
    ((_, result),) = brk.fresh
    assert fake.segment_of(result).pool == p.pool_id, "the break's result was allocated outside the graph pool"
    assert is_weak(result) and is_weak(brk.args[0]) and is_weak(entry.output)
    del out
    assert fake.allocated_bytes(p.pool_id) == 0, "the entry pins pool memory"
    # the routing lasts only while the breaks run: nothing routes after the capture
    assert fake.routing == [] and fake.pools[p.pool_id].use_count == 1 + 2  # the MemPool and the two graphs
    assert fake.segment_of(fake.empty(8)).pool == (0, 0)
    # a break that raises during a capture leaves no routing behind either
    w2 = pb.BreakableCUDAGraphWrapper(DeviceBreakModel(failing), config=CFG)
    with pytest.raises(KeyError, match="boom in a break"):
        run(w2, M.PIECEWISE, D8, x8())
    assert fake.routing == [] and fake.segment_of(fake.empty(8)).pool == (0, 0)
    with pb.expect(captures=0):
        run(w, M.PIECEWISE, D8, x8())  # the entry replays (breaks write into the weak views)


def test_graph_memory_does_not_grow_with_the_number_of_sizes(fake):
    # Largest first; each smaller capture reuses the blocks (break results included) the larger one freed.
    w = pb.BreakableCUDAGraphWrapper(DeviceBreakModel(), config=CFG)
    run(w, M.PIECEWISE, D8, x8())
    reserved = fake.memory_reserved()
    for n in (6, 4, 2):
        run(w, M.PIECEWISE, pb.BatchDescriptor(n), x8(n))
    assert len(w.entries) == 4
    assert fake.memory_reserved() == reserved, "a smaller size needed memory of its own: an entry pins blocks"


def test_clear_graphs_returns_the_pool_memory(fake):
    p = platform()
    a, b = (pb.BreakableCUDAGraphWrapper(DeviceBreakModel(), config=CFG) for _ in range(2))
    run(a, M.PIECEWISE, D8, x8())
    kept = run(b, M.PIECEWISE, D4, x8(4))  # the caller keeps b's capture-time output (pool memory)
    pool = p.pool_id
    held = p.memory()
    assert held > 0
    a.clear_graphs()  # b's graphs still use the pool: its free blocks stay cached for them
    assert p.pool_id == pool and p.memory() == held
    with pb.expect(captures=0):
        run(b, M.PIECEWISE, D4, x8(4))
    b.clear_graphs()
    # No graph uses the pool: the platform retired it and the allocator freed its free blocks;
    # only the block the caller still holds is left, counted until it is freed.
    assert p.memory() == fake.segment_of(kept).size, "clear_graphs() did not return the pool's free blocks"
    assert p.pool_id != pool and fake.pools[pool].use_count == 0
    del kept
    torch.cuda.empty_cache()
    assert p.memory() == 0 and pool not in fake.pools
    # capture works again, into the fresh pool (the dead one's id would trip use_count > 0)
    with pb.expect(captures=1):
        run(a, M.PIECEWISE, D8, x8())
    assert p.memory() > 0 and fake.pool_bytes(p.pool_id) == p.memory()


def test_clear_graphs_inside_a_scratch_pool_returns_its_memory(fake):
    # as bench_memory.py and the GPU twins measure: a pool of its own, emptied by clear_graphs()
    p = platform()
    outer = p.pool_id
    w = pb.BreakableCUDAGraphWrapper(DeviceBreakModel(), config=CFG)
    with fresh_pool(p):
        scratch = p.pool_id
        run(w, M.PIECEWISE, D8, x8())
        assert scratch != outer and fake.pool_bytes(scratch) > 0
        w.clear_graphs()
        assert fake.pool_bytes(scratch) == 0 and scratch not in fake.pools, "the scratch pool kept its memory"
        with pb.expect(captures=1):
            run(w, M.PIECEWISE, D8, x8())
        w.clear_graphs()
    assert p.pool_id == outer and fake.pools[outer].use_count == 1
    with pb.expect(captures=1):
        run(w, M.PIECEWISE, D8, x8())
    assert w.entries[D8].segments[0].pool() == outer


def test_estimate_matches_the_capture_and_releases_its_scratch_pool(fake):
    model = DeviceBreakModel()
    cfg = CFG.replace(cudagraph_mode="PIECEWISE", capture_sizes=[4, 8], max_capture_size=8)
    runner = pb.GraphRunner(model, cfg, [pb.StaticInput("x", shape=(8,), dtype=torch.float32)], device="cpu")
    p = platform()
    estimate = runner.estimate_capture_memory()
    assert estimate > 0 and p.memory() == 0 and len(fake.pools) == 1, "the scratch pool outlived the estimate"
    report = runner.capture(progress=False)
    assert report.memory_bytes == estimate
