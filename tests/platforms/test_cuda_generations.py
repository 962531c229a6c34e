"""Generations of graphs on the CUDA platform (platforms/cuda/pools.py), against the CPU double.

What torch's allocators do and the platform must survive (tests/support/pbtest/cuda_double/rules.py cites each):
``capture_begin`` registers the pool with the host allocator too and ``reset()`` releases it
(host_pool_registration); ``reset()`` frees its capture stream's cuBLAS workspaces
(reset_clears_cublas_workspace, torch >= 2.12); a failed capture keeps its pool uses
(failed_capture_releases_pool: no tabled release). One platform for the module, once per
release of the table; the GPU twins are the smoke steps of scripts/gpu_smoke.py.
"""

from __future__ import annotations

import gc

import pytest
import torch

import piecewise_backend as pb
from piecewise_backend.platforms import base as platforms_base
from piecewise_backend.platforms.cuda import platform as cuda_platform
from piecewise_backend.platforms.cuda.streams import new_capture_stream, new_comm_stream
from piecewise_backend.capture.memory import fresh_pool
from piecewise_backend.platforms import get_platform, warmup_scope
from pbtest import cuda_double
from pbtest.cuda_double.models import DeviceMLP
from pbtest.cuda_double.rules import holds
from pbtest.helpers import run

M = pb.CUDAGraphMode
D4, D8 = pb.BatchDescriptor(4), pb.BatchDescriptor(8)
CFG = pb.CompilationConfig(platform="cuda", compile_pieces="eager")


double = cuda_double.per_release_fixture()


@pytest.fixture
def fake(double, monkeypatch):
    monkeypatch.setattr(platforms_base, "_gc_probe", [lambda: True])
    double.autotuned.clear()
    yield double
    cuda_double.check_clean(double)


def x8(n: int = 8) -> torch.Tensor:
    return torch.randn(n, 8)


def captured(model: torch.nn.Module, desc: pb.BatchDescriptor = D8, mode: M = M.FULL):
    w = pb.CUDAGraphWrapper(model, mode, config=CFG) if mode == M.FULL else pb.BreakableCUDAGraphWrapper(model, config=CFG)
    with pb.expect(captures=1):
        run(w, mode, desc, x8(desc.num_tokens))
    return w


@pb.eager_break
def first_break(x: torch.Tensor) -> torch.Tensor:
    return x


class BreakFirst(torch.nn.Module):
    """The first segment records nothing (a break comes first): CUDA warns "graph is empty"."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = DeviceMLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(first_break(x))


# ---------------------------------------------------------------- the host allocator's pool uses


def test_wrapper_dropped_without_clearing_then_capture(fake):
    # A wrapper garbage-collected without clear_graphs(): its graphs' destructors must not leave the
    # pool with no host use, or the next capture into it fails an INTERNAL ASSERT (host_pool_registration).
    w = captured(DeviceMLP())
    del w
    gc.collect()
    captured(DeviceMLP())


def test_empty_first_segment_then_the_next_segment(fake):
    # An empty first segment of a fresh pool: resetting it drops the pool's only host use, and
    # the segment after the break (same capture) begins into that pool.
    get_platform("cuda").release_cached()  # a fresh generation: the empty graph is its first
    w = captured(BreakFirst(), mode=M.PIECEWISE)
    assert len(w.entries[D8].segments) == 3
    run(w, M.PIECEWISE, D8, x8())


def test_aborted_first_capture_then_retry(fake):
    gc.collect()  # earlier tests' graphs (in reference cycles) die: the next capture starts a fresh pool
    get_platform("cuda").release_cached()
    m = DeviceMLP()
    m.fail = "raise"
    w = pb.CUDAGraphWrapper(m, M.FULL, config=CFG)
    with pytest.raises(KeyError):
        run(w, M.FULL, D8, x8())
    m.fail = None
    with pb.expect(captures=1):
        run(w, M.FULL, D8, x8())


# ---------------------------------------------------------------- the capture stream's cuBLAS workspace


def test_clearing_one_wrapper_keeps_the_others_workspace(fake):
    # Both graphs captured a gemm on one stream: destroying a's graphs must not free the workspace
    # b's graph writes into (torch >= 2.12 reset() frees it; the double's replay then fails like a GPU would).
    a, b = captured(DeviceMLP()), captured(DeviceMLP(), D4)
    a.clear_graphs()
    run(b, M.FULL, D4, x8(4))
    del a
    gc.collect()
    run(b, M.FULL, D4, x8(4))


def test_empty_segment_and_aborted_capture_keep_the_workspace(fake):
    # Each replay of ``keep`` follows a capture whose graph CUDA would reset right away: an empty
    # segment, then an aborted capture (a reused address would hide the loss: replay at once).
    keep = captured(DeviceMLP())
    captured(BreakFirst(), D4, M.PIECEWISE)  # its empty first segment
    run(keep, M.FULL, D8, x8())
    m = DeviceMLP()
    m.fail = "raise"
    with pytest.raises(KeyError):
        run(pb.CUDAGraphWrapper(m, M.FULL, config=CFG), M.FULL, pb.BatchDescriptor(2), x8(2))
    run(keep, M.FULL, D8, x8())


def test_a_new_generation_gets_its_own_stream_and_warms_it(fake):
    p = get_platform("cuda")
    w = captured(DeviceMLP())
    old_stream, old_pool = p.stream, p.pool_id
    w.clear_graphs()  # no graph of the generation is used: it ends, its stream's workspaces go
    assert p.pool_id != old_pool and p.stream.cuda_stream != old_stream.cuda_stream
    if holds("reset_clears_cublas_workspace"):
        assert fake.workspace(old_stream) is None
    captured(DeviceMLP())
    assert fake.workspace(p.stream).pool == (0, 0), "the new stream was not warmed up before its capture"


def test_ended_generations_streams_are_reused(fake):
    # On torch 2.11 a stream's cuBLAS workspace is never freed: a fresh stream per generation
    # would keep one more each time. An ended generation's stream serves a later one.
    p = get_platform("cuda")
    streams = set()
    for _ in range(4):
        w = captured(DeviceMLP())
        streams.add(p.stream.cuda_stream)
        w.clear_graphs()
    assert len(streams) <= 2


def test_capture_in_a_scratch_pool_warms_its_stream(fake):
    # Warmed up before fresh_pool(), captured inside it: the scratch generation's stream has no
    # workspace yet, and one made inside the capture would stay in the pool (for good on 2.11).
    p = get_platform("cuda")
    w = pb.CUDAGraphWrapper(DeviceMLP(), M.FULL, config=CFG)
    with warmup_scope(p):
        run(w, M.NONE, None, x8())
    with fresh_pool(p):
        run(w, M.FULL, D8, x8())
        assert fake.workspace(p.stream).pool == (0, 0), "the workspace was made inside the capture"
        w.clear_graphs()


def test_graphs_dying_between_warm_up_and_capture_keep_the_stream(fake):
    # gc may collect the last graphs of the current generation after a capture's warm-up: the
    # capture must still run on the stream that warm-up prepared (else cuBLAS makes a workspace
    # inside the capture, in the pool, for good on 2.11).
    p = get_platform("cuda")
    dying = captured(DeviceMLP())
    w = pb.CUDAGraphWrapper(DeviceMLP(), M.FULL, config=CFG)
    with warmup_scope(p):
        run(w, M.NONE, None, x8(4))
    del dying
    gc.collect()
    with pb.expect(captures=1):
        run(w, M.FULL, D4, x8(4))
    assert fake.workspace(p.stream).pool == (0, 0)
    assert all(ws.pool == (0, 0) for ws in w.entries[D4].segments[0].graph.workspaces)


# ---------------------------------------------------------------- failed captures


def test_failed_capture_leak_is_bounded_and_reported(fake):
    p = get_platform("cuda")
    before = p.leaks()
    m = DeviceMLP()
    w = pb.CUDAGraphWrapper(m, M.FULL, config=CFG)
    run(w, M.NONE, None, x8())
    m.fail = "sync"
    with pytest.raises(RuntimeError, match="not permitted"):
        run(w, M.FULL, D8, x8())
    failed_pool = p.generations.older[-1].id  # the generation the capture failed in, set aside
    leaks = p.leaks()
    assert leaks["failed_captures"] == before["failed_captures"] + 1
    leaked = not holds("failed_capture_releases_pool")
    assert leaks["leaked_host_uses"] == before["leaked_host_uses"] + leaked
    # the failed pool holds the uses the failed capture kept; once its generation ends they are given
    # back, so its memory goes (the model's output block, freed with the model, included)
    assert p.pool_id != failed_pool
    fake.free(m.out)  # the output block the failed capture allocated (the log record keeps the model alive)
    del m, w
    gc.collect()
    p.release_cached()
    assert "1 failed capture(s)" in p.generations.retired[failed_pool]
    assert failed_pool not in fake.pools, "the failed capture's pool never became freeable"
    assert all(pid != failed_pool for pid, _, _ in p.retired_pools())


def test_retired_pool_held_by_a_tensor_is_counted(fake):
    p = get_platform("cuda")
    p.release_cached()
    m = DeviceMLP(out_bytes=2 << 20)
    w = captured(m)
    pool = p.pool_id
    w.clear_graphs()  # the model still holds its output block in the pool
    retired = {pid: (n, why) for pid, n, why in p.retired_pools()}
    assert retired[pool][0] == 2 << 20 and p.memory() >= 2 << 20
    del m, w
    gc.collect()
    torch.cuda.empty_cache()
    assert pool not in {pid for pid, _, _ in p.retired_pools()}


def test_parked_graphs_are_bounded(fake, monkeypatch):
    # A wrapper cleared and captured again while another lives parks its old graphs each time:
    # past the limit, later captures move to a new generation, and the old one ends with its last graph.
    from piecewise_backend.platforms.cuda import pools as cuda_pools

    monkeypatch.setattr(cuda_pools, "_PARK_LIMIT", 3)
    p = get_platform("cuda")
    keep = captured(DeviceMLP())
    first = p.pool_id
    m = DeviceMLP()
    w = pb.CUDAGraphWrapper(m, M.FULL, config=CFG)
    for _ in range(5):
        run(w, M.FULL, D4, x8(4))
        w.clear_graphs()
    assert p.pool_id != first and len(p.generations.older) >= 1
    assert all(g.parked() <= 4 for g in p.generations.all())
    run(keep, M.FULL, D8, x8())
    del keep
    gc.collect()
    p.release_cached()
    assert first not in {g.id for g in p.generations.all()}


def test_generations_never_share_a_pooled_stream_and_say_when_the_pool_is_taken(fake):
    # torch.cuda.Stream() hands out 32 streams per priority level round robin (stream_pool_of_32): a new
    # generation skips the raw streams live ones hold, whatever else drew streams in between.
    taken: set[int] = set()
    for i in range(32):
        if i == 10:
            [torch.cuda.Stream() for _ in range(7)]  # other code's streams move the round robin on
        stream = new_capture_stream(0, taken)
        assert stream.cuda_stream not in taken
        taken.add(stream.cuda_stream)
    comm = new_comm_stream(0, stream)
    assert comm.cuda_stream not in taken  # another priority level: never a capture stream
    with pytest.raises(RuntimeError, match="every pooled CUDA stream of cuda:0 already carries a live generation"):
        new_capture_stream(0, taken)
