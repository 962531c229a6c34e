"""CUDA twins of the central capture tests: the same contracts on real CUDA graphs.

Skipped without a GPU (see conftest.py). Written for the GPU machine (torch 2.11, no
expecttest): models and inputs live on "cuda", each wrapper gets an eager warmup under
NONE before it captures, and results are compared with eager ones right away (a replay's
output lives in graph memory until the next replay).
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

import piecewise_backend as pb
from piecewise_backend.capture import EagerSegment, capture_active
from piecewise_backend.capture.memory import fresh_pool
from piecewise_backend.platforms import get_platform, warmup_scope
from piecewise_backend.platforms.cuda.graphs import CudaGraphSegment
from piecewise_backend.weak import is_weak
from pbtest.helpers import (
    BREAK_CALLS,
    CountingMLP,
    FlakyBreakModel,
    StepCounter,
    TwoBreakModel,
    compile_model,
    make_model,
    run,
    segment_kinds,
)

pytestmark = pytest.mark.cuda

M = pb.CUDAGraphMode
D8 = pb.BatchDescriptor(8)
CFG = pb.CompilationConfig(platform="cuda", compile_pieces="eager")
TOL = dict(rtol=1e-4, atol=1e-4)


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def xc(seed: int = 0, n: int = 8) -> torch.Tensor:
    return torch.randn(n, 8, generator=torch.Generator().manual_seed(seed)).cuda()


def full(m):
    return pb.CUDAGraphWrapper(m, M.FULL, config=CFG)


def breakable(m, mode=None, config=CFG):
    return pb.BreakableCUDAGraphWrapper(m, mode, config=config)


def warm(w, *args):
    # On the capture stream, as GraphRunner.capture() warms up: the next capture skips its lazy warm-up.
    with warmup_scope(get_platform("cuda")):
        out = run(w, M.NONE, None, *args)
    torch.cuda.synchronize()
    return out


# ---------------------------------------------------------------- gating


def test_cuda_gating():
    m = CountingMLP().cuda()
    x = xc()
    outer_full = full(m)
    warm(outer_full, x)
    with pb.expect(captures=0, eager_PIECEWISE=1):
        assert_close(run(outer_full, M.PIECEWISE, D8, x), m(x), **TOL)
    assert outer_full.entries == {}
    with pb.expect(captures=1):
        assert_close(run(outer_full, M.FULL, D8, x), m(x), **TOL)
    assert list(outer_full.entries) == [D8]

    pw = breakable(m, M.PIECEWISE)
    with pb.expect(captures=0, eager_FULL=1):
        run(pw, M.FULL, D8, x)
    assert pw.entries == {}
    with pb.expect(captures=1):
        assert_close(run(pw, M.PIECEWISE, D8, x), m(x), **TOL)

    for mode in (M.FULL, M.PIECEWISE):
        anymode = breakable(m)
        with pb.expect(captures=1):
            assert_close(run(anymode, mode, D8, x), m(x), **TOL)
        assert list(anymode.entries) == [D8]

    eager = full(m)
    with pb.expect(captures=0, eager_NONE=2):
        eager(x)
        run(eager, M.NONE, None, x)
    assert eager.entries == {}


def test_cuda_platform_is_used():
    w = full(CountingMLP().cuda())
    x = xc()
    warm(w, x)
    run(w, M.FULL, D8, x)
    assert w.platform.name == "cuda"
    (seg,) = w.entries[D8].segments
    assert isinstance(seg, CudaGraphSegment) and isinstance(seg.graph, torch.cuda.CUDAGraph)


# ---------------------------------------------------------------- replay


@pytest.mark.parametrize("make", [full, breakable], ids=["full", "breakable"])
def test_cuda_replay_correct_without_python(make):
    m = CountingMLP().cuda()
    w = make(m)
    static = xc(0)
    warm(w, static)
    calls = m.calls
    with pb.expect(captures=1, replays=1):
        out = run(w, M.FULL, D8, static)
    assert_close(out, m(static), **TOL)  # the capturing call is correct
    assert m.calls == calls + 2  # capture + the eager reference
    calls = m.calls
    for seed in (1, 2, 3):
        static.copy_(xc(seed))
        out = run(w, M.FULL, D8, static)
        assert m.calls == calls  # replay ran no Python of the model
        assert_close(out, m(static), **TOL)
        calls = m.calls


def test_cuda_in_place_buffer_update_runs_once_per_call():
    m = StepCounter().cuda()
    w = full(m)
    x = torch.zeros(4, device="cuda")
    d = pb.BatchDescriptor(4)
    warm(w, x)
    m.step.zero_()
    out = run(w, M.FULL, d, x)
    assert m.step.item() == 1  # capture does not execute; the replay after it does
    assert_close(out, torch.full((4,), 1.0, device="cuda"))
    out = run(w, M.FULL, d, x)
    assert m.step.item() == 2
    assert_close(out, torch.full((4,), 2.0, device="cuda"))


# ---------------------------------------------------------------- segments and breaks


@pytest.mark.parametrize("fresh", [True, False], ids=["fresh", "into"])
def test_cuda_two_breaks_g_e_g_e_g(fresh):
    key = "fresh" if fresh else "into"
    m = TwoBreakModel(fresh=fresh).cuda()
    w = breakable(m, M.PIECEWISE)
    static = xc(0)
    warm(w, static)
    with pb.expect(captures=1, breaks=2):
        out = run(w, M.PIECEWISE, D8, static)
    assert_close(out, m(static), **TOL)
    entry = w.entries[D8]
    assert segment_kinds(entry) == "G E G E G"
    assert all(isinstance(s, (EagerSegment, CudaGraphSegment)) for s in entry.segments)
    for seed in (1, 2, 3):
        static.copy_(xc(seed))
        calls = BREAK_CALLS[key]
        out = run(w, M.PIECEWISE, D8, static)
        assert BREAK_CALLS[key] == calls + 2  # the breaks run eagerly on every replay
        assert_close(out, m(static), **TOL)


def test_cuda_fresh_output_break_reaches_later_segments():
    m = TwoBreakModel(fresh=True).cuda()
    w = breakable(m)
    static = xc(0)
    warm(w, static)
    first = run(w, M.PIECEWISE, D8, static).clone()
    static.copy_(xc(7))
    out = run(w, M.PIECEWISE, D8, static)
    assert_close(out, m(static), **TOL)
    assert not torch.allclose(out, first)


def test_cuda_no_break_under_full():
    m = TwoBreakModel().cuda()
    inner = breakable(m, M.PIECEWISE)
    outer = pb.CUDAGraphWrapper(inner, M.FULL, config=CFG)
    static = xc(0)
    warm(outer, static)
    with pb.expect(captures=1, breaks=0):
        run(outer, M.FULL, D8, static)
    assert segment_kinds(outer.entries[D8]) == "G" and inner.entries == {}
    static.copy_(xc(2))
    calls = BREAK_CALLS["fresh"]
    out = run(outer, M.FULL, D8, static)
    assert BREAK_CALLS["fresh"] == calls
    assert_close(out, m(static), **TOL)


# ---------------------------------------------------------------- inputs


def test_cuda_moved_input():
    m = CountingMLP().cuda()
    w = full(m)
    static = xc(0)
    warm(w, static)
    run(w, M.FULL, D8, static)
    other = xc(5)
    assert_close(run(w, M.FULL, D8, other), m(other), **TOL)
    with pytest.raises(ValueError, match=r"args\[0\]"):
        run(w, M.FULL, D8, xc(0, n=4))
    assert list(w.entries) == [D8]


# ---------------------------------------------------------------- exceptions


def test_cuda_exception_during_capture_leaves_nothing():
    state = {"fail": True}

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            h = self.lin(x)
            if state["fail"] and pb.capture.capture_active():
                raise KeyError("boom during capture")
            return h * 2

    m = Model().cuda()
    w = full(m)
    x = xc(0)
    warm(w, x)
    with pb.expect(captures=0):
        with pytest.raises(KeyError, match="boom"):
            run(w, M.FULL, D8, x)
    assert w.entries == {} and not capture_active()
    assert not torch.cuda.is_current_stream_capturing()
    state["fail"] = False
    with pb.expect(captures=1):
        out = run(w, M.FULL, D8, x)
    assert_close(out, m(x), **TOL)


def test_cuda_break_raising_during_capture_leaves_nothing():
    m = FlakyBreakModel().cuda()
    w = breakable(m)
    static = xc(0)
    m.fail = False
    warm(w, static)
    m.fail = True
    with pytest.raises(ValueError, match="break failed"):
        run(w, M.PIECEWISE, D8, static)
    assert w.entries == {} and not capture_active()
    assert not torch.cuda.is_current_stream_capturing()
    m.fail = False
    with pb.expect(captures=1, breaks=1):
        assert_close(run(w, M.PIECEWISE, D8, static), m(static), **TOL)
    assert segment_kinds(w.entries[D8]) == "G E G"
    static.copy_(xc(4))
    assert_close(run(w, M.PIECEWISE, D8, static), m(static), **TOL)


# ---------------------------------------------------------------- compiled and compile-free toy model


@pytest.mark.parametrize("attention", ["inplace", "fresh"])
def test_cuda_compiled_toy_model_piecewise(attention):
    torch._dynamo.reset()
    config = pb.CompilationConfig(platform="cuda", compile_pieces="inductor")
    model = make_model(2, attention, device="cuda")
    compiled, backend = compile_model(model, config)
    w = breakable(compiled, config=config)
    static = torch.randint(0, 128, (8,), device="cuda")
    assert_close(warm(w, static), model(static), **TOL)
    with pb.expect(captures=1, breaks=2):
        assert_close(run(w, M.PIECEWISE, D8, static), model(static), **TOL)
    assert segment_kinds(w.entries[D8]) == "G E G E G"
    gen = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(3):
        static.copy_(torch.randint(0, 128, (8,), device="cuda", generator=gen))
        assert_close(run(w, M.PIECEWISE, D8, static), model(static), **TOL)


def test_cuda_compile_free_break_attention():
    model = make_model(2, "break", device="cuda")
    w = breakable(model, M.PIECEWISE)
    static = torch.randint(0, 128, (8,), device="cuda")
    warm(w, static)
    with pb.expect(captures=1, breaks=2):
        assert_close(run(w, M.PIECEWISE, D8, static), model(static), **TOL)
    assert segment_kinds(w.entries[D8]) == "G E G E G"
    gen = torch.Generator(device="cuda").manual_seed(2)
    for _ in range(3):
        static.copy_(torch.randint(0, 128, (8,), device="cuda", generator=gen))
        assert_close(run(w, M.PIECEWISE, D8, static), model(static), **TOL)


# ---------------------------------------------------------------- fidelity twins (tests/platforms/test_fidelity.py)
# Each asserts on a GPU what its simulated twin asserts on the CPU, except where the simulator
# refuses what it cannot record (Inductor, raw kernels): there the GPU captures and replays right.

from pbtest.helpers import OP_CALLS, ContextScale, ContextScaleBreak, tiny_mlp  # noqa: E402

D4 = pb.BatchDescriptor(4)


def _cuda_full(value: float) -> torch.Tensor:
    return torch.full((4,), value, device="cuda")


def _warm_ctx(w, x, **attrs):
    out = run(w, M.NONE, None, x, **attrs)
    torch.cuda.synchronize()
    return out


def test_cuda_full_replay_reads_the_capture_time_metadata_tensor():
    w = full(ContextScale())
    x = torch.ones(4, device="cuda")
    captured = _cuda_full(2.0)
    _warm_ctx(w, x, scale=captured)
    assert_close(run(w, M.FULL, D4, x, scale=captured), _cuda_full(2.0))
    calls = OP_CALLS["scale"]
    assert_close(run(w, M.FULL, D4, x, scale=_cuda_full(3.0)), _cuda_full(2.0))
    assert OP_CALLS["scale"] == calls


def test_cuda_full_replay_sees_in_place_update_of_persistent_metadata_buffer():
    w = full(ContextScale())
    x, buf = torch.ones(4, device="cuda"), _cuda_full(2.0)
    _warm_ctx(w, x, scale=buf)
    assert_close(run(w, M.FULL, D4, x, scale=buf), _cuda_full(2.0))
    buf.fill_(3.0)
    assert_close(run(w, M.FULL, D4, x, scale=buf), _cuda_full(3.0))
    x.fill_(2.0)
    assert_close(run(w, M.FULL, D4, x, scale=buf), _cuda_full(6.0))


def test_cuda_piecewise_break_reads_this_steps_context():
    w = breakable(ContextScaleBreak())
    x = torch.zeros(4, device="cuda")
    _warm_ctx(w, x, scale=_cuda_full(2.0))
    assert_close(run(w, M.PIECEWISE, D4, x, scale=_cuda_full(2.0)), _cuda_full(4.0))
    assert_close(run(w, M.PIECEWISE, D4, x, scale=_cuda_full(3.0)), _cuda_full(6.0))


def test_cuda_break_under_full_is_captured_like_any_op():
    w = breakable(ContextScaleBreak())
    x, buf = torch.zeros(4, device="cuda"), _cuda_full(2.0)
    _warm_ctx(w, x, scale=buf)
    assert_close(run(w, M.FULL, D4, x, scale=buf), _cuda_full(4.0))
    assert_close(run(w, M.FULL, D4, x, scale=_cuda_full(3.0)), _cuda_full(4.0))
    buf.fill_(5.0)
    assert_close(run(w, M.FULL, D4, x, scale=buf), _cuda_full(10.0))


def test_cuda_composite_implicit_op_is_captured_inside():
    calls = []

    def impl(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return x * pb.get_forward_context().scale

    lib = torch.library.Library("pb_fidelity_cuda", "FRAGMENT")
    lib.define("ctx_scale(Tensor x) -> Tensor")
    lib.impl("ctx_scale", impl, "CompositeImplicitAutograd")
    w = full(lambda x: torch.ops.pb_fidelity_cuda.ctx_scale(x) + 0)
    x = torch.ones(4, device="cuda")
    _warm_ctx(w, x, scale=_cuda_full(2.0))
    calls.clear()
    assert_close(run(w, M.FULL, D4, x, scale=_cuda_full(2.0)), _cuda_full(2.0))
    assert_close(run(w, M.FULL, D4, x, scale=_cuda_full(3.0)), _cuda_full(2.0))
    assert len(calls) == 1


@pytest.mark.parametrize("mode", [M.FULL, M.PIECEWISE])
def test_cuda_host_sync_inside_custom_op_raises(mode):
    w = breakable(lambda x: torch.ops.pb_test.sync_inside(x) + 1)
    x = torch.ones(4, device="cuda")
    warm(w, x)
    with pytest.raises(RuntimeError, match="operation not permitted when stream is capturing"):
        run(w, mode, D4, x)
    assert w.entries == {} and not capture_active()
    assert not torch.cuda.is_current_stream_capturing()
    assert_close(run(w, M.NONE, None, x), x * 4 + 1)


def test_cuda_kernel_bypassing_the_dispatcher_is_captured():
    def fn(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        torch.ops.pb_test.raw_double(x + 1, out)
        return out

    w = full(fn)
    x = torch.ones(4, device="cuda")
    warm(w, x)
    assert_close(run(w, M.FULL, D4, x), _cuda_full(4.0))
    x.fill_(2.0)
    assert_close(run(w, M.FULL, D4, x), _cuda_full(6.0))


def test_cuda_inductor_pieces_capture_and_replay_in_a_runner():
    torch._dynamo.reset()
    model = tiny_mlp("cuda")
    compiled = torch.compile(model, backend="piecewise_breakable")
    config = pb.CompilationConfig(
        cudagraph_mode="PIECEWISE", capture_sizes=[4], platform="cuda", compile_pieces="eager"
    )
    runner = pb.GraphRunner(compiled, config, inputs=[pb.StaticInput("x", shape=(8,), dtype=torch.float32)])
    runner.capture(progress=False)
    for _ in range(2):
        x = torch.randn(4, 8, device="cuda")
        assert_close(runner.run(x=x), model(x), **TOL)


def test_cuda_whole_graph_inductor_captures_and_replays():
    torch._dynamo.reset()
    model = tiny_mlp("cuda")
    w = full(torch.compile(model))
    x = torch.randn(4, 8, device="cuda")
    warm(w, x)
    assert_close(run(w, M.FULL, D4, x), model(x), **TOL)
    x.copy_(torch.randn(4, 8, device="cuda"))
    assert_close(run(w, M.FULL, D4, x), model(x), **TOL)


@pytest.mark.parametrize("mode", [M.PIECEWISE, M.FULL])
def test_cuda_dynamic_toy_model_reads_lifted_eps_on_the_host(mode):
    torch._dynamo.reset()
    model = make_model(num_layers=1, attention="inplace", device="cuda")
    compiled = torch.compile(model, backend=pb.make_backend(CFG), dynamic=True)
    w = breakable(compiled)
    ids = torch.randint(0, 128, (8,), device="cuda")
    warm(w, ids)
    assert_close(run(w, mode, D8, ids), model(ids), **TOL)
    ids.copy_(torch.randint(0, 128, (8,), device="cuda"))
    assert_close(run(w, mode, D8, ids), model(ids), **TOL)


def test_cuda_item_of_a_device_scalar_raises():
    step = torch.zeros((), device="cuda")
    for fn in (lambda x: x * step.item(), lambda x: x * (x.sum() + step).item()):
        w = full(fn)
        x = torch.ones(4, device="cuda")
        warm(w, x)
        with pytest.raises(RuntimeError, match="capturing"):
            run(w, M.FULL, D4, x)
        assert w.entries == {} and not torch.cuda.is_current_stream_capturing()


# ---------------------------------------------------------------- platform hardening (issue 15)
# Twins of tests/platforms/test_cuda_platform.py, which checks the same rules on the CPU double.


def test_cuda_clear_graphs_then_capture_again():
    m = CountingMLP().cuda()
    w = full(m)
    x = xc()
    warm(w, x)
    run(w, M.FULL, D8, x)
    platform = get_platform("cuda")
    pool = w.entries[D8].segments[0].pool()
    w.clear_graphs()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    assert platform.pools[-1].use_count() >= 1  # the platform's MemPool keeps the current pool alive
    with pb.expect(captures=1):
        assert_close(run(w, M.FULL, D8, x), m(x), **TOL)
    # the same pool if another graph still uses it, else a fresh one (never the dead pool's id)
    assert w.entries[D8].segments[0].pool() == platform.pool_id
    assert pool == platform.pool_id or pool not in {tuple(p.id) for p in platform.pools}
    x.copy_(xc(3))
    assert_close(run(w, M.FULL, D8, x), m(x), **TOL)


def test_cuda_retry_after_aborted_capture():
    m = FlakyBreakModel().cuda()
    w = pb.CUDAGraphWrapper(m, M.FULL, config=CFG)  # FULL: the failing break runs inside the graph's capture
    x = xc()
    m.fail = False
    warm(w, x)
    m.fail = True
    with pytest.raises(ValueError, match="break failed"):
        run(w, M.FULL, D8, x)
    assert not torch.cuda.is_current_stream_capturing()
    m.fail = False
    with pb.expect(captures=1):
        assert_close(run(w, M.FULL, D8, x), m(x), **TOL)


def test_cuda_sync_inside_a_capture_then_a_normal_capture():
    state = {"sync": True}

    class Syncing(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            h = self.lin(x)
            if state["sync"] and capture_active():
                h = h * h.sum().item()  # a host sync: CUDA invalidates the capture
            return h * 2

    m = Syncing().cuda()
    w = full(m)
    x = xc()
    warm(w, x)
    with pytest.raises(RuntimeError):
        run(w, M.FULL, D8, x)
    assert w.entries == {} and not capture_active() and not torch.cuda.is_current_stream_capturing()
    torch.cuda.empty_cache()  # asserts inside the allocator if a capture still routed to a pool
    state["sync"] = False
    with pb.expect(captures=1):
        assert_close(run(w, M.FULL, D8, x), m(x), **TOL)
    x.copy_(xc(5))
    assert_close(run(w, M.FULL, D8, x), m(x), **TOL)


def test_cuda_lazy_capture_of_an_inductor_model():
    # No warm-up by the test: the first PIECEWISE call compiles and warms up (on the capture
    # stream) before capturing, so Inductor/Triton never compile or autotune inside a capture.
    torch._dynamo.reset()
    config = pb.CompilationConfig(platform="cuda", compile_pieces="inductor")
    model = make_model(2, "inplace", device="cuda")
    compiled, _ = compile_model(model, config)
    w = breakable(compiled, config=config)
    static = torch.randint(0, 128, (8,), device="cuda")
    with pb.expect(captures=1, breaks=2):
        assert_close(run(w, M.PIECEWISE, D8, static), model(static), **TOL)
    static.copy_(torch.randint(0, 128, (8,), device="cuda"))
    assert_close(run(w, M.PIECEWISE, D8, static), model(static), **TOL)


def test_cuda_two_threads_capture_one_at_a_time():
    import threading

    models = [CountingMLP(seed=i).cuda() for i in range(2)]
    wrappers = [full(m) for m in models]
    inputs = [xc(i) for i in range(2)]
    for w, x in zip(wrappers, inputs):
        warm(w, x)
    errors: list[BaseException] = []
    outs: list = [None, None]

    def capture(i: int) -> None:
        try:
            outs[i] = run(wrappers[i], M.FULL, D8, inputs[i]).clone()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=capture, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for m, x, out in zip(models, inputs, outs):
        assert_close(out, m(x), **TOL)


def test_cuda_sync_from_another_thread_during_a_capture():
    import threading

    seen: list[str] = []

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)
            self.disturb = True

        def forward(self, x):
            out = self.lin(x) * 2
            if self.disturb and capture_active():
                def sync():
                    try:
                        torch.cuda.synchronize()
                    except RuntimeError as e:
                        seen.append(str(e))

                t = threading.Thread(target=sync)
                t.start()
                t.join(60)  # a sync that blocked instead of failing would show as an empty `seen`
            return out

    m = Model().cuda()
    w = full(m)
    x = xc()
    warm(w, x)
    try:
        run(w, M.FULL, D8, x)
    except RuntimeError as e:  # CUDA invalidated the capture: the platform says so and recovers
        assert "invalidated this graph capture" in str(e)
        assert seen, "the capture failed but the other thread's sync did not"
    assert seen and "capturing" in seen[0]  # global capture mode refuses the other thread's sync
    m.disturb = False
    w.clear_graphs()
    with pb.expect(captures=1):
        assert_close(run(w, M.FULL, D8, x), m(x), **TOL)


def test_cuda_memory_is_the_pool():
    platform = get_platform("cuda")
    m = CountingMLP().cuda()
    w = full(m)
    x = xc()
    warm(w, x)
    before = platform.memory()
    big = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")  # not graph memory
    run(w, M.FULL, D8, x)
    grown = platform.memory() - before
    assert 0 <= grown < 64 << 20
    ids = {tuple(p.id) for p in platform.pools} | {pid for pid, _, _ in platform.retired_pools()}  # retired, still held
    assert platform.memory() == sum(
        s["total_size"] for s in torch.cuda.memory_snapshot() if tuple(s["segment_pool_id"]) in ids
    )
    del big


def test_cuda_empty_segment_between_breaks_is_skipped():
    import warnings

    @pb.eager_break
    def ident(h):
        return h

    class Views(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            h = ident(self.lin(x))[:, :4]  # only a view before the next break
            return ident(h) * 2

    m = Views().cuda()
    w = breakable(m)
    x = xc()
    warm(w, x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = run(w, M.PIECEWISE, D8, x)
    assert not [c for c in caught if "empty" in str(c.message)]
    assert_close(out, m(x), **TOL)
    assert sum(isinstance(s, CudaGraphSegment) for s in w.entries[D8].segments) == 2


# Graph memory on CUDA (twins of tests/platforms/test_cuda_memory.py).


def _pool_ranges(platform) -> list[tuple[int, int]]:
    ids = {tuple(p.id) for p in platform.pools}
    return [
        (s["address"], s["address"] + s["total_size"])
        for s in torch.cuda.memory_snapshot()
        if tuple(s["segment_pool_id"]) in ids
    ]


def test_cuda_break_results_are_pool_memory_held_weakly():
    m = TwoBreakModel(fresh=True).cuda()
    w = breakable(m)
    x = xc()
    warm(w, x)
    platform = get_platform("cuda")
    assert_close(run(w, M.PIECEWISE, D8, x), m(x), **TOL)
    torch.cuda.synchronize()
    ranges = _pool_ranges(platform)
    fresh = [t for s in w.entries[D8].segments if isinstance(s, EagerSegment) for _, t in s.fresh]
    assert len(fresh) == 2
    for t in fresh:
        assert is_weak(t), "a break's result is pinned by the entry"
        assert any(lo <= t.data_ptr() < hi for lo, hi in ranges), "a break's result lies outside the graph pool"
    x.copy_(xc(3))
    assert_close(run(w, M.PIECEWISE, D8, x), m(x), **TOL)


def test_cuda_smaller_sizes_reuse_the_larger_sizes_memory():
    m = TwoBreakModel(dim=256, fresh=True).cuda()
    w = breakable(m)
    platform = get_platform("cuda")
    xs = [torch.randn(n, 256, device="cuda") for n in (512, 384, 256, 128)]
    for x in xs:
        warm(w, x)
    with fresh_pool(platform):  # a pool no other test's graph uses
        before = platform.memory()
        run(w, M.PIECEWISE, pb.BatchDescriptor(512), xs[0])
        alone = platform.memory() - before
        for x in xs[1:]:
            run(w, M.PIECEWISE, pb.BatchDescriptor(len(x)), x)
        total = platform.memory() - before
        for x in xs:
            assert_close(run(w, M.PIECEWISE, pb.BatchDescriptor(len(x)), x), m(x), **TOL)
        w.clear_graphs()
    assert 0 < alone and total <= 1.25 * alone, (total, alone)


def test_cuda_clear_graphs_returns_the_memory():
    m = TwoBreakModel(dim=256, fresh=True).cuda()
    w = breakable(m)
    platform = get_platform("cuda")
    x = torch.randn(512, 256, device="cuda")
    warm(w, x)
    with fresh_pool(platform):  # a pool no other test's graph uses
        run(w, M.PIECEWISE, pb.BatchDescriptor(512), x)
        torch.cuda.synchronize()
        pool, reserved = platform.pool_id, torch.cuda.memory_reserved()
        assert any(tuple(s["segment_pool_id"]) == pool for s in torch.cuda.memory_snapshot())
        w.clear_graphs()
        assert not any(tuple(s["segment_pool_id"]) == pool for s in torch.cuda.memory_snapshot())
        assert torch.cuda.memory_reserved() < reserved
        assert pool not in {tuple(p.id) for p in platform.pools}
        with pb.expect(captures=1):  # into a fresh pool: the dead one's id would trip use_count > 0
            assert_close(run(w, M.PIECEWISE, pb.BatchDescriptor(512), x), m(x), **TOL)
        w.clear_graphs()


# ---------------------------------------------------------------- replay contract (issue 10)
# Twins of tests/capture/test_wrappers.py and tests/capture/test_entry.py.

from pbtest.helpers import NoGradAttention  # noqa: E402


def test_cuda_any_mode_wrapper_keeps_full_and_piecewise_entries_apart():
    # A FULL graph holds the breaks' kernels as they ran at capture; a PIECEWISE step of the same
    # descriptor must get its own graph whose breaks run eagerly with this step's data.
    m = TwoBreakModel().cuda()
    w = breakable(m)
    static = xc()
    warm(w, static)
    run(w, M.FULL, D8, static)
    run(w, M.PIECEWISE, D8, static)
    by_mode = w.entries_by_mode
    assert segment_kinds(by_mode[M.FULL][D8]) == "G" and segment_kinds(by_mode[M.PIECEWISE][D8]) == "G E G E G"
    static.copy_(xc(2))
    assert_close(run(w, M.PIECEWISE, D8, static), m(static), **TOL)
    assert_close(run(w, M.FULL, D8, static), m(static), **TOL)


@pytest.mark.parametrize("grad", [True, False])
def test_cuda_grad_mode_after_replay_is_the_callers(grad):
    # A graph replay runs kernels only: the Python that set grad mode inside the captured region
    # does not run, so whatever a break sets must be undone by the wrapper, as eager would leave it.
    w = breakable(NoGradAttention().cuda(), M.PIECEWISE)
    x = xc()
    with torch.set_grad_enabled(grad):
        warm(w, x)
        torch._C._set_grad_enabled(grad)
        run(w, M.PIECEWISE, D8, x)
        torch._C._set_grad_enabled(grad)
        for _ in range(2):
            run(w, M.PIECEWISE, D8, x)
            assert torch.is_grad_enabled() is grad


def test_cuda_replay_returns_a_fresh_container():
    # The tensors of a replay are the graph's memory; the list around them is Python the caller may mutate.
    w = full(lambda x: [x * 2, x + 1])
    x = xc()
    warm(w, x)
    o = run(w, M.FULL, D8, x)
    o.append("junk")
    again = run(w, M.FULL, D8, x)
    assert again is not o and len(again) == 2
    assert_close(again, [x * 2, x + 1])


def test_cuda_capture_under_inference_mode_replays_under_no_grad():
    # The graph's capture-time tensors are inference tensors; a replay under no_grad writes them
    # like the kernels of a CUDA graph do, without autograd's inference-tensor check failing.
    m = TwoBreakModel(fresh=False).cuda()
    w = breakable(m, M.PIECEWISE)
    with torch.inference_mode():
        static = xc()
        warm(w, static)
        run(w, M.PIECEWISE, D8, static)
    other = xc(4)
    out = run(w, M.PIECEWISE, D8, other)
    assert_close(out, m(other), **TOL)
    assert torch.is_inference_mode_enabled() is False


# ---------------------------------------------------------------- pb.breakable_graph (twins: tests/capture/test_breakable_graph.py)


@pb.eager_break
def _dynamic_scale(x: torch.Tensor) -> None:
    if x.sum().item() > 0:
        x.clamp_(min=0)


def _peer_workload(src: torch.Tensor, dst: torch.Tensor) -> None:
    dst.copy_(src * 2)
    _dynamic_scale(dst)
    dst.add_(1.0)


def test_breakable_graph_peer_workload_replays_with_live_values():
    src, dst = torch.empty(1024, device="cuda"), torch.empty(1024, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up on the capture stream
        for _ in range(3):
            src.fill_(1.0)
            _peer_workload(src, dst)
    torch.cuda.current_stream().wait_stream(s)
    g = pb.BreakableGraph()
    with pb.breakable_graph(g, stream=s):
        _peer_workload(src, dst)
    assert segment_kinds(g) == "G E G" and g.memory_bytes >= 0
    for values in (torch.linspace(-1, 3, 1024), torch.linspace(-3, 1, 1024)):
        src.copy_(values.cuda())
        g.replay()
        expected = torch.empty_like(dst)
        _peer_workload(src.clone(), expected)
        assert_close(dst, expected)
    fresh = pb.BreakableGraph(pool=g.pool())
    with pb.breakable_graph(fresh):  # the pool keeps its first capture's stream
        dst.mul_(2)
    fresh.replay()


def test_breakable_graph_names_an_unjoined_side_stream_and_captures_again():
    x = torch.ones(256, device="cuda")
    g = pb.BreakableGraph()
    side = torch.cuda.Stream()
    with pytest.raises(pb.CaptureInvalidatedError, match="side stream .* was not joined back"):
        with pb.breakable_graph(g):
            x.mul_(2)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                x.add_(1)
            _dynamic_scale(x)
    assert not capture_active() and g.segments == []
    with pb.breakable_graph(g):
        x.mul_(2)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            x.add_(1)
        torch.cuda.current_stream().wait_stream(side)
        _dynamic_scale(x)
    x.fill_(1.0)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(x, torch.full_like(x, 3.0))
