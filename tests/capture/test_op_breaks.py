"""Splitting ops as run-time breaks of an uncompiled model (capture/op_breaks.py, ``compile_pieces="none"``),
on the simulated platform: which calls break, replays run them on live data, FULL holds them inline, and the
refusals (a plain Python callable, a backend, per-piece graphs, cache_dir)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import piecewise_backend as pb
from pbtest.helpers import run, segment_kinds
from piecewise_backend.capture.op_breaks import OpBreaks, op_breaks, uninterceptable
from piecewise_backend.runner import StaticInput

M = pb.CUDAGraphMode
D4 = pb.BatchDescriptor(4)
CALLS = [0]


@torch.library.custom_op("pbtest_opbreaks::double", mutates_args=())
def double(x: torch.Tensor) -> torch.Tensor:
    CALLS[0] += 1
    return x * 2


@double.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class Model(torch.nn.Module):
    """linear, the op, linear: ``call`` picks how the op is called (packet, overload, CustomOpDef)."""

    def __init__(self, call=lambda x: torch.ops.pbtest_opbreaks.double(x)):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.call = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.call(self.a(x).relu()))


def none_config(**kw) -> pb.CompilationConfig:
    return pb.CompilationConfig(platform="simulated", compile_pieces="none", **kw)


def x4(seed: int) -> torch.Tensor:
    return torch.randn(4, 4, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("call", [
    lambda x: torch.ops.pbtest_opbreaks.double(x), lambda x: torch.ops.pbtest_opbreaks.double.default(x), double,
], ids=["packet", "overload", "custom_op_def"])
def test_a_registered_torch_op_is_a_break_and_replays_run_it_on_live_data(call):
    model = Model(call)
    w = pb.BreakableCUDAGraphWrapper(model, M.PIECEWISE, config=none_config(splitting_ops=["pbtest_opbreaks::double"]))
    x = x4(0)
    with torch.no_grad(), pb.expect(captures=1, breaks=1):
        first = run(w, M.PIECEWISE, D4, x)
        assert segment_kinds(w.entries[D4]) == "G E G"
        assert_close(first, model(x))
        calls = CALLS[0]
        x.copy_(x4(1))  # the same static input, new values
        with pb.expect(replays=1, captures=0):
            again = run(w, M.PIECEWISE, D4, x)
    assert CALLS[0] == calls + 1  # the op's Python ran on replay, between the two graph segments
    with torch.no_grad():
        assert_close(again, model(x4(1)))


def test_the_default_registry_breaks_at_sdpa():
    def attention(x: torch.Tensor) -> torch.Tensor:
        q = x.view(1, 1, 4, 4)
        return F.scaled_dot_product_attention(q, q, q).view(4, 4)

    model = Model(attention)
    w = pb.BreakableCUDAGraphWrapper(model, M.PIECEWISE, config=none_config())  # splitting_ops=None: the registry
    with torch.no_grad():
        out = run(w, M.PIECEWISE, D4, x4(0))
        assert segment_kinds(w.entries[D4]) == "G E G"
        assert_close(out, model(x4(0)))


def test_full_graphs_hold_the_op_inline():
    model = Model()
    config = none_config(splitting_ops=["pbtest_opbreaks::double"])
    w = pb.CUDAGraphWrapper(pb.BreakableCUDAGraphWrapper(model, M.PIECEWISE, config=config), M.FULL, config=config)
    calls = CALLS[0]
    with torch.no_grad(), pb.expect(breaks=0):
        out = run(w, M.FULL, D4, x4(0))
        assert segment_kinds(w.entries[D4]) == "G"
        run(w, M.FULL, D4, x4(0))
    assert CALLS[0] == calls + 1  # captured once, never run again: the graph holds it
    with torch.no_grad():
        assert_close(out, model(x4(0)))


def test_outside_a_breakable_capture_the_mode_passes_calls_through():
    calls = CALLS[0]
    with OpBreaks(["pbtest_opbreaks::double"]), torch.no_grad(), pb.expect(breaks=0):
        out = torch.ops.pbtest_opbreaks.double(torch.ones(2))
    assert CALLS[0] == calls + 1 and out.tolist() == [2.0, 2.0]


def my_attention(x: torch.Tensor) -> torch.Tensor:
    return x


def test_a_plain_python_callable_is_refused_naming_it():
    assert uninterceptable([my_attention, F.scaled_dot_product_attention, "ns::op"]) == [my_attention]
    config = none_config(splitting_ops=[my_attention, "pbtest_opbreaks::double"])
    with pytest.raises(ValueError, match=r"compile_pieces=\"none\"\) is refused: the splitting op\(s\) "
                                         r".*test_op_breaks\.my_attention are plain Python callables"):
        pb.BreakableCUDAGraphWrapper(Model(), M.PIECEWISE, config=config)
    with pytest.raises(ValueError, match="my_attention"):
        pb.GraphRunner(Model(), config, [StaticInput("x", shape=(4,), dtype=torch.float32)])  # up front


def test_an_eager_break_function_is_accepted_and_breaks_on_its_own():
    broken = pb.eager_break(lambda x: x * 3)
    assert uninterceptable([broken]) == []
    assert isinstance(op_breaks([broken]), OpBreaks)
    model = Model(broken)
    w = pb.BreakableCUDAGraphWrapper(model, M.PIECEWISE, config=none_config(splitting_ops=[broken]))
    with torch.no_grad():
        out = run(w, M.PIECEWISE, D4, x4(0))
        assert segment_kinds(w.entries[D4]) == "G E G"
        assert_close(out, model(x4(0)))


def test_a_backend_of_none_is_refused_with_what_to_use():
    with pytest.raises(ValueError, match=r"compile_pieces='none'\) is refused: 'none' means no Dynamo .* use "
                                         r"compile_pieces='eager' or 'inductor'"):
        pb.make_backend(none_config())


@pytest.mark.parametrize("kw, match", [
    (dict(use_breakable=False), r"compile_pieces='none', use_breakable=False\) is refused"),
    (dict(cache_dir="/tmp/x"), r"compile_pieces='none', cache_dir=...\) is refused"),
    (dict(use_inductor_graph_partition=True), "use_inductor_graph_partition=True is refused"),
])
def test_what_needs_compiled_pieces_is_refused_by_the_config(kw, match):
    with pytest.raises(ValueError, match=match):
        none_config(**kw)


def test_the_mode_also_breaks_a_breakable_graph_of_plain_code():
    model, x = Model(), x4(0)
    g = pb.BreakableGraph(platform="simulated")
    with torch.no_grad(), OpBreaks(["pbtest_opbreaks::double"]), pb.expect(breaks=1):
        with pb.breakable_graph(g):
            out = model(x)
    assert sum(1 for s in g.segments if type(s).__name__ == "EagerSegment") == 1
    x.copy_(x4(1))
    g.replay()
    with torch.no_grad():
        assert_close(out, model(x4(1)))
