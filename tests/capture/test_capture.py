"""Capture sessions and break points (design.md 4.4), and the compiled path, on the simulated platform."""

from __future__ import annotations

import threading

import pytest
import torch
from torch.testing import assert_close

import piecewise_backend as pb
from piecewise_backend.capture import EagerSegment, capture_active
from piecewise_backend.platforms.simulated.platform import SimulatedGraph
from pbtest.helpers import (
    BREAK_CALLS,
    SIM,
    CountingMLP,
    FlakyBreakModel,
    TwoBreakModel,
    compile_model,
    fresh_break,
    make_model,
    run,
    segment_kinds,
    token_ids,
)

M = pb.CUDAGraphMode
D8 = pb.BatchDescriptor(8)


def x8(seed: int = 0) -> torch.Tensor:
    return torch.randn(8, 8, generator=torch.Generator().manual_seed(seed))


def breakable(m, mode=None, config=SIM):
    return pb.BreakableCUDAGraphWrapper(m, mode, config=config)


# ---------------------------------------------------------------- segments


def test_no_break_gives_one_graph_segment():
    w = breakable(CountingMLP())
    with pb.expect(captures=1, breaks=0):
        run(w, M.PIECEWISE, D8, x8())
    segs = w.entries[D8].segments
    assert len(segs) == 1 and isinstance(segs[0], SimulatedGraph)
    assert w.entries[D8].num_graphs == 1


@pytest.mark.parametrize("fresh", [True, False], ids=["fresh", "into"])
def test_two_breaks_give_g_e_g_e_g(fresh):
    m = TwoBreakModel(fresh=fresh)
    w = breakable(m, M.PIECEWISE)
    x = x8()
    ref = m(x)
    with pb.expect(captures=1, breaks=2):
        out = run(w, M.PIECEWISE, D8, x)
    assert_close(out, ref)
    segs = w.entries[D8].segments
    assert [type(s) for s in segs] == [SimulatedGraph, EagerSegment, SimulatedGraph, EagerSegment, SimulatedGraph]
    assert segment_kinds(w.entries[D8]) == "G E G E G"
    assert w.entries[D8].num_graphs == 3
    assert all(len(s) > 0 for s in segs if isinstance(s, SimulatedGraph))


@pytest.mark.parametrize("fresh", [True, False], ids=["fresh", "into"])
def test_breaks_run_eagerly_on_every_replay(fresh):
    key = "fresh" if fresh else "into"
    m = TwoBreakModel(fresh=fresh)
    w = breakable(m, M.PIECEWISE)
    static = x8()
    run(w, M.PIECEWISE, D8, static)
    calls, model_calls = BREAK_CALLS[key], m.calls
    for i in range(3):
        static.copy_(x8(i + 1))
        out = run(w, M.PIECEWISE, D8, static)
        assert BREAK_CALLS[key] == calls + 2
        expected = m(static)  # eager reference: runs the breaks twice more
        assert_close(out, expected)
        calls = BREAK_CALLS[key]
    assert m.calls == model_calls + 3  # only the eager references ran the model's Python


def test_fresh_output_break_result_reaches_later_segments():
    # Without copying a fresh break result into the capture-time output, the segment after the
    # break would read the capture-time value and every replay would repeat the first answer.
    m = TwoBreakModel(fresh=True)
    w = breakable(m)
    static = x8(0)
    first = run(w, M.PIECEWISE, D8, static).clone()
    static.copy_(x8(7))
    out = run(w, M.PIECEWISE, D8, static)
    assert_close(out, m(x8(7)))
    assert not torch.allclose(out, first)
    eager = [s for s in w.entries[D8].segments if isinstance(s, EagerSegment)]
    assert all(s.fresh for s in eager)


def test_into_break_records_no_fresh_copy():
    m = TwoBreakModel(fresh=False)
    w = breakable(m)
    run(w, M.PIECEWISE, D8, x8())
    eager = [s for s in w.entries[D8].segments if isinstance(s, EagerSegment)]
    assert len(eager) == 2 and all(not s.fresh for s in eager)


def test_breakable_any_mode_does_not_break_under_full():
    m = TwoBreakModel()
    w = breakable(m)  # runtime_mode None: captures FULL too, as one graph
    static = x8()
    with pb.expect(captures=1, breaks=0):
        run(w, M.FULL, D8, static)
    assert segment_kinds(w.entries[D8]) == "G"
    calls = BREAK_CALLS["fresh"]
    static.copy_(x8(3))
    out = run(w, M.FULL, D8, static)
    assert BREAK_CALLS["fresh"] == calls  # the break is inside the graph: no Python on replay
    assert_close(out, m(static))


def test_outer_full_wrapper_captures_breaks_inline():
    m = TwoBreakModel()
    inner = breakable(m, M.PIECEWISE)
    outer = pb.CUDAGraphWrapper(inner, M.FULL, config=SIM)
    static = x8()
    with pb.expect(captures=1, breaks=0, eager_FULL=1):
        run(outer, M.FULL, D8, static)
    assert segment_kinds(outer.entries[D8]) == "G" and inner.entries == {}
    calls = BREAK_CALLS["fresh"]
    static.copy_(x8(4))
    assert_close(run(outer, M.FULL, D8, static), m(static))
    assert BREAK_CALLS["fresh"] == calls + 2  # the two calls of the eager reference only


def test_cudagraph_wrapper_piecewise_does_not_break():
    w = pb.CUDAGraphWrapper(TwoBreakModel(), M.PIECEWISE, config=SIM)
    with pb.expect(captures=1, breaks=0):
        run(w, M.PIECEWISE, D8, x8())
    assert segment_kinds(w.entries[D8]) == "G"


INNER_CALLS = [0]


@pb.eager_break
def inner_break(x):
    INNER_CALLS[0] += 1
    return x + 1


@pb.eager_break
def outer_break(x):
    return inner_break(x * 2) - 0.5  # a break point reached inside another break


class NestedBreakModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2 = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.l2(outer_break(self.l1(x)))


def test_nested_break_runs_inline():
    m = NestedBreakModel()
    w = breakable(m)
    static = x8()
    with pb.expect(captures=1, breaks=1):
        out = run(w, M.PIECEWISE, D8, static)
    assert_close(out, m(static))
    assert segment_kinds(w.entries[D8]) == "G E G"
    assert pb.capture.session._state.in_break == 0
    calls = INNER_CALLS[0]
    static.copy_(x8(2))
    out = run(w, M.PIECEWISE, D8, static)
    assert INNER_CALLS[0] == calls + 1
    assert_close(out, m(static))


def test_break_point_outside_capture_just_runs():
    x = x8()
    calls = BREAK_CALLS["fresh"]
    with pb.expect(breaks=0):
        assert_close(fresh_break(x), x * 3 + 1)
        with pb.set_forward_context(M.PIECEWISE, D8):  # a context alone is not a capture
            assert_close(fresh_break(x), x * 3 + 1)
    assert BREAK_CALLS["fresh"] == calls + 2
    assert fresh_break.__name__ == "fresh_break"


def test_host_sync_inside_a_break_is_allowed():
    @pb.eager_break
    def syncing(x):
        return x * float(x.abs().max().item() > -1)  # host read: fine, breaks run eagerly

    class Model(torch.nn.Module):
        def forward(self, x):
            return syncing(x + 1) * 2

    w = breakable(Model())
    static = x8()
    assert_close(run(w, M.PIECEWISE, D8, static), (static + 1) * 2)
    static.copy_(x8(1))
    assert_close(run(w, M.PIECEWISE, D8, static), (static + 1) * 2)


# ---------------------------------------------------------------- exceptions


def test_runnable_raising_during_breakable_capture_leaves_nothing():
    state = {"fail": True}

    class Model(torch.nn.Module):
        def forward(self, x):
            h = fresh_break(x * 2)
            if state["fail"]:
                raise RuntimeError("model failed after a break")
            return h + 1

    w = breakable(Model())
    x = x8()
    with pb.expect(captures=0):
        with pytest.raises(RuntimeError, match="model failed"):
            run(w, M.PIECEWISE, D8, x)
    assert w.entries == {} and not capture_active()
    assert torch.utils._python_dispatch._get_current_dispatch_mode() is None
    state["fail"] = False
    with pb.expect(captures=1):
        out = run(w, M.PIECEWISE, D8, x)
    assert_close(out, (x * 2) * 3 + 1 + 1)
    assert segment_kinds(w.entries[D8]) == "G E G"


def test_break_raising_during_capture_leaves_nothing():
    m = FlakyBreakModel()
    w = breakable(m)
    static = x8()
    with pb.expect(captures=0):
        with pytest.raises(ValueError, match="break failed"):
            run(w, M.PIECEWISE, D8, static)
    assert w.entries == {} and not capture_active()
    assert pb.capture.session._state.in_break == 0
    assert torch.utils._python_dispatch._get_current_dispatch_mode() is None
    m.fail = False
    with pb.expect(captures=1, breaks=1):
        out = run(w, M.PIECEWISE, D8, static)
    assert_close(out, m(static))
    assert segment_kinds(w.entries[D8]) == "G E G"
    static.copy_(x8(9))
    assert_close(run(w, M.PIECEWISE, D8, static), m(static))


def test_captures_do_not_nest_on_one_thread():
    # A wrapper reached inside another wrapper's capture becomes part of that capture.
    inner = pb.CUDAGraphWrapper(CountingMLP(), M.FULL, config=SIM)
    outer = breakable(inner)
    with pb.expect(captures=1):
        run(outer, M.FULL, D8, x8())
    assert inner.entries == {} and list(outer.entries) == [D8]


# ---------------------------------------------------------------- threads


class HookedBreakModel(torch.nn.Module):
    """Calls ``hook`` while a graph segment is open (before its break), on the capturing thread."""

    def __init__(self, hook):
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2 = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.hook, self.hook_thread = hook, None

    def forward(self, x):
        h = self.l1(x)
        if threading.current_thread() is self.hook_thread:
            self.hook()
        return self.l2(fresh_break(h))


def test_capture_in_one_thread_while_another_runs_eagerly():
    in_capture, other_done = threading.Event(), threading.Event()
    seen: dict[str, object] = {}

    def hook():
        seen["capturing_ctx"] = pb.get_forward_context().runtime_mode
        in_capture.set()
        assert other_done.wait(20), "other thread did not finish"

    m = HookedBreakModel(hook)
    w = breakable(m)
    static = x8()
    ref = m(static)
    pre_existing = torch.zeros(4)
    xb = x8(3)

    def other():
        try:
            assert in_capture.wait(20)
            seen["other_capture_active"] = capture_active()
            seen["other_ctx_available"] = pb.is_forward_context_available()
            pre_existing.add_(1)  # would be undone at segment end if it were recorded
            seen["other_break"] = fresh_break(xb)  # runs plainly: not a break of the other thread's capture
            with pb.set_forward_context(M.NONE):
                seen["other_ctx"] = pb.get_forward_context().runtime_mode
                seen["other_out"] = w(xb).clone()  # eager, no entry
        except BaseException as e:  # noqa: BLE001 - reported below
            seen["error"] = e
        finally:
            other_done.set()

    m.hook_thread = threading.current_thread()
    t = threading.Thread(target=other)
    t.start()
    calls = BREAK_CALLS["fresh"]
    with pb.expect(captures=1, breaks=1):
        out = run(w, M.PIECEWISE, D8, static)
    t.join(20)
    m.hook_thread = None
    # capture and the replay after it, plus the other thread's direct call and its eager forward
    assert BREAK_CALLS["fresh"] == calls + 4
    assert "error" not in seen, seen.get("error")
    assert seen["capturing_ctx"] is M.PIECEWISE
    assert seen["other_capture_active"] is False
    assert seen["other_ctx_available"] is False
    assert seen["other_ctx"] is M.NONE
    assert_close(seen["other_break"], xb * 3 + 1)
    assert_close(seen["other_out"], m(xb))
    assert_close(pre_existing, torch.ones(4))
    assert list(w.entries) == [D8]
    assert segment_kinds(w.entries[D8]) == "G E G"
    assert_close(out, ref)
    static.copy_(x8(5))
    assert_close(run(w, M.PIECEWISE, D8, static), m(static))


def test_forward_context_is_per_thread():
    seen = {}
    ready, release = threading.Event(), threading.Event()

    def other():
        seen["before"] = pb.is_forward_context_available()
        with pb.set_forward_context(M.FULL, pb.BatchDescriptor(2)):
            ready.set()
            release.wait(20)
            seen["mine"] = pb.get_forward_context().batch_descriptor

    t = threading.Thread(target=other)
    with pb.set_forward_context(M.PIECEWISE, D8):
        t.start()
        assert ready.wait(20)
        assert pb.get_forward_context().runtime_mode is M.PIECEWISE
        assert pb.get_forward_context().batch_descriptor == D8
        release.set()
        t.join(20)
    assert seen == {"before": False, "mine": pb.BatchDescriptor(2)}
    assert not pb.is_forward_context_available()


# ---------------------------------------------------------------- the compiled path


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("attention", ["inplace", "fresh"])
def test_compiled_toy_model_replays_in_piecewise(attention, fresh_dynamo):
    model = make_model(2, attention)
    compiled, backend = compile_model(model, SIM)
    w = breakable(compiled, config=SIM)
    static = token_ids(8)
    ref = model(static)
    assert_close(run(w, M.NONE, None, static), ref)  # warmup: compiles
    split = backend.splits[-1]
    assert [p.is_splitting for p in split.pieces] == [False, True, False, True, False]
    with pb.expect(captures=1, breaks=2):
        out = run(w, M.PIECEWISE, D8, static)
    assert_close(out, ref)
    assert segment_kinds(w.entries[D8]) == "G E G E G"
    for step in range(1, 4):
        static.copy_(token_ids(8, seed=step))
        with pb.expect(captures=0, replays=1, graphs=0):
            out = run(w, M.PIECEWISE, D8, static)
        assert_close(out, model(static))


def test_compiled_toy_model_full_and_piecewise_stack(fresh_dynamo):
    model = make_model(2, "fresh")
    compiled, _ = compile_model(model, SIM)
    inner = breakable(compiled, M.PIECEWISE)
    outer = pb.CUDAGraphWrapper(inner, M.FULL, config=SIM)
    static = token_ids(8)
    run(outer, M.NONE, None, static)
    full_desc = pb.BatchDescriptor(8, num_reqs=8, uniform=True)
    run(outer, M.FULL, full_desc, static)
    run(outer, M.PIECEWISE, D8, static)
    assert segment_kinds(outer.entries[full_desc]) == "G" and list(outer.entries) == [full_desc]
    assert segment_kinds(inner.entries[D8]) == "G E G E G" and list(inner.entries) == [D8]
    for step in range(1, 3):
        static.copy_(token_ids(8, seed=step))
        ref = model(static)
        assert_close(run(outer, M.FULL, full_desc, static), ref)
        assert_close(run(outer, M.PIECEWISE, D8, static), ref)


def test_compile_free_break_attention():
    model = make_model(2, "break")
    w = breakable(model, M.PIECEWISE)
    static = token_ids(8)
    ref = model(static)
    with pb.expect(captures=1, breaks=2, graphs=0):
        assert_close(run(w, M.PIECEWISE, D8, static), ref)
    assert segment_kinds(w.entries[D8]) == "G E G E G"
    for step in range(1, 4):
        static.copy_(token_ids(8, seed=step))
        assert_close(run(w, M.PIECEWISE, D8, static), model(static))


def test_use_breakable_false_wraps_each_piece(fresh_dynamo):
    config = SIM.replace(use_breakable=False)
    model = make_model(2, "fresh")
    compiled, backend = compile_model(model, config)
    static = token_ids(8)
    ref = model(static)
    assert_close(compiled(static), ref)  # no context: every piece runs eagerly
    split = backend.splits[-1]
    wrappers = []
    for piece in split.pieces:
        runner = split.split_gm.__dict__[piece.name]
        if piece.is_splitting:
            assert isinstance(runner, pb.BreakPoint)
        else:
            assert isinstance(runner, pb.CUDAGraphWrapper) and runner.runtime_mode is M.PIECEWISE
            wrappers.append(runner)
    assert len(wrappers) == 3

    # PIECEWISE: every piece captures its own entry
    with pb.expect(captures=3, breaks=0):
        assert_close(run(compiled, M.PIECEWISE, D8, static), ref)
    assert all(list(w.entries) == [D8] and segment_kinds(w.entries[D8]) == "G" for w in wrappers)
    for step in range(1, 3):
        static.copy_(token_ids(8, seed=step))
        with pb.expect(captures=0, replays=3):
            out = run(compiled, M.PIECEWISE, D8, static)
        assert_close(out, model(static))

    # FULL under an outer CUDAGraphWrapper(FULL): the per-piece wrappers fall through
    outer = pb.CUDAGraphWrapper(compiled, M.FULL, config=config)
    full_desc = pb.BatchDescriptor(8, num_reqs=8, uniform=True)
    with pb.expect(captures=1, eager_FULL=3):
        assert_close(run(outer, M.FULL, full_desc, static), model(static))
    assert all(list(w.entries) == [D8] for w in wrappers)
    assert segment_kinds(outer.entries[full_desc]) == "G"
    static.copy_(token_ids(8, seed=11))
    with pb.expect(captures=0, replays=1, eager_FULL=0):
        out = run(outer, M.FULL, full_desc, static)
    assert_close(out, model(static))


# ---------------------------------------------------------------- replay contract (issue 10.8), capture lock, gc


def test_break_returning_another_input_than_at_capture_raises():
    state = {"which": 0}

    @pb.eager_break
    def pick(a, b):
        return (a, b)[state["which"]]

    w = breakable(lambda x: pick(x * 2, x * 3) + 1)
    x = x8()
    assert_close(run(w, M.PIECEWISE, D8, x), x * 2 + 1)
    state["which"] = 1  # the segment after the break reads the captured object: the result would be lost
    with pytest.raises(RuntimeError, match="returned its input tensor .* at capture and another tensor now"):
        run(w, M.PIECEWISE, D8, x)


def test_failed_segment_end_leaves_no_recorder_open():
    from piecewise_backend.capture import CaptureSession, run_session

    class Recorder:
        def __init__(self):
            self.aborted = False

        def end(self):
            raise RuntimeError("capture_end failed")

        def abort(self):
            self.aborted = True

    rec = Recorder()

    class Platform:
        name = "fake"

        def capture_scope(self):
            import contextlib

            return contextlib.nullcontext()

        def begin(self):
            return rec

    session = CaptureSession(Platform(), breakable=False)
    with pytest.raises(RuntimeError, match="capture_end failed"):
        run_session(session, lambda: None, (), {})
    assert rec.aborted and session._recorder is None and session.segments == []
    assert not capture_active()


def test_captures_on_two_threads_run_one_at_a_time():
    inside, release = threading.Event(), threading.Event()
    active = []

    class Slow(torch.nn.Module):
        def forward(self, x):
            active.append(threading.current_thread().name)
            if threading.current_thread().name == "first":
                inside.set()
                assert release.wait(20)
            return x * 2

    w1, w2 = breakable(Slow()), breakable(Slow())
    errors = []

    def first():
        try:
            run(w1, M.PIECEWISE, D8, x8())
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    def second():
        try:
            run(w2, M.PIECEWISE, D8, x8())
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t1 = threading.Thread(target=first, name="first")
    t1.start()
    assert inside.wait(20)
    t2 = threading.Thread(target=second, name="second")
    t2.start()
    t2.join(0.5)
    assert t2.is_alive() and active == ["first"]  # the second capture waits for the first
    release.set()
    t1.join(20)
    t2.join(20)
    assert errors == [] and active == ["first", "second"]
    assert list(w1.entries) == [D8] and list(w2.entries) == [D8]


def test_bulk_capture_collects_once_and_keeps_the_applications_freeze():
    import gc

    from piecewise_backend.capture import bulk_capture, gc_managed

    assert not gc_managed()
    gc.unfreeze()
    with bulk_capture():
        assert gc_managed() and gc.get_freeze_count() > 0
        with bulk_capture():  # nested: a no-op
            assert gc_managed()
        assert gc_managed()
    assert not gc_managed() and gc.get_freeze_count() == 0
    gc.freeze()  # the application froze its own objects
    try:
        frozen = gc.get_freeze_count()
        with bulk_capture():
            pass
        assert gc.get_freeze_count() >= frozen  # not unfrozen behind the application's back
    finally:
        gc.unfreeze()
