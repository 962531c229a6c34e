"""Splitting-op registry and matching (DESIGN 2, 4.2)."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

import piecewise_backend as pb
from piecewise_backend.ops import OpMatcher, canonicalize_op
from pbtest.helpers import double, double_into, saved_splitting_ops

SDPA = F.scaled_dot_product_attention


@pytest.fixture
def registry():
    """Every test that touches the registry leaves it exactly as it found it."""
    with saved_splitting_ops():
        yield


# ---------------------------------------------------------------- canonical forms


@pytest.mark.parametrize(
    "spelling,canonical",
    [
        ("pb_test::double", "pb_test::double"),
        ("pb_test::double.default", "pb_test::double.default"),
        (torch.ops.pb_test.double, "pb_test::double"),  # OpOverloadPacket
        (torch.ops.pb_test.double.default, "pb_test::double.default"),  # OpOverload
        (double, "pb_test::double"),  # torch.library CustomOpDef handle
        (torch.ops.aten.add.Tensor, "aten::add.Tensor"),
        (torch.ops.aten.add, "aten::add"),
    ],
    ids=["name", "name.overload", "packet", "overload", "customopdef", "aten-overload", "aten-packet"],
)
def test_canonical_forms(spelling, canonical):
    assert canonicalize_op(spelling) == canonical


def test_python_callable_kept_by_identity():
    def my_attention(q):
        return q

    assert canonicalize_op(my_attention) is my_attention
    assert canonicalize_op(SDPA) is SDPA


class _Klass:
    pass


@pytest.mark.parametrize("bad", [3, 2.5, None, _Klass, torch.nn.Linear, b"pb_test::double"], ids=repr)
def test_type_error_for_non_ops(registry, bad):
    before = pb.registered_splitting_ops()
    with pytest.raises(TypeError, match="splitting op"):
        pb.register_splitting_op(bad)
    assert pb.registered_splitting_ops() == before


@pytest.mark.parametrize(
    "bad", ["noseparator", "ns:name", "ns::", "::name", "a::b::c", "ns::name.", "ns::name.x.y", "1ns::x", ""]
)
def test_value_error_for_bad_names(registry, bad):
    before = pb.registered_splitting_ops()
    with pytest.raises(ValueError, match="ns::name"):
        pb.register_splitting_op(bad)
    assert pb.registered_splitting_ops() == before


# ---------------------------------------------------------------- registry


def test_sdpa_and_toy_ops_registered_by_default():
    import piecewise_backend.toy_llama  # noqa: F401  (registers its ops at import)

    ops = pb.registered_splitting_ops()
    assert any(op is SDPA for op in ops)
    assert "pb_toy::attention" in ops and "pb_toy::attention_fresh" in ops


def test_register_returns_canonical_and_is_idempotent(registry):
    before = pb.registered_splitting_ops()
    assert pb.register_splitting_op(torch.ops.pb_test.double) == "pb_test::double"
    assert pb.register_splitting_op("pb_test::double") == "pb_test::double"
    assert pb.register_splitting_op(double) == "pb_test::double"  # same op, other spelling
    assert pb.registered_splitting_ops() == [*before, "pb_test::double"]

    def fn(q):
        return q

    pb.register_splitting_op(fn)
    pb.register_splitting_op(fn)
    assert pb.registered_splitting_ops() == [*before, "pb_test::double", fn]


def test_unregister_by_any_spelling_of_the_same_canonical(registry):
    pb.register_splitting_op(torch.ops.pb_test.double)
    pb.unregister_splitting_op(double)  # CustomOpDef canonicalizes to the same "pb_test::double"
    assert "pb_test::double" not in pb.registered_splitting_ops()
    pb.register_splitting_op("pb_test::double_into.default")
    pb.unregister_splitting_op(torch.ops.pb_test.double_into.default)
    assert "pb_test::double_into.default" not in pb.registered_splitting_ops()


def test_unregister_not_registered_raises_key_error(registry):
    before = pb.registered_splitting_ops()
    with pytest.raises(KeyError, match="pb_test::double_into"):
        pb.unregister_splitting_op(double_into)
    pb.register_splitting_op(double_into)
    pb.unregister_splitting_op(double_into)
    with pytest.raises(KeyError):
        pb.unregister_splitting_op(double_into)  # twice

    def never_registered(q):
        return q

    with pytest.raises(KeyError):
        pb.unregister_splitting_op(never_registered)
    with pytest.raises(ValueError):
        pb.unregister_splitting_op("noseparator")
    assert pb.registered_splitting_ops() == before


def test_unregister_default_sdpa_and_reregister(registry):
    pb.unregister_splitting_op(SDPA)
    assert not any(op is SDPA for op in pb.registered_splitting_ops())
    pb.register_splitting_op(SDPA)
    assert any(op is SDPA for op in pb.registered_splitting_ops())


def test_registered_ops_returns_a_copy(registry):
    ops = pb.registered_splitting_ops()
    ops.append("pb_test::nothing")
    ops.clear()
    assert pb.registered_splitting_ops() != []
    assert "pb_test::nothing" not in pb.registered_splitting_ops()


def test_concurrent_register_adds_once(registry):
    before = len(pb.registered_splitting_ops())
    barrier = threading.Barrier(8)

    def worker():
        barrier.wait()
        for _ in range(50):
            pb.register_splitting_op("pb_test::concurrent")

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ops = pb.registered_splitting_ops()
    assert ops.count("pb_test::concurrent") == 1 and len(ops) == before + 1


def test_fixture_restores_registry():
    before = pb.registered_splitting_ops()
    with saved_splitting_ops():
        pb.unregister_splitting_op(SDPA)
        pb.register_splitting_op("pb_test::temporary")
    assert pb.registered_splitting_ops() == before


# ---------------------------------------------------------------- matching node targets


PACKET, DEFAULT = torch.ops.pb_test.double, torch.ops.pb_test.double.default


@pytest.mark.parametrize(
    "spec",
    ["pb_test::double", "pb_test::double.default", PACKET, DEFAULT, double],
    ids=["name", "name.default", "packet", "overload", "customopdef"],
)
@pytest.mark.parametrize("target", [PACKET, DEFAULT], ids=["packet-call", "overload-call"])
def test_matcher_every_spelling_matches_both_target_forms(spec, target):
    assert OpMatcher([spec]).match(target) is not None


def test_matcher_other_overloads_and_ops_do_not_match():
    assert OpMatcher(["pb_test::double.out"]).match(DEFAULT) is None
    assert OpMatcher(["pb_test::double.out"]).match(PACKET) is None
    assert OpMatcher(["pb_test::double_into"]).match(DEFAULT) is None
    assert OpMatcher(["aten::add.Tensor"]).match(torch.ops.aten.add.Scalar) is None
    assert OpMatcher(["aten::add.Tensor"]).match(torch.ops.aten.add.Tensor) == "aten::add.Tensor"
    assert OpMatcher(["aten::add"]).match(torch.ops.aten.add.Scalar) == "aten::add"
    assert OpMatcher([]).match(DEFAULT) is None and not OpMatcher([])


def test_matcher_callables_by_identity_only():
    def attn(q):
        return q

    def attn_twin(q):
        return q

    m = OpMatcher([attn, SDPA])
    assert m.match(attn) is attn
    assert m.match(SDPA) is SDPA
    assert m.match(torch.nn.functional.scaled_dot_product_attention) is SDPA
    assert m.match(attn_twin) is None
    assert m.match("attn") is None and m.match(torch.sin) is None


def test_module_instance_is_not_a_splitting_op(registry):
    # issue 10.18: an nn.Module is callable, but Dynamo inlines it: no node would ever match
    with pytest.raises(TypeError, match=r"nn.Module instance Linear .*register the function or custom op"):
        pb.register_splitting_op(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="splitting_ops.*nn.Module instance"):
        pb.CompilationConfig(splitting_ops=[torch.nn.ReLU()])
