"""StaticInput validation and the step-input helpers of runner/static_inputs.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import piecewise_backend as pb
from piecewise_backend.runner.batch_checks import check_plain
from piecewise_backend.runner.buffers import eager_tensor, fill


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(name=5), ValueError, r"name must be a str that is a Python identifier, got 5 \(int\)"),
        (dict(name="x", shape=4), ValueError, r"shape .* a tuple of positive ints such as \(\) or \(4,\); got 4"),
        (dict(name="x", shape=(2, True)), ValueError, r"got \(2, True\)"),
        (dict(name="x", dtype="float32"), TypeError, r"must be a torch.dtype such as torch.float32, got 'float32'"),
        (dict(name="x", dtype=torch.float32, pad=float("nan")), ValueError, r"pad nan must be finite"),
        (
            dict(name="x", pad=2**70),
            ValueError,
            r"pad 1180591620717411303424 does not fit torch.int64: use an integer in \[-9223372036854775808, ",
        ),
        (dict(name="x", pad=1.5), ValueError, r"pad 1.5 does not fit torch.int64"),
        (dict(name="x", pad="0"), TypeError, r"pad '0' must be a Python int or float"),
        (dict(name="x", dtype=torch.float16, pad=1e6), ValueError, r"within \+-65504"),
        (dict(name="x", per="sequence"), ValueError, r"per must be 'token' or 'request', got 'sequence'"),
        (dict(name="x", request_row=1), TypeError, r"request_row must be True or False, got 1"),
        (dict(name="x", request_row=True, per="request"), ValueError, r"request_row=True marks a per-token integer .* got per='request'"),
        (dict(name="x", request_row=True, dtype=torch.float32), ValueError, r"got per='token', dtype=torch.float32"),
        (dict(name="x", request_row=True, pad=-1), ValueError, r"padded with row 0 .* pad=-1"),
    ],
)
def test_static_input_errors_name_the_bad_value(kwargs, error, message):
    with pytest.raises(error, match=message):
        pb.StaticInput(**kwargs)


def test_static_input_accepts_lists_and_integral_float_pads():
    spec = pb.StaticInput("x", shape=[2, 3], pad=-1.0)
    assert spec.shape == (2, 3) and hash(spec)
    assert pb.StaticInput("m", dtype=torch.bool, pad=True).pad is True


def test_fill_pads_rows_and_columns_without_data():
    buf = torch.arange(12.0).reshape(4, 3)
    fill(buf, torch.ones(2, 2), rows=3, pad=-1.0)
    assert buf.tolist() == [[1, 1, -1], [1, 1, -1], [-1, -1, -1], [9, 10, 11]]  # rows past `rows` untouched


def test_eager_tensor_matches_what_a_graph_step_sees():
    spec = pb.StaticInput("t", shape=(3,), dtype=torch.float32, pad=5.0, per="request")
    out = eager_tensor(spec, torch.ones(1, 2, dtype=torch.float64), rows=2, device=torch.device("cpu"))
    assert out.dtype == torch.float32 and out.tolist() == [[1, 1, 5], [5, 5, 5]]
    wide = eager_tensor(spec, torch.ones(2, 4), rows=2, device=torch.device("cpu"))
    assert wide.shape == (2, 4)  # a wider tensor keeps its width (the step runs eagerly)


@dataclasses.dataclass
class _Meta:
    lens: torch.Tensor
    extra: list


def test_check_plain_walks_containers_and_dataclasses():
    check_plain({"a": (1, "x", None, torch.ones(1)), "m": _Meta(torch.ones(1), [pb.CUDAGraphMode.FULL])}, "context")
    with pytest.raises(TypeError, match=r"context 'm.extra\[0\]' is a object"):
        check_plain({"m": _Meta(torch.ones(1), [object()])}, "context")


@dataclasses.dataclass
class _StepMeta:
    table: torch.Tensor
    caches: list
    names: tuple = ("a",)


def test_context_print_passes_the_captured_tensors_and_refuses_any_change_the_exact_check_refuses():
    """ContextPrint's fast check (identity, address, shape, strides, dtype over the same structure) agrees with
    context_tensors' path-by-path comparison: every change that one refuses is refused, the same tensors pass."""
    from piecewise_backend.runner.full_context import ContextPrint

    table, k0, k1 = torch.zeros(4, 4), torch.zeros(2, 3), torch.zeros(2, 3)
    caches = [k0, k1]
    attrs = lambda **kw: {"meta": _StepMeta(kw.get("table", table), kw.get("caches", caches)), "n": 3}
    p = ContextPrint(attrs())
    p.check(attrs(), "d")  # new containers, the same tensors: passes
    p.check(attrs(caches=list(caches)), "d")
    p.check(attrs(table=table[:]), "d")  # another view object of the same memory and layout: the exact check passes
    p.check(attrs(table=table[:]), "d")  # ... and is remembered
    for bad in (dict(table=table.t()), dict(table=table[:2]), dict(table=torch.zeros(4, 4)),
                dict(caches=[k1, torch.zeros(2, 3)]), dict(caches=[k0]), dict(table=table.view(torch.int32))):
        with pytest.raises(ValueError, match="is not the tensor the FULL graph of d captured"):
            p.check(attrs(**bad), "d")
    with pytest.raises(ValueError, match=r"'meta.caches\[0\]'.*now: absent"):
        p.check({"meta2": _StepMeta(table, caches), "n": 3}, "d")  # the same tensors under another name
    k0.resize_(1, 3)  # the captured object itself, resized in place: its shape changed
    with pytest.raises(ValueError, match=r"caches\[0\].*\[2, 3\].*now: .*\[1, 3\]"):
        p.check(attrs(), "d")


def test_same_context_is_straight_line_code_over_the_captured_structure():
    """The generated fast check: True only for the captured structure and tensors; anything else goes to the
    exact comparison (a False is never an error by itself)."""
    from piecewise_backend.runner.full_context import same_context

    t, k = torch.zeros(2, 3), torch.zeros(4)
    same = same_context({"meta": _StepMeta(t, [k]), "n": 3})
    assert same({"meta": _StepMeta(t, [k]), "n": 4})  # new containers, the same tensors; a leaf's value is no structure
    assert same({"meta": _StepMeta(t[:], [k]), "n": 3})  # another view object of the same memory and layout
    for other in (
        {"meta": _StepMeta(t, [k]), "n": 4.0},  # a leaf's type changed
        {"meta": _StepMeta(t, [k, k]), "n": 3},  # a length
        {"meta": _StepMeta(t.t(), [k]), "n": 3},  # a layout
        {"meta": _StepMeta(t, [k.view(torch.int32)]), "n": 3},  # a dtype
        {"meta": _StepMeta(t, (k,)), "n": 3},  # a container type
        {"n": 3, "meta": _StepMeta(t, [k])},  # the keys' order
        {"meta": {"table": t, "caches": [k]}, "n": 3},  # a dict for the dataclass
    ):
        assert not same(other), other
