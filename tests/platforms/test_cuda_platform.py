"""platforms/cuda/platform.py run against the CPU double of torch.cuda's graph API (tests/support/pbtest/cuda_double/fake.py).

Each test names the rule it checks; tests/gpu/test_cuda.py has the real-GPU twins. The double
checks the platform's state machine (pools, routing, streams, captures), not values. As on a
GPU, one platform serves the whole module (dead graphs, parked graphs and retired pools carry
over from test to test), once per torch release of the rule table (2.11 and 2.13 rules).
"""

from __future__ import annotations

import threading
import time
import warnings

import pytest
import torch

import piecewise_backend as pb
from piecewise_backend.platforms import base as platforms_base
from piecewise_backend.platforms.cuda import platform as cuda_platform
from piecewise_backend.platforms import get_platform
from piecewise_backend.platforms.cuda.graphs import CudaGraphSegment
from pbtest import cuda_double
from pbtest.cuda_double.fake import INVALIDATED, NOT_PERMITTED, WORKSPACE
from pbtest.cuda_double.models import DeviceMLP
from pbtest.helpers import run, segment_kinds

M = pb.CUDAGraphMode
D4, D8 = pb.BatchDescriptor(4), pb.BatchDescriptor(8)
CFG = pb.CompilationConfig(platform="cuda", compile_pieces="eager")


double = cuda_double.per_release_fixture()


@pytest.fixture
def fake(double, monkeypatch):
    monkeypatch.setattr(platforms_base, "_gc_probe", [lambda: True])  # no gc.collect per capture: 0.3 s here
    double.invalidations.clear()  # per test: what this test's steps did
    double.autotuned.clear()  # each test's model is new: its kernels autotune on first use
    double.max_concurrent = 0
    yield double
    cuda_double.check_clean(double)


@pytest.fixture
def fresh(monkeypatch, request):
    """A platform of its own (a test that breaks it for good)."""
    monkeypatch.setattr(platforms_base, "_gc_probe", [lambda: True])
    with cuda_double.installed() as fake:
        yield fake


def x8(n: int = 8) -> torch.Tensor:
    return torch.randn(n, 8)


def platform() -> cuda_platform.CudaPlatform:
    return get_platform("cuda")


# ---------------------------------------------------------------- 1. pool lifetime


def test_clear_graphs_then_capture_again(fake):
    # The first capture leaves a block in the pool (the output); clearing drops every graph.
    # Without a holder the pool's use count falls to 0 and the recapture trips an INTERNAL ASSERT.
    w = pb.CUDAGraphWrapper(DeviceMLP(), M.FULL, config=CFG)
    run(w, M.NONE, None, x8())  # warm up eagerly (the lazy warm-up is test 3's)
    with pb.expect(captures=1):
        run(w, M.FULL, D8, x8())
    pool = w.entries[D8].segments[0].pool()
    assert fake.pool_bytes(pool) > 0
    w.clear_graphs()
    # No graph uses the pool any more: the platform retired it, and the model still holds its
    # output block there, so the pool is dead but not gone; capturing into it would trip the assert.
    assert fake.pools[pool].use_count == 0 and pool not in {tuple(p.id) for p in platform().pools}
    with pb.expect(captures=1):
        run(w, M.FULL, D8, x8())
    new = w.entries[D8].segments[0].pool()
    assert new != pool and fake.pools[new].use_count == 2  # the platform's MemPool and the graph
    torch.cuda.empty_cache()  # the model freed its old output: the dead pool's last block goes back
    assert pool not in fake.pools and fake.pool_bytes(pool) == 0


def test_retry_after_aborted_capture(fake):
    m = DeviceMLP()
    w = pb.CUDAGraphWrapper(m, M.FULL, config=CFG)
    run(w, M.NONE, None, x8())
    m.fail = "raise"
    with pytest.raises(KeyError, match="boom"):
        run(w, M.FULL, D8, x8())
    assert w.entries == {} and fake.routing == [] and not fake.captures
    m.fail = None
    with pb.expect(captures=1):
        run(w, M.FULL, D8, x8())


def test_graphs_share_the_platform_pool(fake):
    w4, w8 = (pb.BreakableCUDAGraphWrapper(DeviceMLP(), config=CFG) for _ in range(2))
    run(w8, M.NONE, None, x8())
    run(w4, M.NONE, None, x8(4))
    run(w8, M.PIECEWISE, D8, x8())
    run(w4, M.PIECEWISE, D4, x8(4))
    pools = {s.pool() for w in (w4, w8) for e in w.entries.values() for s in e.segments}
    assert len(pools) == 1


# ---------------------------------------------------------------- 2. invalidated captures


def test_sync_inside_capture_then_normal_capture(fake):
    m = DeviceMLP()
    w = pb.CUDAGraphWrapper(m, M.FULL, config=CFG)
    run(w, M.NONE, None, x8())  # warm: autotuned, workspace made
    run(w, M.NONE, None, x8(4))
    run(w, M.FULL, D4, x8(4))
    old_pool = w.entries[D4].segments[0].pool()
    m.fail = "sync"
    with pytest.raises(RuntimeError, match=NOT_PERMITTED):
        run(w, M.FULL, D8, x8())
    assert fake.invalidations == [".item()"]
    # The failed capture_end skipped endAllocateToPool: the platform ended the routing itself.
    assert fake.routing == [] and not fake.captures and list(w.entries) == [D4]
    torch.cuda.empty_cache()  # asserts no capture is routing (CCA synchronize_and_free_events)
    m.fail = None
    with pb.expect(captures=1):
        run(w, M.FULL, D8, x8())
    assert w.entries[D8].segments[0].pool() != old_pool  # later captures moved to a fresh pool
    run(w, M.FULL, D4, x8(4))  # the graph captured before still replays


def test_invalidation_found_at_capture_end_is_explained(fake):
    m = DeviceMLP()
    w = pb.BreakableCUDAGraphWrapper(m, config=CFG)
    run(w, M.NONE, None, x8())
    m.fail = "fork"
    with pytest.raises(RuntimeError, match="invalidated this graph capture.*capture again"):
        run(w, M.PIECEWISE, D8, x8())
    assert fake.routing == [] and not fake.captures and not torch.cuda.is_current_stream_capturing()
    m.fail = None
    with pb.expect(captures=1):
        run(w, M.PIECEWISE, D8, x8())


def test_unrecoverable_capture_fails_loudly(fresh, monkeypatch):
    def broken_end(device, pool):
        raise RuntimeError("driver gone")

    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", broken_end)
    m = DeviceMLP()
    w = pb.CUDAGraphWrapper(m, M.FULL, config=CFG)
    run(w, M.NONE, None, x8())
    m.fail = "sync"
    with pytest.raises(RuntimeError, match="cannot be used again in this process.*driver gone.*Restart the process"):
        run(w, M.FULL, D8, x8())
    m.fail = None
    calls = m.calls
    with pytest.raises(RuntimeError, match="cannot be used again"):  # refused up front, model not run
        run(w, M.FULL, D8, x8())
    assert m.calls == calls


# ---------------------------------------------------------------- 3. warm-up stream, lazy warm-up


def _runner(model: torch.nn.Module, **config) -> pb.GraphRunner:
    cfg = CFG.replace(cudagraph_mode="PIECEWISE", capture_sizes=[4, 8], max_capture_size=8, **config)
    return pb.GraphRunner(model, cfg, [pb.StaticInput("x", shape=(8,), dtype=torch.float32)], device="cpu")


def test_runner_warms_up_on_the_capture_stream(fake):
    platform().release_cached()  # memory left by earlier tests' dead graphs goes back (module-wide platform)
    m = DeviceMLP()
    runner = _runner(m)
    runner.capture(progress=False)
    p = platform()
    # cuBLAS workspaces are per stream: warmed on the capture stream, its workspace is made
    # outside the capture and stays out of the graph pool.
    assert fake.workspace(p.stream).pool == (0, 0)
    assert p.memory() == fake.pool_bytes(p.pool_id) and WORKSPACE > fake.pool_bytes(p.pool_id) > 0
    # each size ran num_warmups eager steps plus its capture, no extra lazy warm-up
    assert m.calls == 2 * (runner.config.num_warmups + 1)


def test_lazy_capture_warms_up_first(fake):
    # An unseen shape captured lazily: Inductor/Triton would autotune (a sync) inside the capture.
    m = DeviceMLP()
    w = pb.BreakableCUDAGraphWrapper(m, config=CFG)
    with pb.expect(captures=1):
        run(w, M.PIECEWISE, D8, x8())
    assert fake.invalidations == [] and fake.workspace(platform().stream).pool == (0, 0)
    # Side effect, documented: the step ran num_warmups extra times (same inputs) before capture.
    assert m.calls == CFG.num_warmups + 1


def test_runner_warm_up_without_a_capture_leaves_no_mark(fake):
    # A second capture() finds every entry: its warm-ups are followed by replays, not captures.
    # The "warmed" mark must end with each descriptor's step, else this thread's next lazy
    # capture (another size, another model) skips its warm-up and autotunes inside the capture.
    runner = _runner(DeviceMLP())
    runner.capture(progress=False)
    with pb.expect(captures=0):
        runner.capture(progress=False)
    m = DeviceMLP()
    w = pb.BreakableCUDAGraphWrapper(m, config=CFG)
    with pb.expect(captures=1):
        run(w, M.PIECEWISE, pb.BatchDescriptor(6), x8(6))  # a shape not autotuned yet
    assert fake.invalidations == [] and m.calls == CFG.num_warmups + 1


def test_lazy_capture_without_warmups_fails_and_recovers(fake):
    fake.blas_handle()  # this thread's cuBLAS handle exists, as after any earlier GEMM: only autotuning is left to fail
    m = DeviceMLP()
    w = pb.BreakableCUDAGraphWrapper(m, config=CFG.replace(num_warmups=0))
    with pytest.raises(RuntimeError, match=NOT_PERMITTED):
        run(w, M.PIECEWISE, D8, x8())
    assert m.calls == 1 and fake.invalidations == ["autotuning"] and fake.routing == []
    run(w, M.NONE, None, x8())  # the remedy: run the shape once eagerly (autotunes), then capture
    with pb.expect(captures=1):
        run(w, M.PIECEWISE, D8, x8())


# ---------------------------------------------------------------- 4. one capture at a time


def test_second_capture_waits_for_the_first(fake):
    # Without waiting, the second capture_scope's device sync would invalidate the first capture.
    p = platform()
    inside, release = threading.Event(), threading.Event()
    order: list[str] = []

    def first():
        with p.capture_scope():
            rec = p.begin()
            cuda_double.current().launch()
            inside.set()
            release.wait(5)
            order.append("first ends")
            rec.end()

    def second():
        with p.capture_scope():
            order.append("second begins")
            p.begin().end()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    threads[0].start()
    assert inside.wait(5)
    threads[1].start()
    threads[1].join(0.2)
    assert threads[1].is_alive() and order == []  # waiting, not capturing
    release.set()
    for t in threads:
        t.join(5)
    assert order == ["first ends", "second begins"]
    assert fake.invalidations == [] and fake.max_concurrent == 1


def test_two_threads_capture_lazily(fake):
    # Each lazy capture warms up on the capture stream first: that warm-up must wait too, or its
    # kernels and syncs would land in (and invalidate) the other thread's open capture.
    models = [DeviceMLP(), DeviceMLP()]
    wrappers = [pb.CUDAGraphWrapper(m, M.FULL, config=CFG) for m in models]
    capturing = threading.Event()
    first_forward = models[0].forward

    def slow(x):
        if pb.capture.capture_active():
            capturing.set()
            time.sleep(0.2)  # hold the capture open while the other thread starts
        return first_forward(x)

    models[0].forward = slow
    errors: list[BaseException] = []

    def capture(i: int) -> None:
        try:
            run(wrappers[i], M.FULL, D8, x8())
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=capture, args=(i,)) for i in range(2)]
    threads[0].start()
    assert capturing.wait(5)
    threads[1].start()
    for t in threads:
        t.join(10)
    assert not errors, errors
    assert fake.invalidations == [] and fake.max_concurrent == 1
    assert all(list(w.entries) == [D8] for w in wrappers)


def test_sync_from_another_thread_invalidates_then_recovers(fake):
    m = DeviceMLP()
    w = pb.CUDAGraphWrapper(m, M.FULL, config=CFG)
    run(w, M.NONE, None, x8())
    seen: list[str] = []

    def other_thread_syncs():
        try:
            torch.cuda.synchronize()
        except RuntimeError as e:
            seen.append(str(e))

    real_forward = m.forward

    def forward(x):  # after the step's last launch: only capture_end finds the invalidation
        out = real_forward(x)
        t = threading.Thread(target=other_thread_syncs)
        t.start()
        t.join()
        return out

    m.forward = forward
    with pytest.raises(RuntimeError, match="invalidated this graph capture") as info:
        run(w, M.FULL, D8, x8())
    assert isinstance(info.value, cuda_platform.CaptureInvalidatedError) and INVALIDATED in str(info.value)
    assert seen == [NOT_PERMITTED] and fake.routing == []
    m.forward = real_forward
    with pb.expect(captures=1):
        run(w, M.FULL, D8, x8())


def test_memory_refuses_during_a_capture(fake):
    p = platform()
    with p.capture_scope():
        with pytest.raises(RuntimeError, match="invalidates an open capture"):
            p.memory()
    assert fake.invalidations == []


# ---------------------------------------------------------------- 5. memory on the pool


def test_memory_counts_the_pool_only(fake):
    p = platform()
    p.release_cached()
    m = DeviceMLP(out_bytes=3 << 20)
    w = pb.CUDAGraphWrapper(m, M.FULL, config=CFG)
    run(w, M.NONE, None, x8())
    before = p.memory()
    fake.malloc(64 << 20)  # warm-up activations, other caches: default pool
    with pb.expect(captures=1):
        run(w, M.FULL, D8, x8())
    assert p.memory() - before == 3 << 20
    assert fake.memory_reserved() - before > 64 << 20  # what memory_reserved() would have counted
    assert p.describe(3 << 20) == "3.0 MiB in the CUDA graph pool of cuda:0"


# ---------------------------------------------------------------- 6. empty segments, device key


@pb.eager_break
def view_break(x: torch.Tensor) -> torch.Tensor:
    return x


class ViewsBetweenBreaks(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cuda_double.current().launch()
        h = view_break(x)[:, :4]  # only views until the next break: CUDA records nothing
        h = view_break(h)
        cuda_double.current().launch()
        return h


def test_empty_segment_is_skipped_without_warning(fake):
    w = pb.BreakableCUDAGraphWrapper(ViewsBetweenBreaks(), config=CFG.replace(num_warmups=0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(w, M.PIECEWISE, D8, x8())
    assert not [c for c in caught if "empty" in str(c.message)]
    entry = w.entries[D8]
    assert segment_kinds(entry) == "G E G E G"
    graphs = [s for s in entry.segments if isinstance(s, CudaGraphSegment)]
    assert len(graphs) == 2  # the middle one is a no-op, not a graph
    replays = fake.replays
    run(w, M.PIECEWISE, D8, x8())
    assert fake.replays == replays + 2


def test_platform_is_keyed_by_device(fake):
    p0 = platform()
    with torch.cuda.device(1):
        p1 = platform()
        assert platform() is p1
    assert p0 is not p1 and (p0.device, p1.device) == (0, 1)
    assert p1.stream.device_index == 1 and p0.pool_id != p1.pool_id


def test_the_platform_layer_imports_nothing_above_it():
    # DESIGN section 3: data flows one way. The capture layer tells platforms about gc through
    # platforms.set_gc_managed() instead of being imported by them.
    import ast
    from pathlib import Path

    above = {"capture", "wrappers", "assembly", "runner", "memory", "entry", "backend", "kv", "hf", "dispatch"}
    for path in Path(cuda_platform.__file__).parent.glob("cuda*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 2:
                assert (node.module or "").split(".")[0] not in above, f"{path.name} imports ..{node.module}"


def test_a_capture_only_cublaslt_gemm_finds_its_workspace_made_on_torch_2_11(monkeypatch):
    # torch 2.11 keeps cuBLASLt's workspace apart from cuBLAS's, made by the first Lt GEMM on the stream
    # (cublaslt_unified_workspace): a path only the capture takes would make it inside, in the graph's pool.
    class FullOnly(torch.nn.Module):
        def forward(self, x):
            if torch.cuda.is_current_stream_capturing():
                cuda_double.current().gemm(lt=True)
            return x * 2

    monkeypatch.setattr(platforms_base, "_gc_probe", [lambda: True])
    with cuda_double.installed((2, 11)) as fake:
        w = pb.CUDAGraphWrapper(FullOnly(), M.FULL, config=CFG)
        x = torch.ones(8)
        pb.mark_persistent(x)
        with pb.set_forward_context(M.FULL, pb.BatchDescriptor(8)):
            w(x)
        assert fake.lt_workspaces and {seg.pool for seg in fake.lt_workspaces.values()} == {(0, 0)}
        cuda_double.check_clean(fake)
