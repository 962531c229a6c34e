"""CUDAGraphWrapper / BreakableCUDAGraphWrapper contracts (design.md 4.4), on the simulated platform."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

import piecewise_backend as pb
from piecewise_backend.capture import capture_active
from pbtest.helpers import SIM, CountingMLP, TwoBreakModel, run, segment_kinds

M = pb.CUDAGraphMode
D8 = pb.BatchDescriptor(8)


def full(m):
    return pb.CUDAGraphWrapper(m, M.FULL, config=SIM)


def breakable(m, mode=None):
    return pb.BreakableCUDAGraphWrapper(m, mode, config=SIM)


def x8(seed: int = 0) -> torch.Tensor:
    return torch.randn(8, 8, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- mode gating


def test_full_wrapper_under_piecewise_falls_through_without_entry():
    m = CountingMLP()
    w = full(m)
    x = x8()
    with pb.expect(captures=0, replays=0, eager_PIECEWISE=1):
        out = run(w, M.PIECEWISE, D8, x)
    assert w.entries == {}
    assert m.calls == 1
    assert_close(out, m(x))


def test_full_wrapper_under_full_captures_keyed_by_descriptor():
    m = CountingMLP()
    w = full(m)
    x = x8()
    with pb.expect(captures=1, replays=1):
        run(w, M.FULL, D8, x)
    assert list(w.entries) == [D8]
    assert isinstance(w.entries[D8], pb.GraphEntry)
    # an equal descriptor (a new object) hits the same entry; another one captures anew
    with pb.expect(captures=0, replays=1):
        run(w, M.FULL, pb.BatchDescriptor(8), x)
    d_uniform = pb.BatchDescriptor(8, num_reqs=8, uniform=True)
    with pb.expect(captures=1):
        run(w, M.FULL, d_uniform, x)
    assert set(w.entries) == {D8, d_uniform}


@pytest.mark.parametrize("mode", [M.FULL, M.PIECEWISE])
def test_breakable_any_mode_captures_under_full_and_piecewise(mode):
    m = CountingMLP()
    w = breakable(m)
    assert w.runtime_mode is None
    x = x8()
    with pb.expect(captures=1, replays=1):
        out = run(w, mode, D8, x)
    assert list(w.entries) == [D8]
    assert_close(out, m(x))


def test_breakable_piecewise_under_full_falls_through_without_entry():
    m = CountingMLP()
    w = breakable(m, M.PIECEWISE)
    with pb.expect(captures=0, replays=0, eager_FULL=1):
        run(w, M.FULL, D8, x8())
    assert w.entries == {}
    assert m.calls == 1
    # ... and it does capture the mode it is set to
    with pb.expect(captures=1):
        run(w, M.PIECEWISE, D8, x8())
    assert list(w.entries) == [D8]


@pytest.mark.parametrize("make", [full, breakable], ids=["full", "breakable"])
def test_no_context_or_none_mode_runs_eagerly(make):
    m = CountingMLP()
    w = make(m)
    x = x8()
    with pb.expect(captures=0, replays=0, eager_NONE=2):
        out1 = w(x)  # no forward context at all
        out2 = run(w, M.NONE, None, x)
    assert w.entries == {}
    assert m.calls == 2
    assert_close(out1, m(x))
    assert_close(out2, m(x))
    # NONE with a descriptor is still eager
    with pb.expect(captures=0, eager_NONE=1):
        run(w, M.NONE, D8, x)
    assert w.entries == {}


def test_full_around_piecewise_routes_each_mode_to_one_wrapper():
    m = TwoBreakModel()
    inner = breakable(m, M.PIECEWISE)
    outer = pb.CUDAGraphWrapper(inner, M.FULL, config=SIM)
    x = x8()
    ref = m(x)
    with pb.expect(captures=1):
        assert_close(run(outer, M.FULL, D8, x), ref)
    assert list(outer.entries) == [D8] and inner.entries == {}
    assert segment_kinds(outer.entries[D8]) == "G"
    with pb.expect(captures=1):
        assert_close(run(outer, M.PIECEWISE, D8, x), ref)
    assert list(inner.entries) == [D8] and list(outer.entries) == [D8]
    assert segment_kinds(inner.entries[D8]) == "G E G E G"


# ---------------------------------------------------------------- unwrap, attributes, validation


def test_nested_unwrap_reaches_innermost_model():
    m = CountingMLP()
    w = pb.CUDAGraphWrapper(pb.BreakableCUDAGraphWrapper(m, M.PIECEWISE), M.FULL)
    assert w.unwrap() is m
    assert w.runnable.unwrap() is m
    assert pb.unwrap_model(w) is m
    assert pb.unwrap_model(m) is m


class ForeignWithUnwrap:
    """Not one of ours: unwrap() must never be called on it."""

    def __init__(self):
        self.unwrap_calls = 0

    def __call__(self, x):
        return x + 1

    def unwrap(self):
        self.unwrap_calls += 1
        return "wrongly unwrapped"


def test_unwrap_never_calls_a_foreign_unwrap():
    f = ForeignWithUnwrap()
    w = pb.CUDAGraphWrapper(pb.BreakableCUDAGraphWrapper(f, M.PIECEWISE), M.FULL)
    assert w.unwrap() is f
    assert pb.unwrap_model(w) is f
    assert pb.unwrap_model(f) is f
    assert f.unwrap_calls == 0


def test_attribute_forwarding_and_own_attributes():
    m = CountingMLP()
    inner = breakable(m, M.PIECEWISE)
    w = pb.CUDAGraphWrapper(inner, M.FULL, config=SIM)
    assert w.runnable is inner and inner.runnable is m
    assert w.runtime_mode is M.FULL and inner.runtime_mode is M.PIECEWISE
    assert w.entries == {} and inner.entries == {}
    assert w.entries is not inner.entries
    # forwarded through both wrappers to the model
    assert w.l1 is m.l1
    assert w.calls == 0
    m(x8())
    assert w.calls == 1
    assert w.training is m.training
    # the wrapper's own attributes are not forwarded
    m.entries = "model attribute"
    assert w.entries == {}
    with pytest.raises(AttributeError, match="no_such_attribute"):
        w.no_such_attribute


def test_default_runtime_modes():
    assert pb.CUDAGraphWrapper(CountingMLP()).runtime_mode is M.FULL
    assert pb.BreakableCUDAGraphWrapper(CountingMLP()).runtime_mode is None
    assert pb.CUDAGraphWrapper(CountingMLP(), "piecewise").runtime_mode is M.PIECEWISE


@pytest.mark.parametrize("mode", [M.NONE, M.FULL_AND_PIECEWISE, M.FULL_DECODE_ONLY, "bogus", None])
def test_cudagraph_wrapper_rejects_invalid_runtime_mode(mode):
    with pytest.raises(ValueError, match="runtime_mode|cudagraph mode"):
        pb.CUDAGraphWrapper(CountingMLP(), mode)


@pytest.mark.parametrize("mode", [M.NONE, M.FULL_AND_PIECEWISE, "nope"])
def test_breakable_wrapper_rejects_invalid_runtime_mode(mode):
    with pytest.raises(ValueError, match="runtime_mode|cudagraph mode"):
        pb.BreakableCUDAGraphWrapper(CountingMLP(), mode)


def test_wrapper_rejects_non_callable_and_bad_config():
    with pytest.raises(TypeError):
        pb.CUDAGraphWrapper(42)
    with pytest.raises(TypeError, match="config"):
        pb.BreakableCUDAGraphWrapper(CountingMLP(), config={"platform": "simulated"})


# ---------------------------------------------------------------- replay


@pytest.mark.parametrize("make", [full, breakable], ids=["full", "breakable"])
def test_replay_does_not_run_model_python(make):
    m = CountingMLP()
    w = make(m)
    x = x8()
    ref = m(x)
    assert m.calls == 1
    with pb.expect(captures=1, replays=1):
        out = run(w, M.FULL, D8, x)
    assert m.calls == 2  # the capturing call runs the Python once
    assert_close(out, ref)  # lazily captured entry: correct on its first call
    with pb.expect(captures=0, replays=3):
        for _ in range(3):
            assert_close(run(w, M.FULL, D8, x), ref)
    assert m.calls == 2


def test_static_input_updated_in_place_replays_new_values():
    m = CountingMLP()
    w = full(m)
    static = x8(0)
    run(w, M.FULL, D8, static)
    for seed in (1, 2, 3):
        static.copy_(x8(seed))
        out = run(w, M.FULL, D8, static)
        assert_close(out, m(static))
    assert m.calls == 1 + 3  # one capture, plus the three eager references


def test_replay_output_lives_in_graph_memory():
    m = CountingMLP()
    w = full(m)
    static = x8(0)
    out1 = run(w, M.FULL, D8, static)
    static.copy_(x8(1))
    out2 = run(w, M.FULL, D8, static)
    assert out2.data_ptr() == out1.data_ptr()  # valid only until the next replay
    assert_close(out1, m(x8(1)))


def test_moved_input_same_shape_replays_without_touching_the_callers_tensor():
    m = CountingMLP()
    w = full(m)
    mine = x8(0)
    kept = mine.clone()
    run(w, M.FULL, D8, mine)
    other = x8(5)
    assert other.data_ptr() != mine.data_ptr()
    with pb.expect(captures=0, replays=1):
        out = run(w, M.FULL, D8, other)
    assert_close(out, m(x8(5)))
    assert torch.equal(mine, kept)  # issue 10.9: the capture-time tensor is the caller's, never written
    # the graph reads a wrapper-owned static buffer: a real CUDA graph reads fixed addresses
    (static,) = w.entries[D8].static_inputs
    assert static.data_ptr() not in (mine.data_ptr(), other.data_ptr())
    assert_close(static, other)


def test_moved_input_different_shape_raises_naming_argument():
    m = CountingMLP()
    w = full(m)
    run(w, M.FULL, D8, x8(0))
    with pytest.raises(ValueError, match=r"args\[0\].*\(8, 8\).*\(4, 8\)"):
        run(w, M.FULL, D8, torch.randn(4, 8))
    with pytest.raises(ValueError, match=r"args\[0\].*float64"):
        run(w, M.FULL, D8, x8(0).double())
    assert list(w.entries) == [D8]


def test_same_address_different_shape_raises():
    # buf[:4] starts where buf[:8] does: the address check alone would replay 8 rows silently
    w = full(lambda x: x * 2)
    buf = x8()
    run(w, M.FULL, D8, buf[:8])
    with pytest.raises(ValueError, match=r"args\[0\].*\(8, 8\).*\(4, 8\)"):
        run(w, M.FULL, D8, buf[:4])
    assert_close(run(w, M.FULL, D8, buf[:8]), buf * 2)


def test_moved_keyword_input_raises_naming_keyword():
    def f(x, *, scale):
        return x * scale

    w = full(f)
    x, scale = x8(0), torch.full((8,), 2.0)
    with pb.set_forward_context(M.FULL, D8):
        w(x, scale=scale)
        other = torch.full((8,), 3.0)
        assert_close(w(x, scale=other), x * 3)
        with pytest.raises(ValueError, match="scale"):
            w(x, scale=torch.ones(3))


def test_clear_graphs_then_capture_again():
    m = CountingMLP()
    w = full(m)
    x = x8()
    run(w, M.FULL, D8, x)
    run(w, M.FULL, pb.BatchDescriptor(4), x[:4])
    assert len(w.entries) == 2
    w.clear_graphs()
    assert w.entries == {}
    with pb.expect(captures=1, replays=1):
        out = run(w, M.FULL, D8, x)
    assert list(w.entries) == [D8]
    assert_close(out, m(x))


# ---------------------------------------------------------------- capture switch


def test_capture_disabled_raises_for_new_descriptor_and_replays_existing():
    m = CountingMLP()
    w = full(m)
    x = x8()
    run(w, M.FULL, D8, x)
    pb.set_capture_enabled(False)
    assert pb.capture_enabled() is False
    d16 = pb.BatchDescriptor(16)
    with pb.expect(captures=0):
        with pytest.raises(pb.CaptureDisabledError, match=r"BatchDescriptor\(num_tokens=16"):
            run(w, M.FULL, d16, torch.randn(16, 8))
    assert d16 not in w.entries
    assert not capture_active()
    with pb.expect(captures=0, replays=1):
        assert_close(run(w, M.FULL, D8, x), m(x))
    # eager paths are unaffected
    with pb.expect(captures=0, eager_PIECEWISE=1):
        run(w, M.PIECEWISE, d16, torch.randn(16, 8))
    pb.set_capture_enabled(True)
    with pb.expect(captures=1):
        run(w, M.FULL, d16, torch.randn(16, 8))


def test_capture_disabled_error_is_a_runtime_error():
    assert issubclass(pb.CaptureDisabledError, RuntimeError)


# ---------------------------------------------------------------- exceptions


class FailOnce(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.fail = True

    def forward(self, x):
        h = self.lin(x)
        if self.fail:
            raise KeyError("boom during capture")
        return h * 2


@pytest.mark.parametrize("make", [full, breakable], ids=["full", "breakable"])
def test_exception_during_capture_leaves_nothing_behind(make):
    m = FailOnce()
    w = make(m)
    x = x8()
    with pb.expect(captures=0):
        with pytest.raises(KeyError, match="boom"):
            run(w, M.FULL, D8, x)
    assert w.entries == {}
    assert not capture_active()
    assert torch.utils._python_dispatch._get_current_dispatch_mode() is None  # no recorder left open
    m.fail = False
    with pb.expect(captures=1, replays=1):
        out = run(w, M.FULL, D8, x)
    assert_close(out, m(x))
    assert segment_kinds(w.entries[D8]) == "G"


def test_changed_python_scalar_raises_instead_of_replaying_the_captured_value():
    w = pb.CUDAGraphWrapper(lambda x, k: x * k, config=SIM)
    x = torch.ones(3)
    assert_close(run(w, pb.CUDAGraphMode.FULL, pb.BatchDescriptor(3), x, 2), torch.full((3,), 2.0))
    assert_close(run(w, pb.CUDAGraphMode.FULL, pb.BatchDescriptor(3), x, 2), torch.full((3,), 2.0))
    with pytest.raises(ValueError, match=r"args\[1\] was 2 at capture and is 5"):
        run(w, pb.CUDAGraphMode.FULL, pb.BatchDescriptor(3), x, 5)


def test_moved_keyword_input_is_named_as_a_kwarg():
    w = pb.CUDAGraphWrapper(lambda x, *, scale: x * scale, config=SIM)
    x, scale = torch.ones(3), torch.full((3,), 2.0)
    with pb.set_forward_context(pb.CUDAGraphMode.FULL, pb.BatchDescriptor(3)):
        w(x, scale=scale)
        with pytest.raises(ValueError, match=r"input kwargs\['scale'\] moved"):
            w(x, scale=torch.ones(4))


def test_changing_runtime_mode_after_construction_moves_the_gate():
    w = pb.CUDAGraphWrapper(lambda x: x + 1, M.FULL, config=SIM)
    x = torch.ones(2)
    with pb.expect(eager_PIECEWISE=1, captures=0):
        run(w, M.PIECEWISE, pb.BatchDescriptor(2), x)
    w.runtime_mode = "PIECEWISE"
    assert w.runtime_mode is M.PIECEWISE
    with pb.expect(captures=1, eager_FULL=1):
        run(w, M.PIECEWISE, pb.BatchDescriptor(2), x)
        run(w, M.FULL, pb.BatchDescriptor(2), x)
    with pytest.raises(ValueError, match="PIECEWISE or FULL"):
        w.runtime_mode = M.NONE


# ---------------------------------------------------------------- replay contract (issue 10)


def test_any_mode_wrapper_keeps_full_and_piecewise_entries_apart():
    # issue 10.5: a PIECEWISE step of a descriptor captured under FULL replayed the FULL graph. A FULL
    # graph holds the breaks' kernels as captured; PIECEWISE needs its own graph with eager breaks.
    m = TwoBreakModel()
    w = breakable(m)
    static = x8()
    run(w, M.FULL, D8, static)
    with pb.expect(captures=1, breaks=2):
        run(w, M.PIECEWISE, D8, static)
    by_mode = w.entries_by_mode
    assert segment_kinds(by_mode[M.FULL][D8]) == "G" and segment_kinds(by_mode[M.PIECEWISE][D8]) == "G E G E G"
    from pbtest.helpers import BREAK_CALLS

    calls = BREAK_CALLS["fresh"]
    static.copy_(x8(2))
    assert_close(run(w, M.PIECEWISE, D8, static), m(static))
    assert BREAK_CALLS["fresh"] == calls + 2 + 2  # the replay's breaks ran, then the reference's
    assert list(w.entries) == [D8] and w.entries[D8] is by_mode[M.FULL][D8]
    w.clear_graphs()
    assert w.entries == {} and all(d == {} for d in w.entries_by_mode.values())


def test_single_mode_entries_is_the_live_dict():
    w = full(CountingMLP())
    run(w, M.FULL, D8, x8())
    assert type(w.entries) is dict and w.entries is w.entries and list(w.entries) == [D8]
    assert list(w.entries_by_mode) == [M.FULL]


def test_concurrent_replay_of_one_wrapper_raises():
    import threading

    inside, release = threading.Event(), threading.Event()

    @pb.eager_break
    def waiting(h):
        if threading.current_thread().name == "first":
            inside.set()
            assert release.wait(20)
        return h + 1

    w = breakable(lambda x: waiting(x * 2) * 3)
    x = x8()
    run(w, M.PIECEWISE, D8, x)  # capture on this thread
    errors = []

    def first():
        try:
            run(w, M.PIECEWISE, D8, x)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=first, name="first")
    t.start()
    assert inside.wait(20)
    with pytest.raises(RuntimeError, match="already running"):
        run(w, M.PIECEWISE, D8, x)
    release.set()
    t.join(20)
    assert errors == []
    assert_close(run(w, M.PIECEWISE, D8, x), (x * 2 + 1) * 3)  # the flag was released


@pytest.mark.parametrize("method, args", [("eval", ()), ("train", (False,)), ("to", (torch.float64,)),
                                          ("double", ()), ("requires_grad_", (False,))])
def test_module_methods_return_the_wrapper(method, args):
    m = CountingMLP()
    w = pb.wrap_model(m, SIM.replace(cudagraph_mode="FULL_AND_PIECEWISE"))
    assert getattr(w, method)(*args) is w
    assert isinstance(w.runnable, pb.BreakableCUDAGraphWrapper)


def test_dtype_change_through_the_wrapper_drops_stale_graphs():
    m = CountingMLP().eval()
    w = full(m)
    run(w, M.FULL, D8, x8())
    assert w.eval() is w
    assert list(w.entries) == [D8]  # an eval() that changes nothing keeps the graphs
    assert w.to(torch.float64) is w
    assert w.entries == {}  # the graph read the float32 weights
    x = x8().double()
    assert_close(run(w, M.FULL, D8, x), m(x))


def test_accumulating_break_is_reported_under_debug_checks():
    # issue 10.10: a break runs on garbage during the capture; cache += h keeps the NaN
    cache = torch.zeros(8, 8)

    @pb.eager_break
    def accumulate(h):
        cache.add_(h)
        return cache

    def model(x):
        return accumulate(x * 2) + 1

    w = pb.BreakableCUDAGraphWrapper(model, config=SIM.replace(debug_checks=True))
    with pytest.raises(RuntimeError, match="idempotent"):
        run(w, M.PIECEWISE, D8, x8())
    assert w.entries == {}
    cache.zero_()

    @pb.eager_break  # an idempotent write is fine
    def write(h, out):
        out.copy_(h)
        return out

    w2 = pb.BreakableCUDAGraphWrapper(lambda x: write(x * 2, torch.empty_like(x)) + 1,
                                      config=SIM.replace(debug_checks=True))
    x = x8()
    assert_close(run(w2, M.PIECEWISE, D8, x), x * 2 + 1)


# ---------------------------------------------------------------- drop(mode, descriptor)


def test_drop_removes_one_entry_of_one_mode_and_the_key_captures_again():
    m = TwoBreakModel()
    w = breakable(m)  # runtime_mode=None: FULL and PIECEWISE entries of one descriptor, kept apart
    x = x8()
    d4 = pb.BatchDescriptor(4)
    run(w, M.FULL, D8, x)
    run(w, M.PIECEWISE, D8, x)
    run(w, M.PIECEWISE, d4, x[:4])
    assert w.drop(M.PIECEWISE, D8) is True
    assert w.entries_by_mode[M.PIECEWISE].keys() == {d4} and w.entries_by_mode[M.FULL].keys() == {D8}
    assert w.drop(M.PIECEWISE, D8) is False  # nothing left to drop
    assert w.drop("FULL", pb.BatchDescriptor(16)) is False
    assert sorted((mode.name, d.num_tokens) for mode, d, _ in w.captured()) == [("FULL", 8), ("PIECEWISE", 4)]
    with pb.expect(captures=1):  # the dropped key captures anew, and returns what eager returns
        out = run(w, M.PIECEWISE, D8, x)
    assert_close(out, m(x))
    with pytest.raises(ValueError, match="PIECEWISE or FULL"):
        w.drop(M.NONE, D8)
    with pytest.raises(ValueError, match="PIECEWISE or FULL"):
        w.drop(M.FULL_AND_PIECEWISE, D8)


def test_captured_on_is_the_platform_of_the_first_capture():
    w = full(CountingMLP())
    assert w.captured_on is None and w.captured() == []
    run(w, M.FULL, D8, x8())
    assert w.captured_on is not None and w.captured_on.name == "simulated"


def test_set_aside_entries_and_restore_them():
    w = full(CountingMLP())
    run(w, M.FULL, D8, x8())
    entry = w.entries[D8]
    saved = w.set_aside_entries()
    assert w.entries == {}
    with pb.expect(captures=1):  # set aside: the descriptor captures anew
        run(w, M.FULL, D8, x8())
    w.restore_entries(saved)
    assert w.entries[D8] is entry
    w.restore_entries(None)
    assert w.entries == {}


# ---------------------------------------------------------------- breaks returning Python values


def test_a_breakable_wrapper_keeps_a_break_python_value_and_checks_it_on_every_replay():
    step = [1.0]

    @pb.eager_break
    def learning_rate(h: torch.Tensor) -> float:
        return step[0]

    @pb.eager_break
    def garbage_sum(h: torch.Tensor) -> float:
        return h.sum().item()  # h is made by the segment before: garbage at capture

    def f(x):
        h = x * 2
        return h * learning_rate(h)

    w = breakable(f, M.PIECEWISE)
    x = x8()
    assert_close(run(w, M.PIECEWISE, D8, x), x * 2)  # used to refuse the float at capture
    assert_close(run(w, M.PIECEWISE, D8, x + 1), (x + 1) * 2)
    step[0] = 0.5
    with pytest.raises(RuntimeError, match=r"break '.*learning_rate' returned float 0.5 \(output 0\) on replay, "
                       r"where it returned float 1.0 at capture"):
        run(w, M.PIECEWISE, D8, x)
    g = breakable(lambda x: (x * 2) * garbage_sum(x * 2), M.PIECEWISE)
    with pytest.raises(RuntimeError, match=r"break '.*garbage_sum' returned float .* on replay, where it returned "
                       r"float nan at capture.*is garbage there"):
        run(g, M.PIECEWISE, D8, x)  # the capturing call replays once: it raises there, not silently later
    assert not g.entries and not capture_active()
