"""Replay input matching (inputs.py, design.md 4.4 replay contract; issue 10 items 2-4, 9, 18)."""

from __future__ import annotations

import enum

import pytest
import torch
from torch.testing import assert_close

import piecewise_backend as pb
from pbtest.helpers import SIM, CountingMLP

M = pb.CUDAGraphMode
D8 = pb.BatchDescriptor(8)


def full(fn):
    return pb.CUDAGraphWrapper(fn, M.FULL, config=SIM)


def x8(seed: int = 0) -> torch.Tensor:
    return torch.randn(8, 8, generator=torch.Generator().manual_seed(seed))


def call(w, *args, **kwargs):
    with pb.set_forward_context(M.FULL, D8):
        return w(*args, **kwargs)


# ---------------------------------------------------------------- 2: keywords match by name


def test_keyword_order_does_not_swap_inputs():
    w = full(lambda x, y: x * 2 + y)
    x, y = x8(0), x8(1)
    assert_close(call(w, x=x, y=y), x * 2 + y)
    x2, y2 = x8(2), x8(3)
    assert_close(call(w, y=y2, x=x2), x2 * 2 + y2)  # another keyword order: same inputs by name


def test_dict_input_with_other_key_order_raises_instead_of_swapping():
    w = full(lambda d: d["a"] * 2 + d["b"])
    a, b = x8(0), x8(1)
    call(w, {"a": a, "b": b})
    assert_close(call(w, {"a": x8(2), "b": x8(3)}), x8(2) * 2 + x8(3))
    with pytest.raises(ValueError, match="another structure than at capture"):
        call(w, {"b": x8(3), "a": x8(2)})


def test_missing_or_extra_keyword_is_named():
    w = full(lambda x, y=None: x if y is None else x + y)
    call(w, x8(), y=x8(1))
    with pytest.raises(ValueError, match=r"missing \['y'\]"):
        call(w, x8())
    with pytest.raises(ValueError, match=r"unexpected \['z'\]"):
        call(w, x8(), y=x8(1), z=1)


# ---------------------------------------------------------------- 3: every baked-in leaf is checked


def masked(x, mask=None, how="add", dtype=torch.float32):
    out = x if mask is None else x + mask
    return (out * 2 if how == "add" else out * 3).to(dtype)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(mask=x8(9)), r"kwargs\['mask'\] was NoneType None at capture and is a tensor"),
        (dict(how="mul"), r"kwargs\['how'\] was 'add' at capture and is 'mul' now"),
        (dict(dtype=torch.float64), r"kwargs\['dtype'\] was torch.float32 at capture and is torch.float64"),
    ],
    ids=["none-to-tensor", "str", "dtype"],
)
def test_changed_non_tensor_leaf_raises(change, message):
    w = full(masked)
    x = x8()
    kwargs = dict(mask=None, how="add", dtype=torch.float32)
    assert_close(call(w, x, **kwargs), masked(x, **kwargs))
    with pytest.raises(ValueError, match=message):
        call(w, x, **{**kwargs, **change})
    assert_close(call(w, x, **kwargs), masked(x, **kwargs))  # the entry is intact


class Cache:
    """An opaque object (like a transformers DynamicCache) whose contents the graph read."""

    def __init__(self, t):
        self.t = t


def test_opaque_object_must_be_the_captured_one():
    w = full(lambda x, cache: x + cache.t)
    cache = Cache(x8(1))
    call(w, x8(), cache)
    call(w, x8(), cache)  # the same object replays
    with pytest.raises(ValueError, match=r"args\[1\] was a Cache object at capture and is a Cache object now"):
        call(w, x8(), Cache(x8(2)))


class Color(enum.Enum):
    RED = 1
    BLUE = 2


def test_nan_scalar_that_did_not_change_replays():
    w = full(lambda x, s: x * s)
    x = x8()
    call(w, x, float("nan"))
    out = call(w, x, float("nan"))  # issue 10.18: "was nan, is nan now" must not raise
    assert torch.isnan(out).all()


def test_negative_zero_is_not_zero():
    w = full(lambda x, s: 1 / torch.full_like(x, s))  # the graph bakes s in: inf for 0.0, -inf for -0.0
    assert (call(w, x8(), 0.0) == float("inf")).all()
    with pytest.raises(ValueError, match=r"args\[1\] was 0.0 at capture and is -0.0 now"):
        call(w, x8(), -0.0)


@pytest.mark.parametrize(
    "first, then, message",
    [(2, 2.0, "was int 2 at capture and is float 2.0 now"), (Color.RED, Color.BLUE, "was <Color.RED: 1>"),
     (x8(), 3, r"was a tensor \(8, 8\) torch.float32 at capture and is int 3 now")],
    ids=["int-to-float", "enum", "tensor-to-int"],
)
def test_leaf_that_changes_type_or_value_is_named(first, then, message):
    w = full(lambda x, s: x * (s if not isinstance(s, Color) else s.value))
    call(w, x8(), first)
    with pytest.raises(ValueError, match=message):
        call(w, x8(), then)


# ---------------------------------------------------------------- 4: aliasing, strides, dtype views


def test_aliased_at_capture_distinct_at_replay_raises():
    w = full(lambda a, b: a * 2 + b)
    x = x8()
    assert_close(call(w, x, x), x * 3)
    with pytest.raises(ValueError, match=r"args\[0\] and args\[1\] shared memory at capture but do not now"):
        call(w, x8(1), x8(2))
    y = x8(3)
    assert_close(call(w, y, y), y * 3)  # aliased as at capture: one static buffer, correct


def test_distinct_at_capture_aliased_at_replay_raises():
    w = full(lambda a, b: a * 2 + b)
    call(w, x8(0), x8(1))
    y = x8(3)
    with pytest.raises(ValueError, match=r"args\[0\] and args\[1\] share memory now but did not at capture"):
        call(w, y, y)


def test_same_address_other_strides_replays_the_new_layout():
    buf = x8()
    w = full(lambda x: x @ torch.eye(8) + torch.arange(8.0))
    call(w, buf)
    out = call(w, buf.t())  # same pointer and shape, other strides: staged, so correct
    assert_close(out, buf.t() + torch.arange(8.0))


def test_same_address_other_dtype_raises():
    buf = torch.arange(64, dtype=torch.int32).reshape(8, 8)
    w = full(lambda x: x * 2)
    call(w, buf)
    with pytest.raises(ValueError, match=r"args\[0\] moved and no longer fits.*torch.int32.*torch.float32"):
        call(w, buf.view(torch.float32))


def test_persistent_buffer_with_other_strides_raises():
    buf = x8()
    pb.mark_persistent(buf)
    w = full(lambda x: x + 1)
    call(w, buf)
    assert w.entries[D8].static_inputs == []  # read in place
    with pytest.raises(ValueError, match=r"persistent buffer the graph reads in place, and it moved"):
        call(w, buf.t())


# ---------------------------------------------------------------- 9: never write into the caller's data


@pytest.mark.parametrize("platform", ["simulated", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_moved_input_never_written_and_graph_reads_a_wrapper_buffer(platform):
    """What a real CUDA graph does: it reads the address it captured. Capture with ``mine``,
    then overwrite ``mine`` and replay with ``other``: the replay must use ``other``'s data,
    and ``mine`` must hold exactly what its owner put there. (The CUDA run is the twin.)"""
    device = "cuda" if platform == "cuda" else "cpu"
    config = SIM if platform == "simulated" else pb.CompilationConfig(platform="cuda", compile_pieces="eager")
    m = CountingMLP().to(device)
    w = pb.CUDAGraphWrapper(m, M.FULL, config=config)
    mine = x8(0).to(device)
    with torch.no_grad():
        call(w, mine)
        mine.fill_(123.0)  # the caller reuses its tensor
        other = x8(5).to(device)
        assert_close(call(w, other), m(other))
        assert torch.equal(mine, torch.full((8, 8), 123.0, device=device))
        mine.copy_(x8(7))  # updating the capture-time tensor in place is seen by the next replay
        assert_close(call(w, mine), m(x8(7).to(device)))
    (static,) = w.entries[D8].static_inputs
    assert static.data_ptr() not in (mine.data_ptr(), other.data_ptr())


def test_validation_happens_before_any_copy():
    w = full(lambda a, b: a + b)
    a, b = x8(0), x8(1)
    call(w, a, b)
    kept = a.clone()
    with pytest.raises(ValueError, match=r"args\[1\] moved"):
        call(w, x8(5), torch.ones(3))  # the second input fails: the first must not be copied anywhere
    assert torch.equal(a, kept)
    assert torch.equal(w.entries[D8].static_inputs[0], kept)


def test_model_writing_into_its_input_writes_the_callers_tensor_as_eager_does():
    def bump(x):
        x.add_(1)
        return x * 2

    w = full(bump)
    x = torch.zeros(8, 8)
    assert_close(call(w, x), torch.full((8, 8), 2.0))
    assert_close(x, torch.ones(8, 8))  # the eager effect, not the static copy's
    y = torch.full((8, 8), 5.0)
    assert_close(call(w, y), torch.full((8, 8), 12.0))
    assert_close(y, torch.full((8, 8), 6.0))
    assert_close(x, torch.ones(8, 8))


def test_parameters_and_marked_buffers_are_read_in_place():
    m = CountingMLP()
    w = full(lambda x, weight: x @ weight)
    buf = x8()
    pb.mark_persistent(buf)
    call(w, buf[:8], m.l1.weight)
    assert w.entries[D8].static_inputs == []
    buf.copy_(x8(3))
    assert_close(call(w, buf[:8], m.l1.weight), x8(3) @ m.l1.weight)


def test_a_staged_callers_tensor_is_not_kept_alive():
    import gc
    import weakref

    w = full(lambda x: x * 2)
    x = x8()
    ref = weakref.ref(x)
    call(w, x)
    del x
    gc.collect()
    assert ref() is None  # the graph reads the static copy: the caller may free its tensor
    assert_close(call(w, x8(1)), x8(1) * 2)
    assert w.entries[D8].inputs == w.entries[D8].static_inputs
