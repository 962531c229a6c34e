"""The simulated caching allocator: one shared pool, best-fit reuse, liveness by storage."""

from __future__ import annotations

import torch

from piecewise_backend.platforms.simulated.pool import BLOCK, PoolMode, SimPool
from piecewise_backend.weak import is_weak

KIB = 1024


def test_best_fit_reuses_the_smallest_free_block_and_splits_it():
    pool = SimPool()
    big, small = pool.allocate(8 * KIB), pool.allocate(2 * KIB)
    big_ptr, small_ptr = big.data_ptr(), small.data_ptr()
    assert pool.reserved() == 10 * KIB and pool.allocated() == 10 * KIB
    del big, small
    assert pool.allocated() == 0 and pool.reserved() == 10 * KIB  # freed blocks stay cached
    # 1 KiB fits both free blocks: the 2 KiB one is the better fit
    a = pool.allocate(KIB)
    assert a.data_ptr() == small_ptr
    # 6 KiB only fits the 8 KiB block, which is split: its rest serves the next request
    b = pool.allocate(6 * KIB)
    c = pool.allocate(2 * KIB)
    assert b.data_ptr() == big_ptr and c.data_ptr() == big_ptr + 6 * KIB
    assert pool.reserved() == 10 * KIB, "nothing new reserved while free blocks fit"
    d = pool.allocate(3 * KIB)  # nothing fits: a new segment
    assert pool.reserved() == 13 * KIB and pool.owns(_on(d))
    del b, c
    e = pool.allocate(8 * KIB)  # the split halves merged back into one 8 KiB block
    assert e.data_ptr() == big_ptr
    used = pool.allocated()
    tiny = pool.allocate(1)
    assert tiny.nbytes() == 1 and pool.allocated() == used + BLOCK  # blocks are rounded to 512 bytes
    del a, d, e, tiny


def _on(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def test_a_block_lives_while_any_view_of_its_storage_does():
    pool = SimPool()
    t = _on(pool.allocate(KIB)).view(torch.float32)
    view = t[10:20]
    del t
    assert pool.allocated() == KIB, "a view keeps the block"
    weak = pool.weak(view)
    del view
    assert pool.allocated() == 0, "a weak view does not"
    assert is_weak(weak)
    # the freed block is reused: the weak view now reads the new owner's values (as on a GPU)
    again = _on(pool.allocate(KIB)).view(torch.float32)
    again.fill_(7.0)
    assert torch.equal(weak, torch.full((10,), 7.0))
    del again
    # a segment is never given back while a weak view could read it
    assert pool.release_cached() == 0 and pool.reserved() == KIB
    del weak
    assert pool.release_cached() == KIB and pool.reserved() == 0


def test_pool_mode_moves_new_tensors_into_the_pool():
    pool = SimPool()
    x = torch.randn(16, 16)
    before = x.clone()
    with PoolMode(pool):
        y = x @ x  # new tensor: moved into the pool, same values
        view = y[2:]  # a view of a pool tensor stays a view
        x.mul_(2)  # in-place on an older tensor: not an allocation
        parts = torch.ops.aten.split_with_sizes.default(y, [8, 8])
    assert pool.owns(y) and view.data_ptr() == y.data_ptr() + 2 * 16 * 4
    assert torch.equal(y, before @ before) and not pool.owns(x)
    assert all(p.untyped_storage().data_ptr() == y.untyped_storage().data_ptr() for p in parts)
    assert pool.allocated() == 1 * KIB
    del y, view, parts
    assert pool.allocated() == 0
    z = x * 2  # outside the mode: ordinary memory
    assert not pool.owns(z)


def test_pool_mode_keeps_inference_tensors_inference():
    pool = SimPool()
    with torch.inference_mode(), PoolMode(pool):
        y = torch.ones(4) * 3
    assert pool.owns(y) and y.is_inference() and torch.equal(y, torch.full((4,), 3.0))


def test_a_dropped_pool_keeps_the_memory_tensors_still_view():
    from piecewise_backend.platforms.simulated import pool as sim_pool

    pool = SimPool()
    owned = _on(pool.allocate(KIB)).view(torch.float32)
    weak = pool.weak(_on(pool.allocate(KIB)).view(torch.float32))
    owned.fill_(3.0)
    weak.fill_(4.0)
    sim_pool._prune_orphans()
    before = len(sim_pool._orphans)
    del pool
    assert len(sim_pool._orphans) == before + 2  # both segments are still viewed
    scratch = [torch.full((256,), 9.0) for _ in range(64)]  # would reuse freed memory
    assert torch.equal(owned, torch.full((256,), 3.0)) and torch.equal(weak, torch.full((256,), 4.0))
    del owned, weak, scratch
    SimPool().release_cached()  # prunes orphans nobody views any more
    assert len(sim_pool._orphans) == before
