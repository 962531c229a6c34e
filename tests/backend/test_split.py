"""split_graph: golden splits and the splitting rules (DESIGN 4.2).

Graphs come from Dynamo through a pass-through capturing backend, as the real backend sees them.
"""

from __future__ import annotations

import operator

import expecttest
import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

import piecewise_backend as pb
from pbtest.helpers import double, dynamo_graphs, make_model, token_ids


@torch.library.custom_op("pb_test_split::pair", mutates_args=())
def pair(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x * 2, x + 1


@pair.register_fake
def _(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(x)


TOY_OPS = ["pb_toy::attention", "pb_toy::attention_fresh"]
TEST_OPS = ["pb_test::double", "pb_test::double_into", "pb_test_split::pair"]


def toy_graph(num_layers: int, attention: str, tokens: int = 5) -> fx.GraphModule:
    model = make_model(num_layers, attention)
    (gm,) = dynamo_graphs(model, token_ids(tokens))
    return gm


def split_and_run(fn, ops, *args):
    """Compile ``fn`` with a backend that splits at ``ops`` and runs the split graph.

    Returns (SplitGraph, compiled output, {piece name: [argument types of each call]}).
    """
    splits: list[pb.SplitGraph] = []
    calls: dict[str, list[list[type]]] = {}

    def recording(name, module):
        def run(*a):
            calls.setdefault(name, []).append([type(x) for x in a])
            return module(*a)

        return run

    def backend(gm, example_inputs, **kwargs):
        split = pb.split_graph(gm, ops)
        for p in split.pieces:
            split.split_gm.__dict__[p.name] = recording(p.name, p.module)
        splits.append(split)
        return split.split_gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    (split,) = splits
    return split, out, calls


def call_nodes(module: fx.GraphModule) -> list[fx.Node]:
    return [n for n in module.graph.nodes if n.op in ("call_function", "call_method", "call_module")]


def targets(module: fx.GraphModule) -> list:
    return [n.target for n in call_nodes(module)]


def kinds(split: pb.SplitGraph) -> str:
    return "".join("S" if p.is_splitting else "C" for p in split.pieces)


def assert_no_container_or_size_crosses(split: pb.SplitGraph, calls=None) -> None:
    for p in split.pieces:
        for n in p.module.graph.nodes:
            if n.op == "placeholder":
                ev = n.meta.get("example_value")
                assert not isinstance(ev, (tuple, list, torch.Size)), (p.name, n.name, type(ev))
            if n.target is operator.getitem:
                producer = n.args[0]
                assert producer.op != "placeholder", f"{p.name}: {n.name} indexes a piece input"
    for name, arg_lists in (calls or {}).items():
        for types in arg_lists:
            for t in types:
                assert not issubclass(t, (tuple, list, torch.Size)), (name, types)


# ---------------------------------------------------------------- golden splits


class GoldenSplitTest(expecttest.TestCase):
    """The 2-layer toy model ("inplace" attention) split at its attention op."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.split = pb.split_graph(toy_graph(2, "inplace"), ["pb_toy::attention"])

    def test_five_pieces(self):
        # 2N+1 pieces for N=2 layers, N+1 of them compiled, in execution order
        got = [(p.name, p.index, p.is_splitting) for p in self.split.pieces]
        self.assertEqual(
            got,
            [(f"submod_{i}", i, i % 2 == 1) for i in range(5)],
        )

    def test_split_gm(self):
        self.assertExpectedInline(
            pb.testing.graph_code(self.split.split_gm),
            """\
def forward(self, L_self_modules_embed_parameters_weight_ : torch.nn.parameter.Parameter, s0 : torch.SymInt, L_input_ids_ : torch.Tensor, L_self_modules_layers_modules_0_modules_input_norm_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_layers_modules_0_modules_qkv_proj_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_layers_modules_0_modules_o_proj_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_layers_modules_0_modules_post_norm_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_layers_modules_0_modules_gate_up_proj_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_layers_modules_0_modules_down_proj_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_layers_modules_1_modules_input_norm_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_layers_modules_1_modules_qkv_proj_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_layers_modules_1_modules_o_proj_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_layers_modules_1_modules_post_norm_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_layers_modules_1_modules_gate_up_proj_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_layers_modules_1_modules_down_proj_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_norm_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_lm_head_parameters_weight_ : torch.nn.parameter.Parameter):
    l_self_modules_embed_parameters_weight_ = L_self_modules_embed_parameters_weight_
    l_input_ids_ = L_input_ids_
    l_self_modules_layers_modules_0_modules_input_norm_parameters_weight_ = L_self_modules_layers_modules_0_modules_input_norm_parameters_weight_
    l_self_modules_layers_modules_0_modules_qkv_proj_parameters_weight_ = L_self_modules_layers_modules_0_modules_qkv_proj_parameters_weight_
    l_self_modules_layers_modules_0_modules_o_proj_parameters_weight_ = L_self_modules_layers_modules_0_modules_o_proj_parameters_weight_
    l_self_modules_layers_modules_0_modules_post_norm_parameters_weight_ = L_self_modules_layers_modules_0_modules_post_norm_parameters_weight_
    l_self_modules_layers_modules_0_modules_gate_up_proj_parameters_weight_ = L_self_modules_layers_modules_0_modules_gate_up_proj_parameters_weight_
    l_self_modules_layers_modules_0_modules_down_proj_parameters_weight_ = L_self_modules_layers_modules_0_modules_down_proj_parameters_weight_
    l_self_modules_layers_modules_1_modules_input_norm_parameters_weight_ = L_self_modules_layers_modules_1_modules_input_norm_parameters_weight_
    l_self_modules_layers_modules_1_modules_qkv_proj_parameters_weight_ = L_self_modules_layers_modules_1_modules_qkv_proj_parameters_weight_
    l_self_modules_layers_modules_1_modules_o_proj_parameters_weight_ = L_self_modules_layers_modules_1_modules_o_proj_parameters_weight_
    l_self_modules_layers_modules_1_modules_post_norm_parameters_weight_ = L_self_modules_layers_modules_1_modules_post_norm_parameters_weight_
    l_self_modules_layers_modules_1_modules_gate_up_proj_parameters_weight_ = L_self_modules_layers_modules_1_modules_gate_up_proj_parameters_weight_
    l_self_modules_layers_modules_1_modules_down_proj_parameters_weight_ = L_self_modules_layers_modules_1_modules_down_proj_parameters_weight_
    l_self_modules_norm_parameters_weight_ = L_self_modules_norm_parameters_weight_
    l_self_modules_lm_head_parameters_weight_ = L_self_modules_lm_head_parameters_weight_
    submod_0 = self.submod_0(l_input_ids_, s0, l_self_modules_embed_parameters_weight_, l_self_modules_layers_modules_0_modules_input_norm_parameters_weight_, l_self_modules_layers_modules_0_modules_qkv_proj_parameters_weight_)
    getitem = submod_0[0]
    getitem_1 = submod_0[1]
    getitem_2 = submod_0[2]
    getitem_3 = submod_0[3]
    getitem_4 = submod_0[4]
    submod_1 = self.submod_1(getitem, s0, getitem_1, getitem_2, getitem_3)
    submod_2 = self.submod_2(getitem_3, s0, l_self_modules_layers_modules_0_modules_o_proj_parameters_weight_, getitem_4, l_self_modules_layers_modules_0_modules_post_norm_parameters_weight_, l_self_modules_layers_modules_0_modules_gate_up_proj_parameters_weight_, l_self_modules_layers_modules_0_modules_down_proj_parameters_weight_, l_self_modules_layers_modules_1_modules_input_norm_parameters_weight_, l_self_modules_layers_modules_1_modules_qkv_proj_parameters_weight_)
    getitem_5 = submod_2[0]
    getitem_6 = submod_2[1]
    getitem_7 = submod_2[2]
    getitem_8 = submod_2[3]
    getitem_9 = submod_2[4]
    submod_3 = self.submod_3(getitem_5, s0, getitem_6, getitem_7, getitem_8)
    submod_4 = self.submod_4(getitem_8, s0, l_self_modules_layers_modules_1_modules_o_proj_parameters_weight_, getitem_9, l_self_modules_layers_modules_1_modules_post_norm_parameters_weight_, l_self_modules_layers_modules_1_modules_gate_up_proj_parameters_weight_, l_self_modules_layers_modules_1_modules_down_proj_parameters_weight_, l_self_modules_norm_parameters_weight_, l_self_modules_lm_head_parameters_weight_)
    return (submod_4,)
""",
        )

    def test_middle_compiled_piece(self):
        piece = self.split.pieces[2]
        self.assertFalse(piece.is_splitting)
        self.assertExpectedInline(
            pb.testing.graph_code(piece.module),
            """\
def forward(self, out, s0 : torch.SymInt, l_self_modules_layers_modules_0_modules_o_proj_parameters_weight_ : torch.nn.parameter.Parameter, x, l_self_modules_layers_modules_0_modules_post_norm_parameters_weight_ : torch.nn.parameter.Parameter, l_self_modules_layers_modules_0_modules_gate_up_proj_parameters_weight_ : torch.nn.parameter.Parameter, l_self_modules_layers_modules_0_modules_down_proj_parameters_weight_ : torch.nn.parameter.Parameter, l_self_modules_layers_modules_1_modules_input_norm_parameters_weight_ : torch.nn.parameter.Parameter, l_self_modules_layers_modules_1_modules_qkv_proj_parameters_weight_ : torch.nn.parameter.Parameter):
    reshape = out.reshape(s0, 32)
    linear = torch._C._nn.linear(reshape, l_self_modules_layers_modules_0_modules_o_proj_parameters_weight_, None)
    add = x + linear
    pow_1 = add.pow(2)
    mean = pow_1.mean(-1, keepdim = True)
    add_1 = mean + 1e-06
    rsqrt = torch.rsqrt(add_1)
    mul = add * rsqrt
    mul_1 = mul * l_self_modules_layers_modules_0_modules_post_norm_parameters_weight_
    linear_1 = torch._C._nn.linear(mul_1, l_self_modules_layers_modules_0_modules_gate_up_proj_parameters_weight_, None)
    chunk = linear_1.chunk(2, dim = -1)
    getitem = chunk[0]
    getitem_1 = chunk[1]
    silu = torch.nn.functional.silu(getitem)
    mul_2 = silu * getitem_1
    linear_2 = torch._C._nn.linear(mul_2, l_self_modules_layers_modules_0_modules_down_proj_parameters_weight_, None)
    add_2 = add + linear_2
    pow_2 = add_2.pow(2)
    mean_1 = pow_2.mean(-1, keepdim = True)
    add_3 = mean_1 + 1e-06
    rsqrt_1 = torch.rsqrt(add_3)
    mul_3 = add_2 * rsqrt_1
    mul_4 = mul_3 * l_self_modules_layers_modules_1_modules_input_norm_parameters_weight_
    linear_3 = torch._C._nn.linear(mul_4, l_self_modules_layers_modules_1_modules_qkv_proj_parameters_weight_, None)
    view = linear_3.view(s0, 3, 4, 8)
    unbind = view.unbind(1)
    getitem_2 = unbind[0]
    getitem_3 = unbind[1]
    getitem_4 = unbind[2]
    contiguous = getitem_2.contiguous()
    contiguous_1 = getitem_3.contiguous()
    contiguous_2 = getitem_4.contiguous()
    empty_like = torch.empty_like(contiguous)
    return (contiguous, contiguous_1, contiguous_2, empty_like, add_2)
""",
        )

    def test_splitting_piece(self):
        piece = self.split.pieces[3]
        self.assertTrue(piece.is_splitting)
        self.assertExpectedInline(
            pb.testing.graph_code(piece.module),
            """\
def forward(self, contiguous_3, s0 : torch.SymInt, contiguous_4, contiguous_5, out_1):
    attention = torch.ops.pb_toy.attention(contiguous_3, contiguous_4, contiguous_5, out_1, 1)
    return ()
""",
        )

    def test_golden_text_is_stable_across_captures(self):
        again = pb.split_graph(toy_graph(2, "inplace", tokens=7), ["pb_toy::attention"])
        self.assertEqual(pb.testing.graph_code(again.split_gm), pb.testing.graph_code(self.split.split_gm))
        self.assertEqual(
            [pb.testing.graph_code(p.module) for p in again.pieces],
            [pb.testing.graph_code(p.module) for p in self.split.pieces],
        )


# ---------------------------------------------------------------- the toy model: 2N+1 pieces


@pytest.fixture(scope="module")
def toy_graphs():
    # N=2 "inplace" is the golden graph above; N=2 "fresh" is run in test_toy_model_split_runs_like_eager
    return {key: toy_graph(*key) for key in TOY_CASES}


TOY_CASES = [(1, "inplace"), (3, "fresh")]


@pytest.mark.parametrize("num_layers,attention", TOY_CASES)
def test_toy_model_splits_into_2n_plus_1_pieces(toy_graphs, num_layers, attention):
    gm = toy_graphs[(num_layers, attention)]
    code_before = gm.code
    split = pb.split_graph(gm, TOY_OPS)
    assert gm.code == code_before, "split_graph must not modify its input"
    assert len(split.pieces) == 2 * num_layers + 1
    assert kinds(split) == "C" + "SC" * num_layers
    assert sum(not p.is_splitting for p in split.pieces) == num_layers + 1
    assert split.num_splitting == num_layers
    assert [p.index for p in split.pieces] == list(range(2 * num_layers + 1))
    op = torch.ops.pb_toy.attention if attention == "inplace" else torch.ops.pb_toy.attention_fresh
    for layer, p in enumerate(p for p in split.pieces if p.is_splitting):
        (node,) = call_nodes(p.module)  # the attention call and nothing else
        assert node.target is op
        assert node.args[-1] == layer
    assert split.found_ops == ["pb_toy::attention" if attention == "inplace" else "pb_toy::attention_fresh"]
    assert_no_container_or_size_crosses(split)


def test_toy_model_split_runs_like_eager():
    model = make_model(2, "fresh")
    ids = token_ids(6)
    split, out, calls = split_and_run(model, TOY_OPS, ids)
    with torch.no_grad():
        torch.testing.assert_close(out, model(ids))
    assert kinds(split) == "CSCSC"
    assert sorted(calls) == [p.name for p in split.pieces]  # every piece ran once
    assert all(len(v) == 1 for v in calls.values())
    assert_no_container_or_size_crosses(split, calls)


def test_no_splitting_ops_gives_one_compiled_piece(toy_graphs):
    split = pb.split_graph(toy_graphs[(1, "inplace")], [])
    assert kinds(split) == "C"
    assert split.found_ops == []
    split = pb.split_graph(toy_graphs[(1, "inplace")], ["pb_test::double"])  # not in the graph
    assert kinds(split) == "C" and split.found_ops == []


# ---------------------------------------------------------------- consecutive ops, getitem


def test_consecutive_splitting_ops_form_one_piece():
    def fn(x):
        y = torch.ops.pb_test.double(x + 1)
        y = torch.ops.pb_test.double(y)
        y = torch.ops.pb_test.double(y)
        return y * 3

    x = torch.randn(4, 3)
    split, out, calls = split_and_run(fn, TEST_OPS, x)
    torch.testing.assert_close(out, fn(x))
    assert kinds(split) == "CSC"
    assert targets(split.pieces[1].module) == [torch.ops.pb_test.double] * 3


def test_tuple_output_of_splitting_op_is_unpacked_inside_its_piece():
    def fn(x):
        a, b = torch.ops.pb_test_split.pair(x + 1)
        return a * b

    x = torch.randn(5)
    split, out, calls = split_and_run(fn, TEST_OPS, x)
    torch.testing.assert_close(out, fn(x))
    assert kinds(split) == "CSC"
    assert targets(split.pieces[1].module) == [torch.ops.pb_test_split.pair, operator.getitem, operator.getitem]
    assert operator.getitem not in targets(split.pieces[2].module)
    assert_no_container_or_size_crosses(split, calls)


def test_getitem_between_splitting_ops_keeps_them_in_one_piece():
    def fn(x):
        a, b = torch.ops.pb_test_split.pair(x.sin())
        c = torch.ops.pb_test.double(a)
        return c + b

    x = torch.randn(6)
    split, out, calls = split_and_run(fn, TEST_OPS, x)
    torch.testing.assert_close(out, fn(x))
    assert kinds(split) == "CSC"
    assert targets(split.pieces[1].module) == [
        torch.ops.pb_test_split.pair,
        operator.getitem,
        operator.getitem,
        torch.ops.pb_test.double,
    ]
    assert_no_container_or_size_crosses(split, calls)


def test_getitem_of_compiled_tuple_stays_in_compiled_piece():
    def fn(x):
        a, b = (x * 2).chunk(2)
        c = torch.ops.pb_test.double(a)
        d, e = c.unbind(0)
        return d + e + b.sum()

    x = torch.randn(4, 3)
    split, out, calls = split_and_run(fn, TEST_OPS, x)
    torch.testing.assert_close(out, fn(x))
    assert kinds(split) == "CSC"
    assert targets(split.pieces[0].module).count(operator.getitem) == 2
    assert targets(split.pieces[2].module).count(operator.getitem) == 2
    assert_no_container_or_size_crosses(split, calls)


# ---------------------------------------------------------------- allocation-only pieces


def test_empty_between_splitting_ops_joins_one_splitting_piece():
    def fn(x):
        y = x + 1
        out = torch.empty_like(y)
        torch.ops.pb_test.double_into(y, out)
        out2 = torch.empty_like(y)
        torch.ops.pb_test.double_into(out, out2)
        return out2 * 3

    x = torch.randn(3, 4)
    split, out, calls = split_and_run(fn, TEST_OPS, x)
    torch.testing.assert_close(out, fn(x))
    assert kinds(split) == "CSC", [p.module.code for p in split.pieces]
    assert targets(split.pieces[1].module) == [
        torch.ops.pb_test.double_into,
        torch.empty_like,
        torch.ops.pb_test.double_into,
    ]


def test_empty_only_piece_at_the_end_merges_backwards():
    def fn(x):
        y = torch.ops.pb_test.double(x + 1)
        return y, torch.empty_like(y)

    x = torch.randn(3)
    split, out, calls = split_and_run(fn, TEST_OPS, x)
    torch.testing.assert_close(out[0], fn(x)[0])
    assert out[1].shape == x.shape
    assert kinds(split) == "CS"
    assert targets(split.pieces[1].module) == [torch.ops.pb_test.double, torch.empty_like]


def test_piece_with_real_work_next_to_empty_is_not_merged():
    def fn(x):
        y = torch.ops.pb_test.double(x)
        z = torch.empty_like(y).fill_(1.0)
        return torch.ops.pb_test.double(z + y)

    x = torch.randn(3)
    split, out, calls = split_and_run(fn, TEST_OPS, x)
    torch.testing.assert_close(out, fn(x))
    assert kinds(split) == "SCS"


# ---------------------------------------------------------------- torch.Size


def test_no_torch_size_crosses_a_boundary():
    def fn(x):
        s = x.shape  # a Size node with a dynamic dim, used after the split
        y = x.reshape(-1) * 2
        out = torch.empty_like(y)
        torch.ops.pb_test.double_into(y, out)
        return out.view(s) + 1

    x = torch.randn(4, 6)
    torch._dynamo.mark_dynamic(x, 0)
    split, out, calls = split_and_run(fn, TEST_OPS, x)
    # the premise: Dynamo produced a torch.Size value used on both sides of the split
    sizes = [
        n
        for p in split.pieces
        for n in p.module.graph.nodes
        if n.op != "placeholder" and isinstance(n.meta.get("example_value"), torch.Size)
    ]
    assert sizes, "expected a Size-valued node in the graph"
    assert kinds(split) == "CSC"
    torch.testing.assert_close(out, fn(x))
    assert_no_container_or_size_crosses(split, calls)
    x2 = torch.randn(7, 6)  # same graph, other size
    args = [7 if n.name.startswith("s") else x2 for n in split.split_gm.graph.nodes if n.op == "placeholder"]
    assert len(args) == 2 and {type(a) for a in args} == {torch.Tensor, int}
    torch.testing.assert_close(split.split_gm(*args)[0], fn(x2))


def test_size_used_in_several_later_pieces():
    def fn(x):
        s = x.size()
        a = torch.ops.pb_test.double(x.reshape(-1))
        b = torch.ops.pb_test.double(a.view(s).reshape(-1) + 1)
        return b.view(s) - a.view(s)

    x = torch.randn(3, 5)
    torch._dynamo.mark_dynamic(x, 0)
    split, out, calls = split_and_run(fn, TEST_OPS, x)
    torch.testing.assert_close(out, fn(x))
    assert kinds(split) == "CSCSC"
    assert_no_container_or_size_crosses(split, calls)


# ---------------------------------------------------------------- op spellings


def via_packet(x):
    return torch.ops.pb_test.double(x + 1) * 3


def via_handle(x):
    return double(x + 1) * 3


def via_default(x):
    return torch.ops.pb_test.double.default(x + 1) * 3


CALLS = {"packet": via_packet, "handle": via_handle, "default": via_default}
SPELLINGS = {
    "name": "pb_test::double",
    "name.default": "pb_test::double.default",
    "packet": torch.ops.pb_test.double,
    "overload": torch.ops.pb_test.double.default,
    "customopdef": double,
}


@pytest.fixture(scope="module")
def spelled_graphs():
    return {name: dynamo_graphs(fn, torch.randn(4))[0] for name, fn in CALLS.items()}


def test_call_styles_give_both_target_forms(spelled_graphs):
    # the premise of the matrix below: a packet call and an overload call are different targets
    def op_target(gm):
        (t,) = [n.target for n in gm.graph.nodes if "pb_test" in str(n.target)]
        return t

    assert isinstance(op_target(spelled_graphs["packet"]), torch._ops.OpOverloadPacket)
    assert isinstance(op_target(spelled_graphs["handle"]), torch._ops.OpOverload)
    assert isinstance(op_target(spelled_graphs["default"]), torch._ops.OpOverload)


@pytest.mark.parametrize("spelling", list(SPELLINGS))
@pytest.mark.parametrize("call", list(CALLS))
def test_every_spelling_matches_every_call_style(spelled_graphs, spelling, call):
    gm = spelled_graphs[call]
    split = pb.split_graph(gm, [SPELLINGS[spelling]])
    assert kinds(split) == "CSC"
    assert len(split.found_ops) == 1
    x = torch.randn(4)
    torch.testing.assert_close(split.split_gm(x)[0], via_packet(x))


@pytest.mark.parametrize("call", list(CALLS))
def test_other_ops_and_overloads_do_not_match(spelled_graphs, call):
    gm = spelled_graphs[call]
    for ops in (["pb_test::double_into"], ["pb_test::double.out"], [torch.ops.pb_test.double_into], [double_ref]):
        split = pb.split_graph(gm, ops)
        assert kinds(split) == "C", ops
        assert split.found_ops == []


def double_ref(x):  # a Python function that is not the op: matched by identity only
    return x * 2


def test_python_callable_sdpa():
    def fn(q):
        return F.scaled_dot_product_attention(q + 1, q, q).relu()

    q = torch.randn(1, 2, 4, 8)
    split, out, calls = split_and_run(fn, [F.scaled_dot_product_attention], q)
    torch.testing.assert_close(out, fn(q))
    assert kinds(split) == "CSC"
    assert targets(split.pieces[1].module) == [F.scaled_dot_product_attention]
    assert split.found_ops == [F.scaled_dot_product_attention]

    split, out, calls = split_and_run(fn, ["pb_test::double"], q)
    assert kinds(split) == "C"
    split, out, calls = split_and_run(fn, pb.registered_splitting_ops(), q)  # SDPA is a default
    assert kinds(split) == "CSC"


def test_registering_default_matches_a_packet_call(spelled_graphs):
    with_default = pb.split_graph(spelled_graphs["packet"], [torch.ops.pb_test.double.default])
    assert kinds(with_default) == "CSC"
    assert with_default.found_ops == ["pb_test::double.default"]


# ---------------------------------------------------------------- ordering


def test_pieces_ordered_by_integer_id_graph_starting_with_splitting_op():
    def fn(x):
        for i in range(6):
            x = torch.ops.pb_test.double(x)
            x = x + i
        return x

    x = torch.randn(3)
    split, out, calls = split_and_run(fn, TEST_OPS, x)
    torch.testing.assert_close(out, fn(x))
    assert kinds(split) == "SC" * 6  # 12 pieces: ids reach two digits
    assert [p.index for p in split.pieces] == list(range(12))
    ids = [int(p.name.removeprefix("submod_")) for p in split.pieces]
    assert ids == sorted(ids) and len(set(ids)) == 12
    # the list is in execution order: the order split_gm calls the pieces
    called = [n.target for n in split.split_gm.graph.nodes if n.op == "call_module"]
    assert called == [p.name for p in split.pieces]
    assert "submod_10" in called and called.index("submod_10") > called.index("submod_9")
    for p in split.pieces[1::2]:
        (add,) = call_nodes(p.module)
        assert add.target is operator.add
    assert [call_nodes(p.module)[0].args[1] for p in split.pieces[1::2]] == list(range(6))


def test_split_graph_accepts_a_single_op():
    model = make_model(2, "inplace")
    (gm,) = dynamo_graphs(model, token_ids(4))
    for single in ("pb_toy::attention", torch.ops.pb_toy.attention):
        split = pb.split_graph(gm, single)
        assert [p.is_splitting for p in split.pieces] == [False, True, False, True, False]
