"""pb.breakable_graph / pb.BreakableGraph (design.md 4.10): the compile-free capture, on the simulator
(values) and on the CPU double of torch.cuda (CUDA's rules: pools, streams, capture modes)."""

from __future__ import annotations

import gc
import threading

import pytest
import torch
from torch.utils._pytree import tree_leaves

import piecewise_backend as pb
from piecewise_backend.capture import EagerSegment, capture_active
from piecewise_backend.platforms import base as platforms_base
from pbtest import cuda_double
from pbtest.helpers import SIM, CountingMLP, compile_model, saved_splitting_ops, segment_kinds

M = pb.CUDAGraphMode


def sim_graph(**kwargs) -> pb.BreakableGraph:
    return pb.BreakableGraph(platform="simulated", **kwargs)


# ---------------------------------------------------------------- the peer's README workload


@pb.eager_break
def dynamic_scale(x: torch.Tensor) -> None:
    if x.sum().item() > 0:  # a host read: legal in a break only
        x.clamp_(min=0)


def workload(src: torch.Tensor, dst: torch.Tensor) -> None:
    dst.copy_(src * 2)
    dynamic_scale(dst)
    dst.add_(1.0)


def test_peer_readme_workload_replays_with_live_values():
    static_input, result = torch.empty(6), torch.empty(6)
    for _ in range(3):  # warm-up, as the peer's README does
        static_input.fill_(1.0)
        workload(static_input, result)
    g = pb.BreakableGraph()  # "auto": the simulator on a CPU
    with pb.breakable_graph(g):
        workload(static_input, result)
    assert g.platform.name == "simulated" and segment_kinds(g) == "G E G"
    for values in ([-1.0, 3.0, -2.0, 4.0, 0.5, -0.5], [-3.0, 1.0, -3.0, 1.0, -3.0, 1.0]):
        static_input.copy_(torch.tensor(values))
        g.replay()
        expected = torch.empty(6)
        workload(static_input.clone(), expected)
        assert torch.equal(result, expected), (values, result, expected)
    # the first input clamps (sum > 0), the second does not: the break read live values both times
    assert result.min() < 0


def test_capture_does_not_execute_the_graph_segments():
    x, out = torch.full((4,), 2.0), torch.zeros(4)
    g = sim_graph()
    with pb.breakable_graph(g):
        out.copy_(x * 5)
    assert torch.equal(out, torch.zeros(4))  # as torch.cuda.graph: captured, not run
    g.replay()
    assert torch.equal(out, torch.full((4,), 10.0))


def test_alias_is_the_same_class():
    assert pb.BreakableCUDAGraph is pb.BreakableGraph


def test_the_peers_new_names_are_the_same_objects():
    # piecewise-cuda-graphs (formerly breakable-cuda-graphs) and PyTorch's proposed torch.cuda API
    assert pb.CUDAGraphSequence is pb.BreakableGraph
    assert pb.piecewise_graph is pb.breakable_graph
    assert pb.no_graph is pb.eager_break
    assert pb.force_no_graph is pb.force_break
    assert pb.is_in_piecewise_graph is pb.is_in_breakable_graph
    names = {"CUDAGraphSequence", "piecewise_graph", "no_graph", "force_no_graph", "is_in_piecewise_graph"}
    assert names <= set(pb.__all__)


def test_the_peers_workload_under_the_new_names():
    @pb.no_graph
    def copy_to_buffer(dst, src):
        dst.copy_(src)

    seen = []
    seq = pb.CUDAGraphSequence(platform="simulated")
    static_input, static_output = torch.ones(5), torch.empty(5)
    with pb.piecewise_graph(seq):
        seen.append(pb.is_in_piecewise_graph())
        static_input.mul_(2)
        copy_to_buffer(static_output, static_input)
        pb.force_no_graph()
        static_output.add_(1)
    assert seen == [True] and segment_kinds(seq) == "G E G G"
    static_input.fill_(3.0)
    seq.replay()
    assert torch.equal(static_output, torch.full((5,), 7.0))


def test_the_peers_call_forms():
    order = []

    @pb.eager_break
    def brk(x):
        order.append("break")
        x.add_(1)

    x = torch.zeros(2)
    # breakable-cuda-graphs: breakable_graph(cuda_graph, stream=None, capture_error_mode="global", barrier_fn=None)
    g = sim_graph()
    with pb.breakable_graph(g, None, "thread_local", lambda: order.append("barrier")) as got:
        assert got is g
        brk(x)
    assert order == ["barrier", "break"] and segment_kinds(g) == "G E G"
    g2 = sim_graph()
    with pb.breakable_graph(cuda_graph=g2, capture_error_mode="relaxed"):
        brk(x)
    g3 = sim_graph()
    with pb.piecewise_graph(cuda_graph_sequence=g3):  # piecewise-cuda-graphs' keyword
        brk(x)
    assert segment_kinds(g2) == segment_kinds(g3) == "G E G"
    x.zero_()
    for graph in (g, g2, g3):
        graph.replay()
    assert torch.equal(x, torch.full((2,), 3.0))
    with pytest.raises(TypeError, match="needs the pb.BreakableGraph to capture into: pass it first, or as cuda_graph="):
        with pb.breakable_graph():
            pass
    with pytest.raises(TypeError, match=r"got the graph to capture into twice \(g and cuda_graph\)"):
        with pb.breakable_graph(sim_graph(), cuda_graph=sim_graph()):
            pass
    with pytest.raises(ValueError, match="capture_error_mode must be one of .*got 'strict'"):
        with pb.breakable_graph(sim_graph(), None, "strict"):
            pass
    with pytest.raises(TypeError, match="barrier_fn must be a callable"):
        with pb.breakable_graph(sim_graph(), None, "global", 3):
            pass
    assert not capture_active()


# ---------------------------------------------------------------- breaks


@pb.eager_break
def fresh_scale(x: torch.Tensor) -> torch.Tensor:
    return x * float(x.max().item())  # a fresh tensor, computed from a host read


def test_break_may_return_a_fresh_tensor_copied_into_place_on_replay():
    x, out = torch.ones(4), torch.zeros(4)
    g = sim_graph()
    with pb.breakable_graph(g):
        h = fresh_scale(x + 1)
        out.copy_(h - 1)
    x.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    g.replay()
    h = x + 1
    assert torch.equal(out, h * h.max() - 1)


def test_break_inside_a_break_runs_inline():
    inner_calls = []

    @pb.eager_break
    def inner(x):
        inner_calls.append(capture_active())
        x.add_(1)

    @pb.eager_break
    def outer(x):
        inner(x)
        x.mul_(2)

    x = torch.zeros(3)
    g = sim_graph()
    with pb.breakable_graph(g):
        x.add_(1)
        outer(x)
    assert segment_kinds(g) == "G E G" and g.num_breaks == 1  # one break: inner ran inside outer's
    x.zero_()
    g.replay()
    assert torch.equal(x, torch.full((3,), 4.0)) and inner_calls == [True, False]


def test_force_break_splits_with_no_eager_work():
    x = torch.zeros(2)
    pb.force_break()  # outside a capture: nothing
    g = sim_graph()
    with pb.breakable_graph(g):
        x.add_(1)
        pb.force_break()
        x.mul_(3)
    assert segment_kinds(g) == "G G"  # no eager segment (the peers' force_no_graph records an empty one)
    g.replay()
    assert torch.equal(x, torch.full((2,), 3.0))


def test_a_forced_break_is_a_break_the_barrier_runs_before_it():
    order = []
    x = torch.zeros(2)
    g = sim_graph()
    with pb.breakable_graph(g, barrier_fn=lambda: order.append("barrier")):
        x.add_(1)
        pb.force_break()
        order.append("after")
        x.mul_(3)
    assert order == ["barrier", "after"] and segment_kinds(g) == "G G"
    g.replay()
    assert order == ["barrier", "after"]  # at capture only
    assert torch.equal(x, torch.full((2,), 3.0))


def test_is_in_breakable_graph():
    seen = []

    @pb.eager_break
    def probe():
        seen.append(pb.is_in_breakable_graph())

    assert not pb.is_in_breakable_graph()
    g = sim_graph()
    with pb.breakable_graph(g):
        seen.append(pb.is_in_breakable_graph())
        probe()
    g.replay()  # a replay is not a capture
    assert seen == [True, True, False] and not pb.is_in_breakable_graph()
    # a wrapper's FULL capture does not break: not a breakable graph
    full = pb.CUDAGraphWrapper(lambda x: (seen.append(pb.is_in_breakable_graph()), x * 2)[1], M.FULL, config=SIM)
    with pb.set_forward_context(M.FULL, pb.BatchDescriptor(2)):
        full(torch.ones(2))
    assert seen[-1] is False


def test_capture_stub_runs_at_capture_and_the_real_body_on_replay():
    calls = []

    def stub(out, x):
        calls.append("stub")
        out.zero_()

    @pb.eager_break(capture_stub=stub)
    def expensive(out, x):
        calls.append("real")
        out.copy_(x * 10)

    x, out, final = torch.ones(2), torch.zeros(2), torch.zeros(2)
    g = sim_graph()
    with pb.breakable_graph(g):
        expensive(out, x + 1)
        final.copy_(out + 1)
    assert calls == ["stub"]
    g.replay()
    assert calls == ["stub", "real"] and torch.equal(final, torch.full((2,), 21.0))
    expensive(out, x)  # outside a capture: the real body
    assert calls[-1] == "real"


def test_capture_stub_applies_in_a_wrappers_capture_too():
    calls = []

    @pb.eager_break(capture_stub=lambda x: (calls.append("stub"), x * 0)[1])
    def scale(x):
        calls.append("real")
        return x * 2

    w = pb.BreakableCUDAGraphWrapper(lambda x: scale(x + 1) - 1, M.PIECEWISE, config=SIM)
    x = torch.ones(3)
    with pb.set_forward_context(M.PIECEWISE, pb.BatchDescriptor(3)):
        out = w(x)  # captures (the stub), then replays once (the real body)
        assert calls == ["stub", "real"] and torch.equal(out, torch.full((3,), 3.0))
        x.fill_(2.0)
        assert torch.equal(w(x), torch.full((3,), 5.0))


# ---------------------------------------------------------------- what a break returns


def _capture_with_stub(stub, body, x):
    brk = pb.eager_break(body, capture_stub=stub)
    out = torch.zeros_like(x)
    g = sim_graph()
    with pb.breakable_graph(g):
        out.copy_(brk(x) + 1)  # broadcasts a (4,) result over (4, 4) at capture: the stub's shape rules there
    return g


@pytest.mark.parametrize(
    "stub, body, got, want",
    [
        pytest.param(
            lambda x: torch.empty(4, 4), lambda x: x[0] * 2, r"shape \(4,\), dtype torch.float32",
            r"shape \(4, 4\), dtype torch.float32", id="stub-shape",
        ),
        pytest.param(
            lambda x: torch.empty(4, 4, dtype=torch.int64), lambda x: x * 1.5, r"shape \(4, 4\), dtype torch.float32",
            r"shape \(4, 4\), dtype torch.int64", id="float-into-int64",
        ),
    ],
)
def test_a_stub_result_unlike_the_bodys_raises_at_the_first_replay_naming_the_break(stub, body, got, want):
    x = torch.ones(4, 4)
    g = _capture_with_stub(stub, body, x)
    with pytest.raises(RuntimeError, match=rf"break '.*<lambda>' returned a tensor of {got}, on cpu \(output 0\) on "
                       rf"replay, where its capture_stub '.*<lambda>' returned a tensor of {want}, on cpu at capture"):
        g.replay()


def test_a_break_result_that_shrinks_between_capture_and_replay_raises():
    n = [4]

    @pb.eager_break
    def head(x):
        return x[: n[0]] * 2  # a fresh tensor whose length is host state

    x, out = torch.arange(4.0), torch.zeros(4)
    g = sim_graph()
    with pb.breakable_graph(g):
        out.copy_(head(x))
    g.replay()
    assert torch.equal(out, torch.arange(4.0) * 2)
    n[0] = 1  # a (1,) result would broadcast over the (4,) capture-time tensor
    with pytest.raises(RuntimeError, match=r"break '.*head' returned a tensor of shape \(1,\).*where it returned a "
                       r"tensor of shape \(4,\).*would broadcast or cast it silently"):
        g.replay()
    # in a tuple too, and another structure
    results = [(x * 2, x * 3)]

    @pb.eager_break
    def pair(x):
        return results[0]

    g2 = sim_graph()
    with pb.breakable_graph(g2):
        a, b = pair(x)
        out.copy_(a + b)
    results[0] = (x * 2, (x * 3).long())
    with pytest.raises(RuntimeError, match=r"break '.*pair' returned a tensor of shape \(4,\), dtype torch.int64.*"
                       r"\(output 1\) on replay"):
        g2.replay()
    results[0] = (x * 2,)
    with pytest.raises(RuntimeError, match=r"break '.*pair' returned 1 values on replay and 2 at capture"):
        g2.replay()
    results[0] = x * 2
    with pytest.raises(RuntimeError, match=r"returned 1 values on replay and 2 at capture"):
        g2.replay()


def test_a_wrappers_capturing_call_raises_on_a_stub_of_another_shape_and_keeps_no_entry():
    @pb.eager_break(capture_stub=lambda x: torch.empty(3, 3))
    def brk(x):
        return x * 2

    w = pb.BreakableCUDAGraphWrapper(lambda x: brk(x) + 1, M.PIECEWISE, config=SIM)
    with pb.set_forward_context(M.PIECEWISE, pb.BatchDescriptor(3)):
        with pytest.raises(RuntimeError, match=r"break '.*brk' returned a tensor of shape \(3,\)"):
            w(torch.ones(3))  # the capturing call replays at once: the mismatch shows there
    assert w.entries == {} and not capture_active()


@pytest.mark.parametrize("stub", [lambda x: x, lambda x: x.view(-1), lambda x: (x, x * 0)[0:1]], ids=["input", "view", "tuple"])
def test_a_stub_that_returns_its_input_is_refused_at_capture_naming_the_stub(stub):
    @pb.eager_break(capture_stub=stub)
    def double(x):
        return x * 2

    x, out = torch.ones(4), torch.zeros(4)
    g = sim_graph()
    with pytest.raises(RuntimeError, match=r"capture_stub '.*<lambda>' of the break '.*double' returned (its input "
                       r"tensor|a tensor sharing memory with one of its inputs) \(output 0\) at capture.*"
                       r"torch.empty_like"):
        with pb.breakable_graph(g):
            out.copy_(double(x))
    assert g.segments == [] and not capture_active()
    # a fresh stub works, also for a body that returns its input (the body's result is copied into the stub's)
    calls = []

    @pb.eager_break(capture_stub=lambda x: torch.empty_like(x))
    def inplace(x):
        calls.append("body")
        return x.mul_(2)

    g = sim_graph()
    with pb.breakable_graph(g):
        out.copy_(inplace(x + 0) + 1)
    x.fill_(3.0)
    g.replay()
    assert calls == ["body"] and torch.equal(out, torch.full((4,), 7.0))


@pytest.mark.parametrize(
    "result, shown",
    [
        pytest.param(lambda x: x.sum().item(), "float", id="item"),
        pytest.param(lambda x: (x * 2, int(x.sum().item())), "int", id="int-in-a-tuple"),
        pytest.param(lambda x: {"flag": bool(x.sum().item() > 4)}, "bool", id="bool-in-a-dict"),
    ],
)
def test_a_break_may_return_a_python_value_and_a_replay_whose_value_changed_raises(result, shown):
    @pb.eager_break
    def total(x):
        return result(x)

    x, out = torch.ones(4), torch.zeros(4)
    g = sim_graph()
    with pb.breakable_graph(g):  # used to refuse any Python value at capture
        out.fill_(1.0)
        got = total(x)  # x exists before the capture: the break reads its real values
        out.add_(1.0)
    def values(tree):
        return [v for v in tree_leaves(tree) if not isinstance(v, torch.Tensor)]

    kept = [v for _, v in [s for s in g.segments if isinstance(s, EagerSegment)][0].values]
    assert kept and kept == values(got) == values(result(x))  # later segments got the break's real value
    for _ in range(2):
        g.replay()
        assert torch.equal(out, torch.full((4,), 2.0))
    x.fill_(3.0)  # eager gives another value now: the segments after the break were recorded with the old one
    with pytest.raises(RuntimeError, match=rf"break '.*total' returned {shown} .* \(output \d\) on replay, where it "
                       rf"returned {shown} .* at capture: the graph segments after the break were recorded with"):
        g.replay()


def test_a_python_value_the_caller_uses_is_compared_on_replay_nan_equal_to_nan():
    scale = [2.0]

    @pb.no_graph  # the peer's name: its suite returns 1.0 from a no_graph function
    def factor(x):
        x.add_(0)
        return scale[0]

    @pb.no_graph
    def not_a_number(x):
        return float("nan"), None

    x, out = torch.ones(3), torch.zeros(3)
    g = sim_graph()
    with pb.breakable_graph(g):
        y = x * 3
        out.copy_(y * factor(y))
        not_a_number(out)
    x.fill_(2.0)
    g.replay()  # NaN equals NaN: the value did not change
    assert torch.equal(out, torch.full((3,), 12.0))
    scale[0] = 5.0
    with pytest.raises(RuntimeError, match=r"break '.*factor' returned float 5.0 \(output 0\) on replay, where it "
                       r"returned float 2.0 at capture"):
        g.replay()


def test_a_break_returning_an_expanded_tensor_replays_its_new_values():
    """An .expand()ed result cannot be written in place (torch asks for a clone()): the capture keeps a
    dense copy, and every replay copies the break's new result into it."""
    @pb.eager_break
    def row_sum(x):
        return x.sum().reshape(1).expand(3)

    @pb.eager_break
    def pair(x):
        return x.max().reshape(1, 1).expand(2, 3), x

    x, out = torch.ones(3), torch.zeros(3)
    g = sim_graph()
    with pb.breakable_graph(g):
        y = x * 2
        a, same = pair(y)
        out.copy_(row_sum(y) + a[1] + same)
    for value in (2.0, 5.0):
        x.fill_(value)
        g.replay()
        assert torch.equal(out, (x * 2).sum() + (x * 2).max() + x * 2)


def test_a_break_returning_an_object_is_refused_at_capture_and_tensors_carry_live_values():
    @pb.eager_break
    def opaque(x):
        return object()

    x, out = torch.ones(4), torch.zeros(4)
    g = sim_graph()
    with pytest.raises(RuntimeError, match=r"break '.*opaque' returned object .* \(output 0\) at capture: "
                       r"the graph segments after a break read what it returned at capture"):
        with pb.breakable_graph(g):
            opaque(x)
    assert g.segments == [] and not capture_active()
    # a 0-d tensor carries a changing value into the later segments: replays see the live sum
    @pb.eager_break
    def total_tensor(x):
        return x.sum()

    with pb.breakable_graph(g):
        out.fill_(1.0)
        out.mul_(total_tensor(x))
    x.fill_(3.0)
    g.replay()
    assert torch.equal(out, torch.full((4,), 12.0))
    # None, and containers of tensors and None, are fine
    @pb.eager_break
    def nothing(x):
        x.add_(0)
        return (None, x * 1) if x.numel() else None

    with pb.breakable_graph(sim_graph()):
        nothing(x)


def test_eager_break_on_a_partial_and_a_callable_object_names_them():
    import functools

    def scale(x, factor):
        return x * factor

    class Shift:
        def __call__(self, x):
            return x + 1

    part, shift = pb.eager_break(functools.partial(scale, factor=3.0)), pb.eager_break(Shift())
    x, out = torch.ones(2), torch.zeros(2)
    g = sim_graph()
    with pb.breakable_graph(g):  # used to raise AttributeError: ... __qualname__
        out.copy_(shift(part(x)))
    assert segment_kinds(g) == "G E G E G"
    names = [s.name for s in g.segments if isinstance(s, EagerSegment)]
    assert names == ["functools.partial(test_eager_break_on_a_partial_and_a_callable_object_names_them.<locals>.scale)",
                     "test_eager_break_on_a_partial_and_a_callable_object_names_them.<locals>.Shift.__call__"]
    x.fill_(2.0)
    g.replay()
    assert torch.equal(out, torch.full((2,), 7.0))

    bad_partial = pb.eager_break(functools.partial(lambda x, k: [object()] * k, k=2))
    with pytest.raises(RuntimeError, match=r"break 'functools.partial\(.*<lambda>\)' returned object"):
        with pb.breakable_graph(sim_graph()):
            bad_partial(x)


def test_enable_false_leaves_the_function_unchanged():
    def f(x):
        return x

    assert pb.eager_break(f, enable=False) is f
    assert pb.eager_break(enable=False)(f) is f
    assert pb.eager_break(f) is not f and pb.eager_break(f).__pb_break_point__ is f
    with pytest.raises(TypeError, match="capture_stub must be callable"):
        pb.eager_break(f, capture_stub=3)


def test_barrier_fn_runs_before_each_break_at_capture_only():
    order = []

    @pb.eager_break
    def brk():
        order.append("break")

    g = sim_graph()
    with pb.breakable_graph(g, barrier_fn=lambda: order.append("barrier")):
        brk()
        brk()
    assert order == ["barrier", "break", "barrier", "break"]
    g.replay()
    assert order[4:] == ["break", "break"]


def test_the_librarys_own_break_points_break_it_too():
    # a splitting piece of the backend (a compiled model) and a wrapped model, called inside
    with saved_splitting_ops():
        pb.register_splitting_op("pb_test::double")

        class Model(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(4, 4)

            def forward(self, x):
                return self.lin(torch.ops.pb_test.double(self.lin(x)))

        torch._dynamo.reset()
        model = Model()
        compiled, _ = compile_model(model)
        x = torch.randn(3, 4)
        with torch.no_grad():
            compiled(x)  # trace and compile before the capture (a capture runs no compiler)
            out = torch.empty(3, 4)
            g = sim_graph()
            with pb.breakable_graph(g):
                out.copy_(compiled(x))
            assert segment_kinds(g) == "G E G"
            x.copy_(torch.randn(3, 4))
            g.replay()
            torch.testing.assert_close(out, model(x))
    torch._dynamo.reset()


def test_a_wrapper_called_inside_becomes_part_of_its_graph():
    mlp = CountingMLP(4)
    w = pb.BreakableCUDAGraphWrapper(mlp, config=SIM)
    x, out = torch.randn(2, 4), torch.empty(2, 4)
    g = sim_graph()
    with torch.no_grad(), pb.breakable_graph(g), pb.set_forward_context(M.PIECEWISE, pb.BatchDescriptor(2)):
        out.copy_(w(x))
    assert w.entries == {} and mlp.calls == 1  # no entry of its own: recorded into g
    calls = mlp.calls
    g.replay()
    assert mlp.calls == calls  # no Python of the model on replay
    with torch.no_grad():
        torch.testing.assert_close(out, mlp(x))


# ---------------------------------------------------------------- autograd: breaks in forward and backward


def test_a_training_step_with_breaks_in_a_custom_functions_forward_and_backward():
    """The peer's whole-training-step test: a layer that runs eagerly in its forward and its backward.

    The autograd engine runs each backward node under the dispatch state of the ``backward()``
    call and restores the caller's when the node returns: a recorder pushed per segment would be
    dropped at the break inside ``backward`` and the ended one put back (ops recorded into the
    graph before the break, their writes never undone). The simulator records it as a GPU does."""
    import copy

    torch.manual_seed(0)
    n, d_in, hidden, d_out = 8, 16, 12, 4

    @pb.no_graph
    def eager_relu_fwd(out, x):
        out.copy_(torch.relu(x))

    @pb.no_graph
    def eager_relu_bwd(grad_in, grad_out, x):
        grad_in.copy_(grad_out * (x > 0))

    class EagerReLU(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, fwd_out, bwd_out):
            ctx.save_for_backward(x)
            ctx.bwd_out = bwd_out
            eager_relu_fwd(fwd_out, x)
            return fwd_out

        @staticmethod
        def backward(ctx, grad_out):
            (x,) = ctx.saved_tensors
            eager_relu_bwd(ctx.bwd_out, grad_out, x)
            return ctx.bwd_out, None, None

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.l1, self.l2 = torch.nn.Linear(d_in, hidden), torch.nn.Linear(hidden, d_out)
            self.register_buffer("fwd_out", torch.empty(n, hidden))
            self.register_buffer("bwd_out", torch.empty(n, hidden))

        def forward(self, x):
            return self.l2(EagerReLU.apply(self.l1(x), self.fwd_out, self.bwd_out))

    model, loss_fn = Net(), torch.nn.MSELoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    static_input, static_target = torch.randn(n, d_in), torch.randn(n, d_out)
    for _ in range(3):  # warm-up
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(static_input), static_target).backward()
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    before = [p.detach().clone() for p in model.parameters()]
    seq = pb.CUDAGraphSequence(platform="simulated")
    with pb.piecewise_graph(seq):
        loss = loss_fn(model(static_input), static_target)
        with torch.autograd.set_multithreading_enabled(False):  # as the peer's test (CUDA's device threads)
            loss.backward()
        optimizer.step()
    # forward graph, eager forward, backward graph, eager backward, backward graph + optimizer step
    assert segment_kinds(seq) == "G E G E G"
    assert all(len(s) > 0 for s in seq.segments if not isinstance(s, EagerSegment))  # each graph recorded its ops
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the capture ran nothing
    ref = copy.deepcopy(model)
    ref_optimizer = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        data, target = torch.randn_like(static_input), torch.randn_like(static_target)
        static_input.copy_(data)
        static_target.copy_(target)
        for p in model.parameters():
            p.grad.zero_()
        seq.replay()
        ref_optimizer.zero_grad(set_to_none=True)
        loss_fn(ref(data), target).backward()
        ref_optimizer.step()
        for p, p_ref in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, p_ref)


# ---------------------------------------------------------------- failures, each with its cause


def test_nested_captures_raise():
    outer = sim_graph()
    with pytest.raises(RuntimeError, match="captures do not nest"):
        with pb.breakable_graph(outer):
            with pb.breakable_graph(sim_graph()):
                pass
    assert not capture_active() and outer.segments == []
    w = pb.BreakableCUDAGraphWrapper(lambda x: x + 1, config=SIM)
    with pb.set_forward_context(M.PIECEWISE, pb.BatchDescriptor(2)):
        inner = pb.BreakableGraph(platform="simulated")

        def body(x):
            with pb.breakable_graph(inner):
                return x * 2

        w2 = pb.BreakableCUDAGraphWrapper(body, config=SIM)
        with pytest.raises(RuntimeError, match="captures do not nest"):
            w2(torch.ones(2))
        assert w2.entries == {} and not capture_active()
        torch.testing.assert_close(w(torch.ones(2)), torch.full((2,), 2.0))


def test_exception_in_the_body_leaves_nothing_open_and_the_next_capture_works():
    x = torch.ones(2)
    g = sim_graph()
    with pytest.raises(KeyError, match="boom"):
        with pb.breakable_graph(g):
            x.mul_(7)
            dynamic_scale(x)
            raise KeyError("boom")
    assert not capture_active() and not pb.is_in_breakable_graph() and g.segments == []
    assert torch.equal(x, torch.ones(2))  # the captured write was undone, as a capture never ran it
    with pytest.raises(RuntimeError, match="before any capture"):
        g.replay()
    with pb.breakable_graph(g):  # the same graph captures again
        x.mul_(7)
    g.replay()
    assert torch.equal(x, torch.full((2,), 7.0))


def test_a_host_read_outside_a_break_raises_as_cuda_would():
    x = torch.ones(3)
    g = sim_graph()
    with pytest.raises(RuntimeError, match="operation not permitted when stream is capturing.*eager_break"):
        with pb.breakable_graph(g):
            y = x * 2
            if y.sum().item() > 0:
                y.clamp_(min=0)
    assert not capture_active() and g.segments == []


def test_replay_after_reset_raises_and_a_new_capture_works():
    x = torch.ones(2)
    g = sim_graph()
    with pb.breakable_graph(g):
        x.add_(1)
    g.reset()
    with pytest.raises(RuntimeError, match=r"replay\(\) after reset\(\)"):
        g.replay()
    with pb.breakable_graph(g):
        x.add_(2)
    g.replay()
    assert torch.equal(x, torch.full((2,), 3.0))
    with pytest.raises(RuntimeError, match="already holds a capture"):
        with pb.breakable_graph(g):
            pass


def test_bad_arguments_name_the_value_and_what_is_valid():
    with pytest.raises(ValueError, match="platform must be one of .*'gpu'"):
        pb.BreakableGraph(platform="gpu")
    with pytest.raises(TypeError, match="pool must be another graph's pool"):
        pb.BreakableGraph(pool=(0, 1), platform="simulated")
    with pytest.raises(TypeError, match="captures into a pb.BreakableGraph"):
        with pb.breakable_graph(object()):
            pass
    with pytest.raises(ValueError, match="capture_error_mode must be one of"):
        with pb.breakable_graph(sim_graph(), capture_error_mode="strict"):
            pass
    with pytest.raises(TypeError, match="barrier_fn must be a callable"):
        with pb.breakable_graph(sim_graph(), barrier_fn=1):
            pass
    with pytest.raises(ValueError, match="no CUDA streams"):
        with pb.breakable_graph(sim_graph(), stream=object()):
            pass
    assert not capture_active()


def test_captures_on_two_threads_run_one_at_a_time():
    # the one real difference from breakable-cuda-graphs: one capture at a time per process
    inside, release, order = threading.Event(), threading.Event(), []

    def first():
        with pb.breakable_graph(sim_graph()):
            order.append("first in")
            inside.set()
            release.wait(20)
        order.append("first out")

    def second():
        with pb.breakable_graph(sim_graph()):
            order.append("second in")

    t1 = threading.Thread(target=first)
    t1.start()
    assert inside.wait(20)
    t2 = threading.Thread(target=second)
    t2.start()
    t2.join(0.3)
    assert t2.is_alive() and order == ["first in"]
    release.set()
    t1.join(20)
    t2.join(20)
    assert order == ["first in", "first out", "second in"]


# ---------------------------------------------------------------- memory


def test_each_graph_has_a_pool_of_its_own_unless_given_one():
    a, b = sim_graph(), sim_graph()
    assert a.pool() is not b.pool() and a.pool().handle is not b.pool().handle
    shared = pb.BreakableGraph(pool=a.pool(), platform="simulated")
    assert shared.pool() is a.pool()
    x = torch.ones(256)
    with pb.breakable_graph(a):
        y = x * 2
        x.copy_(y + 1)
    assert a.memory_bytes > 0 and a.pool().memory_bytes() == a.memory_bytes
    assert b.pool().memory_bytes() == 0  # another graph's pool saw nothing
    assert g_shared_capture_reuses(shared, x) == 0  # the freed block of a's capture is reused


def g_shared_capture_reuses(g: pb.BreakableGraph, x: torch.Tensor) -> int:
    with pb.breakable_graph(g):
        y = x * 3
        x.copy_(y)
    return g.memory_bytes


def test_breaks_hold_capture_memory_only_weakly():
    seen = {}

    @pb.eager_break
    def keep(h):
        seen["h"] = h
        return None

    g = sim_graph()
    x = torch.ones(64)
    with pb.breakable_graph(g):
        keep(x * 2)  # a capture-time tensor, referenced only by the break
    (seg,) = [s for s in g.segments if isinstance(s, EagerSegment)]
    assert pb.is_weak(seg.args[0]) and g.pool().handle.owns(seg.args[0])
    assert not pb.is_weak(seen["h"])
    del seen["h"]
    assert g.pool().handle.allocated() == 0  # nothing but weak views: the block is free for the next capture


def test_a_tensor_made_before_the_capture_is_held_strongly_until_reset():
    # the other half of the rule (docs/concepts.md, docs/migration.md): only pool memory is held weakly
    import weakref

    @pb.eager_break
    def scale_into(dst, src):
        dst.copy_(src * 2)

    src, dst = torch.ones(8), torch.zeros(8)
    g = sim_graph()
    with pb.breakable_graph(g):
        scale_into(dst, src)
    (seg,) = [s for s in g.segments if isinstance(s, EagerSegment)]
    assert seg.args[0] is dst and seg.args[1] is src and not pb.is_weak(src)
    gone = weakref.ref(src)
    del src, seg
    gc.collect()
    assert gone() is not None  # the graph keeps the caller's tensor alive: replays still read it
    gone().fill_(5.0)
    g.replay()
    assert torch.equal(dst, torch.full((8,), 10.0))
    g.reset()
    gc.collect()
    assert gone() is None  # reset() drops it


# ---------------------------------------------------------------- the CUDA platform (CPU double)


@pytest.fixture
def fake(monkeypatch):
    with cuda_double.installed() as fake:
        yield fake
        cuda_double.check_clean(fake)


def device_workload(fake, *, fork: str | None = None):
    """The peer's workload as a GPU runs it, told to the double; ``fork``: where a side stream forks unjoined."""
    fake.launch(writes="dst")
    side = torch.cuda.Stream()
    if fork:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fake.launch()
        if fork == "joined":
            torch.cuda.current_stream().wait_stream(side)
    host_break(fake)
    fake.launch(reads="dst")
    return side


@pb.eager_break
def host_break(fake) -> None:
    fake.host_sync(".item()")  # legal between segments


def test_cuda_private_pools_streams_and_modes(fake, monkeypatch):
    monkeypatch.setattr(platforms_base, "_gc_probe", [lambda: True])
    g1 = pb.BreakableGraph()  # "auto": CUDA (the double says a GPU is present)
    assert g1.platform.name == "cuda"
    with pb.breakable_graph(g1):
        device_workload(fake)
    assert segment_kinds(g1) == "G E G"
    pools = {s.graph.pool_id for s in g1.segments if not isinstance(s, EagerSegment)}
    assert len(pools) == 1 and pools != {g1.platform.pool_id}  # one pool, not the wrappers' shared one
    g1.replay()
    g2 = pb.BreakableGraph(pool=g1.pool())
    s = torch.cuda.Stream()
    with pytest.raises(ValueError, match="captures on .*stream of its first capture"):
        with pb.breakable_graph(g2, stream=s):
            pass
    with pb.breakable_graph(g2, capture_error_mode="thread_local"):
        device_workload(fake)
    assert {seg.graph.pool_id for seg in g2.segments if not isinstance(seg, EagerSegment)} == pools
    assert all(x.graph.capture.mode == "thread_local" for x in g2.segments if hasattr(x, "graph"))
    g3 = pb.BreakableGraph()
    with pb.breakable_graph(g3, stream=s):
        device_workload(fake)
    assert {x.graph.stream for x in g3.segments if hasattr(x, "graph")} == {s}
    assert {x.graph.pool_id for x in g3.segments if hasattr(x, "graph")}.isdisjoint(pools)
    with pytest.raises(ValueError, match="default stream"):
        with pb.breakable_graph(pb.BreakableGraph(), stream=torch.cuda.default_stream()):
            pass


@pytest.mark.parametrize("where", ["break", "end"])
def test_cuda_unjoined_side_stream_is_named(fake, monkeypatch, where):
    monkeypatch.setattr(platforms_base, "_gc_probe", [lambda: True])
    g = pb.BreakableGraph()
    with pytest.raises(pb.CaptureInvalidatedError, match=r"side stream FakeStream\(id=\d+.* was not joined back") as info:
        with pb.breakable_graph(g):
            if where == "break":
                device_workload(fake, fork="unjoined")
            else:
                fake.launch()
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    fake.launch()
    note = "the break 'host_break'" if where == "break" else "the end of the capture"
    assert any(note in n for n in info.value.__notes__)
    assert not capture_active() and g.segments == []
    with pb.breakable_graph(g):  # the next capture works (a fresh pool)
        device_workload(fake, fork="joined")
    assert segment_kinds(g) == "G E G"
    g.replay()


@pytest.mark.parametrize("force", [False, True], ids=["default", "force_cudagraph_gc"])
def test_cuda_gc_collected_at_most_once_per_capture_of_64_breaks(fake, monkeypatch, force):
    # as torch.cuda.graph: no collection unless torch.compiler.config.force_cudagraph_gc, then one, never per segment
    monkeypatch.setattr(platforms_base, "_gc_probe", [lambda: False])
    collected = []
    monkeypatch.setattr(gc, "collect", lambda *a: collected.append(a) or 0)
    g = pb.BreakableGraph()
    with torch.compiler.config.patch(force_cudagraph_gc=force), pb.breakable_graph(g):
        for _ in range(64):
            fake.launch()
            host_break(fake)
        fake.launch()
    assert g.num_breaks == 64 and g.num_graphs == 65 and len(collected) == int(force)
    g.replay()


def test_cuda_private_pool_ends_with_its_last_graph(fake, monkeypatch):
    monkeypatch.setattr(platforms_base, "_gc_probe", [lambda: True])
    g = pb.BreakableGraph()
    with pb.breakable_graph(g):
        device_workload(fake)
    platform = g.platform
    gen = g.pool().handle.gen
    assert gen.id in {tuple(p.id) for p in platform.pools}  # counted in the platform's memory and owner tests
    shared = pb.BreakableGraph(pool=g.pool())
    del g
    platform.release_cached()
    assert gen.id in {tuple(p.id) for p in platform.pools}  # the pool object lives on in `shared`
    del shared
    platform.release_cached()
    assert gen.id not in {tuple(p.id) for p in platform.pools} and gen.id in platform.generations.retired
