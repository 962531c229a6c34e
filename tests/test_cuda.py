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
from tests.helpers import (
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
    assert isinstance(seg, torch.cuda.CUDAGraph)


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
    assert all(isinstance(s, (EagerSegment, torch.cuda.CUDAGraph)) for s in entry.segments)
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


# ---------------------------------------------------------------- fidelity twins (tests/test_fidelity.py)
# Each asserts on a GPU what its simulated twin asserts on the CPU, except where the simulator
# refuses what it cannot record (Inductor, raw kernels): there the GPU captures and replays right.

from tests.helpers import OP_CALLS, ContextScale, ContextScaleBreak, tiny_mlp  # noqa: E402

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
