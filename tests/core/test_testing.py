"""pb.testing.graph_code: normalized FX code for users' expecttests."""

from __future__ import annotations

import re

import expecttest
import pytest
import torch
import torch.fx as fx

import piecewise_backend as pb
from pbtest.helpers import dynamo_graphs

graph_code = pb.testing.graph_code


def hand_graph(sym_a: str, sym_b: str, unbacked: str) -> fx.GraphModule:
    """x.view(a, -1) * b + u, with the symbol placeholders named as given."""
    g = fx.Graph()
    a = g.placeholder(sym_a)
    b = g.placeholder(sym_b)
    u = g.placeholder(unbacked)
    x = g.placeholder("x")
    v = g.call_method("view", (x, a, -1))
    m = g.call_function(torch.mul, (v, b))
    r = g.call_function(torch.add, (m, u))
    g.output((r, v))
    return fx.GraphModule(torch.nn.Module(), g)


def test_symbols_renamed_in_order_of_appearance_per_prefix():
    code = graph_code(hand_graph("s72", "s13", "u7"))
    assert re.findall(r"\b[su]\d+\b", code)[:3] == ["s0", "s1", "u0"]
    assert "s72" not in code and "s13" not in code and "u7" not in code


def test_hash_derived_names_do_not_matter():
    assert graph_code(hand_graph("s72", "s13", "u7")) == graph_code(hand_graph("s5", "s99", "u0"))
    # a name already of the s<k> form does not collide with the renaming
    assert graph_code(hand_graph("s1", "s0", "u3")) == graph_code(hand_graph("s72", "s13", "u7"))
    assert graph_code(hand_graph("s72", "s13", "u7")) != graph_code(hand_graph("s13", "s13x", "u7"))


def test_no_liveness_tails_comments_or_blank_lines():
    gm = hand_graph("s72", "s13", "u7")
    assert "= None" in gm.code  # the raw code has liveness tails
    code = graph_code(gm)
    assert "= None" not in code and ";" not in code
    lines = code.splitlines()
    assert code.endswith("\n") and not code.endswith("\n\n")
    assert all(line.strip() for line in lines)
    assert all(line == line.rstrip() for line in lines)
    assert lines[0].startswith("def forward(self, s0, s1, u0, x)")


class GraphCodeGolden(expecttest.TestCase):
    def test_keeps_the_computation(self):
        self.assertExpectedInline(
            graph_code(hand_graph("s72", "s13", "u7")),
            """\
def forward(self, s0, s1, u0, x):
    view = x.view(s0, -1)
    mul = torch.mul(view, s1)
    add = torch.add(mul, u0)
    return (add, view)
""",
        )


def test_graph_and_graph_module_give_the_same_text():
    gm = hand_graph("s72", "s13", "u7")
    assert graph_code(gm.graph) == graph_code(gm)


@pytest.fixture(scope="module")
def dynamo_gm():
    def fn(x, y):
        n = x.shape[0]
        return (x.sin() + y.view(n, -1)).relu(), x.size()

    x, y = torch.randn(4, 3), torch.randn(12)
    torch._dynamo.mark_dynamic(x, 0)
    torch._dynamo.mark_dynamic(y, 0)
    (gm,) = dynamo_graphs(fn, x, y)
    return gm


def test_dynamo_graph_has_no_paths_and_normalized_symbols(dynamo_gm):
    # the premise: Dynamo recorded source locations and hash-derived symbols
    assert "# File:" in dynamo_gm.print_readable(print_output=False)
    raw_symbols = set(re.findall(r"\bs\d+\b", dynamo_gm.code))
    assert len(raw_symbols) == 2 and raw_symbols != {"s0", "s1"}
    code = graph_code(dynamo_gm)
    assert "# File" not in code and __file__ not in code and ".py:" not in code
    assert "= None" not in code
    assert set(re.findall(r"\bs\d+\b", code)) == {"s0", "s1"}


def test_stable_across_calls_and_captures(dynamo_gm):
    assert graph_code(dynamo_gm) == graph_code(dynamo_gm)

    def fn(x, y):
        n = x.shape[0]
        return (x.sin() + y.view(n, -1)).relu(), x.size()

    x, y = torch.randn(6, 3), torch.randn(18)
    torch._dynamo.mark_dynamic(x, 0)
    torch._dynamo.mark_dynamic(y, 0)
    (again,) = dynamo_graphs(fn, x, y)
    assert graph_code(again) == graph_code(dynamo_gm)


def test_split_pieces_are_normalized_too(dynamo_gm):
    split = pb.split_graph(dynamo_gm, [torch.relu])  # Tensor.relu is a method call: no split
    assert len(split.pieces) == 1
    code = graph_code(split.pieces[0].module)
    assert "= None" not in code and "s0" in code
