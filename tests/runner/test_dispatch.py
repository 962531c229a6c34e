"""Mode resolution and the CudagraphDispatcher (design.md 4.5): pure data, no capture."""

from __future__ import annotations

import itertools

import pytest

import piecewise_backend as pb
from piecewise_backend.runner import dispatcher as dispatcher_module
from pbtest.helpers import SIM

M = pb.CUDAGraphMode
S = pb.AttentionGraphSupport
BD = pb.BatchDescriptor
RAISES = "raises"

# ---------------------------------------------------------------- resolve_cudagraph_mode

# (mode, support) -> (resolved with attention split, resolved without). Written out in full.
RESOLUTION = {
    (M.NONE, S.NEVER): (M.NONE, M.NONE),
    (M.NONE, S.UNIFORM_SINGLE_TOKEN_DECODE): (M.NONE, M.NONE),
    (M.NONE, S.UNIFORM_BATCH): (M.NONE, M.NONE),
    (M.NONE, S.ALWAYS): (M.NONE, M.NONE),
    (M.PIECEWISE, S.NEVER): (M.PIECEWISE, M.PIECEWISE),
    (M.PIECEWISE, S.UNIFORM_SINGLE_TOKEN_DECODE): (M.PIECEWISE, M.PIECEWISE),
    (M.PIECEWISE, S.UNIFORM_BATCH): (M.PIECEWISE, M.PIECEWISE),
    (M.PIECEWISE, S.ALWAYS): (M.PIECEWISE, M.PIECEWISE),
    (M.FULL, S.NEVER): (RAISES, RAISES),
    (M.FULL, S.UNIFORM_SINGLE_TOKEN_DECODE): (M.FULL_AND_PIECEWISE, M.FULL_DECODE_ONLY),
    (M.FULL, S.UNIFORM_BATCH): (M.FULL_AND_PIECEWISE, M.FULL_DECODE_ONLY),
    (M.FULL, S.ALWAYS): (M.FULL, M.FULL),
    (M.FULL_DECODE_ONLY, S.NEVER): (M.PIECEWISE, M.NONE),
    (M.FULL_DECODE_ONLY, S.UNIFORM_SINGLE_TOKEN_DECODE): (M.FULL_DECODE_ONLY, M.FULL_DECODE_ONLY),
    (M.FULL_DECODE_ONLY, S.UNIFORM_BATCH): (M.FULL_DECODE_ONLY, M.FULL_DECODE_ONLY),
    (M.FULL_DECODE_ONLY, S.ALWAYS): (M.FULL_DECODE_ONLY, M.FULL_DECODE_ONLY),
    (M.FULL_AND_PIECEWISE, S.NEVER): (M.PIECEWISE, M.NONE),
    (M.FULL_AND_PIECEWISE, S.UNIFORM_SINGLE_TOKEN_DECODE): (M.FULL_AND_PIECEWISE, M.FULL_AND_PIECEWISE),
    (M.FULL_AND_PIECEWISE, S.UNIFORM_BATCH): (M.FULL_AND_PIECEWISE, M.FULL_AND_PIECEWISE),
    (M.FULL_AND_PIECEWISE, S.ALWAYS): (M.FULL_AND_PIECEWISE, M.FULL_AND_PIECEWISE),
}

CASES = [
    (mode, support, split, expected[0 if split else 1])
    for (mode, support), expected in RESOLUTION.items()
    for split in (True, False)
]


def test_resolution_table_covers_every_combination():
    assert set(RESOLUTION) == set(itertools.product(M, S))
    assert len(CASES) == 40


CASE_IDS = [f"{m.name}-{s.name}-{'split' if p else 'nosplit'}" for m, s, p, _ in CASES]


@pytest.mark.parametrize("mode, support, split, expected", CASES, ids=CASE_IDS)
def test_resolve_cudagraph_mode(mode, support, split, expected):
    if expected == RAISES:
        with pytest.raises(ValueError, match="NEVER"):
            pb.resolve_cudagraph_mode(mode, support, attention_split=split)
    else:
        assert pb.resolve_cudagraph_mode(mode, support, attention_split=split) is expected


def test_resolve_accepts_names_and_ints_and_defaults_to_split():
    assert pb.resolve_cudagraph_mode("full", 2) is M.FULL_AND_PIECEWISE
    assert pb.resolve_cudagraph_mode("FULL_DECODE_ONLY", S.NEVER) is M.PIECEWISE
    with pytest.raises(ValueError):
        pb.resolve_cudagraph_mode("FULLEST", S.ALWAYS)
    with pytest.raises(ValueError):
        pb.resolve_cudagraph_mode(M.FULL, 7)


# ---------------------------------------------------------------- dispatcher


def dispatcher(mode, sizes=(1, 8), q: int = 1) -> pb.CudagraphDispatcher:
    d = pb.CudagraphDispatcher(SIM.replace(cudagraph_mode=mode, capture_sizes=list(sizes)))
    d.initialize_keys(mode, uniform_decode_query_len=q)
    return d


def test_full_and_piecewise_dispatch():
    d = dispatcher(M.FULL_AND_PIECEWISE)
    assert d.dispatch(3) == (M.PIECEWISE, BD(8))
    assert d.dispatch(8) == (M.PIECEWISE, BD(8))
    assert d.dispatch(1) == (M.PIECEWISE, BD(1))
    assert d.dispatch(8, uniform_decode=True, num_reqs=8) == (M.FULL, BD(8, num_reqs=8, uniform=True))
    assert d.dispatch(8, uniform_decode=True) == (M.FULL, BD(8, num_reqs=8, uniform=True))
    # a uniform batch pads to the captured size and takes the padded key
    assert d.dispatch(5, uniform_decode=True, num_reqs=5) == (M.FULL, BD(8, num_reqs=8, uniform=True))
    assert d.dispatch(15) == (M.NONE, BD(15))
    assert d.dispatch(15, uniform_decode=True, num_reqs=15) == (M.NONE, BD(15))


def test_piecewise_key_and_eager_key():
    d = dispatcher(M.FULL_AND_PIECEWISE)
    assert d.piecewise_key(8) == BD(8) and d.piecewise_key(1) == BD(1)
    assert d.piecewise_key(4) is None  # not a capture size
    assert d.eager_key(15) == BD(15) and d.eager_key(15) is d.eager_key(15)  # built once per count
    full = dispatcher(M.FULL_DECODE_ONLY)
    assert full.piecewise_key(8) is None  # no PIECEWISE keys in this mode
    assert full.dispatch(3) == (M.NONE, full.eager_key(3))


def test_dispatch_follows_keys_initialized_again(monkeypatch):
    # dispatch reads per-size tables built from the keys: a second initialize_keys must rebuild them
    d = dispatcher(M.FULL_AND_PIECEWISE)
    assert d.dispatch(8, uniform_decode=True) == (M.FULL, BD(8, num_reqs=8, uniform=True))
    d.initialize_keys(M.PIECEWISE)
    assert d.dispatch(8, uniform_decode=True) == (M.PIECEWISE, BD(8))
    d.initialize_keys(M.NONE)
    assert d.dispatch(3) == (M.NONE, BD(3))
    # NONE keys are kept per token count, up to a bound
    monkeypatch.setattr(dispatcher_module, "_EAGER_KEYS", 2)
    d = pb.CudagraphDispatcher(SIM.replace(cudagraph_mode=M.NONE))
    assert [d.dispatch(n)[1] for n in (1, 2, 3, 3)] == [BD(1), BD(2), BD(3), BD(3)]
    assert sorted(d._eager) == [1, 2]


def test_disable_full_falls_back_to_piecewise():
    d = dispatcher(M.FULL_AND_PIECEWISE)
    assert d.dispatch(8, uniform_decode=True, num_reqs=8, disable_full=True) == (M.PIECEWISE, BD(8))
    assert d.dispatch(3, disable_full=True) == (M.PIECEWISE, BD(8))
    # with plain FULL there is nothing but FULL to fall back on
    assert dispatcher(M.FULL).dispatch(3, disable_full=True) == (M.NONE, BD(3))


def test_plain_full_dispatches_relaxed_full_keys():
    d = dispatcher(M.FULL)
    assert d.dispatch(3) == (M.FULL, BD(8))
    assert d.dispatch(1) == (M.FULL, BD(1))
    # no separate decode routine: uniform batches share the relaxed key
    assert d.dispatch(8, uniform_decode=True, num_reqs=8) == (M.FULL, BD(8))
    assert d.dispatch(9) == (M.NONE, BD(9))
    assert d.keys[M.PIECEWISE] == set()
    assert d.keys[M.FULL] == {BD(1), BD(8)}


def test_full_decode_only_runs_mixed_eagerly_unpadded():
    d = dispatcher(M.FULL_DECODE_ONLY)
    assert d.dispatch(3) == (M.NONE, BD(3))
    assert d.dispatch(8) == (M.NONE, BD(8))
    assert d.dispatch(3, uniform_decode=True, num_reqs=3) == (M.FULL, BD(8, num_reqs=8, uniform=True))
    assert d.dispatch(3, uniform_decode=True, num_reqs=3, disable_full=True) == (M.NONE, BD(3))
    assert d.keys[M.PIECEWISE] == set()


def test_piecewise_and_none_modes():
    d = dispatcher(M.PIECEWISE)
    assert d.dispatch(3) == (M.PIECEWISE, BD(8))
    assert d.dispatch(2, uniform_decode=True, num_reqs=2) == (M.PIECEWISE, BD(8))
    assert d.keys[M.FULL] == set()
    n = dispatcher(M.NONE)
    assert n.dispatch(3) == (M.NONE, BD(3))
    assert n.dispatch(8, uniform_decode=True, num_reqs=8) == (M.NONE, BD(8))
    assert n.capture_descriptors() == []


def test_uniform_decode_query_len_keys():
    d = dispatcher(M.FULL_AND_PIECEWISE, sizes=(1, 2, 4, 8), q=2)
    assert d.keys[M.FULL] == {
        BD(2, num_reqs=1, uniform=True),
        BD(4, num_reqs=2, uniform=True),
        BD(8, num_reqs=4, uniform=True),
    }
    assert d.dispatch(4, uniform_decode=True, num_reqs=2) == (M.FULL, BD(4, num_reqs=2, uniform=True))
    assert d.dispatch(6, uniform_decode=True, num_reqs=3) == (M.FULL, BD(8, num_reqs=4, uniform=True))
    # padded size 1 is not a multiple of 2: no FULL key, mixed fallback
    assert d.dispatch(1, uniform_decode=True) == (M.PIECEWISE, BD(1))
    with pytest.raises(ValueError, match="uniform_decode_query_len=2"):
        d.dispatch(4, uniform_decode=True, num_reqs=4)
    with pytest.raises(ValueError, match="uniform_decode_query_len"):
        d.initialize_keys(M.FULL_AND_PIECEWISE, uniform_decode_query_len=0)


def test_num_reqs_must_match_tokens_for_uniform_decode():
    d = dispatcher(M.FULL_AND_PIECEWISE)
    with pytest.raises(ValueError, match="num_tokens=8"):
        d.dispatch(8, uniform_decode=True, num_reqs=3)


@pytest.mark.parametrize("bad", [0, -1, 2.5, "3", None])
def test_bad_num_tokens_raises(bad):
    d = dispatcher(M.FULL_AND_PIECEWISE)
    with pytest.raises(ValueError, match="num_tokens"):
        d.dispatch(bad)


def test_dispatcher_needs_a_config():
    with pytest.raises(TypeError, match="CompilationConfig"):
        pb.CudagraphDispatcher({"cudagraph_mode": "FULL"})


def test_default_capture_ladder():
    d = pb.CudagraphDispatcher(pb.CompilationConfig())
    sizes = d.sizes
    assert len(sizes) == 51
    assert sizes[:5] == [1, 2, 4, 8, 16]
    assert sizes[-1] == 512 == d.max_size
    assert [b - a for a, b in zip(sizes, sizes[1:]) if a >= 256] == [16] * 16
    assert [b - a for a, b in zip(sizes, sizes[1:]) if 8 <= a < 248] == [8] * 30
    assert sizes == sorted(set(sizes))
    d.initialize_keys(M.FULL_AND_PIECEWISE)
    assert d.dispatch(9) == (M.PIECEWISE, BD(16))
    assert d.dispatch(250) == (M.PIECEWISE, BD(256))
    assert d.dispatch(257) == (M.PIECEWISE, BD(272))
    assert d.dispatch(512) == (M.PIECEWISE, BD(512))
    assert d.dispatch(513) == (M.NONE, BD(513))
    # a smaller maximum cuts the ladder
    assert list(pb.CudagraphDispatcher(pb.CompilationConfig(max_capture_size=20)).sizes) == [1, 2, 4, 8, 16]


def test_user_sizes_deduped_and_sorted():
    d = pb.CudagraphDispatcher(SIM.replace(capture_sizes=[8, 1, 4, 8, 2, 1]))
    assert list(d.sizes) == [1, 2, 4, 8]
    d.initialize_keys(M.FULL_AND_PIECEWISE)
    assert d.dispatch(3) == (M.PIECEWISE, BD(4))
    assert d.dispatch(5) == (M.PIECEWISE, BD(8))


def test_padding_is_smallest_captured_size_at_least_n():
    d = dispatcher(M.PIECEWISE, sizes=(2, 5, 16))
    expected = {1: 2, 2: 2, 3: 5, 5: 5, 6: 16, 16: 16}
    for n, padded in expected.items():
        assert d.dispatch(n) == (M.PIECEWISE, BD(padded)), n
    assert d.dispatch(17) == (M.NONE, BD(17))


def test_capture_descriptors_largest_first_per_mode():
    d = dispatcher(M.FULL_AND_PIECEWISE, sizes=(4, 1, 8, 2))
    assert d.capture_descriptors() == [
        (M.PIECEWISE, [BD(8), BD(4), BD(2), BD(1)]),
        (M.FULL, [BD(8, 8, True), BD(4, 4, True), BD(2, 2, True), BD(1, 1, True)]),
    ]
    assert dispatcher(M.FULL, sizes=(1, 8)).capture_descriptors() == [(M.FULL, [BD(8), BD(1)])]
    assert dispatcher(M.PIECEWISE, sizes=(1, 8)).capture_descriptors() == [(M.PIECEWISE, [BD(8), BD(1)])]
    assert dispatcher(M.FULL_DECODE_ONLY, sizes=(1, 8)).capture_descriptors() == [
        (M.FULL, [BD(8, 8, True), BD(1, 1, True)])
    ]


def test_every_dispatch_result_is_a_captured_key():
    """Whatever the dispatcher emits (non-NONE) is among capture_descriptors()."""
    for mode in (M.PIECEWISE, M.FULL, M.FULL_DECODE_ONLY, M.FULL_AND_PIECEWISE):
        for q in (1, 2):
            d = dispatcher(mode, sizes=(1, 2, 4, 8), q=q)
            planned = {(m, desc) for m, descs in d.capture_descriptors() for desc in descs}
            for n in range(1, 12):
                for uniform in (False, True):
                    if uniform and n % q:
                        continue
                    got = d.dispatch(n, uniform_decode=uniform)
                    if got[0] is M.NONE:
                        assert got[1] == BD(n)
                    else:
                        assert got in planned, (mode, q, n, uniform, got)


# ---------------------------------------------------------------- issue 10.17-19


@pytest.mark.parametrize("mode, split, expected", [
    (M.FULL_AND_PIECEWISE, True, M.PIECEWISE), (M.FULL, True, M.PIECEWISE), (M.FULL_DECODE_ONLY, True, M.NONE),
    (M.FULL_AND_PIECEWISE, False, M.NONE), (M.PIECEWISE, True, M.PIECEWISE),
])
def test_single_token_decode_support_with_longer_queries_dispatches_no_full(mode, split, expected):
    q = 4
    resolved = pb.resolve_cudagraph_mode(mode, S.UNIFORM_SINGLE_TOKEN_DECODE, attention_split=split,
                                         uniform_decode_query_len=q)
    assert resolved is expected
    d = dispatcher(resolved, sizes=(4, 8), q=q)
    assert all(d.dispatch(n, uniform_decode=True)[0] is not M.FULL for n in (4, 8))


def test_single_token_decode_support_keeps_full_decode_for_one_token_queries():
    for q in (1, None):
        kw = {} if q is None else dict(uniform_decode_query_len=q)
        assert pb.resolve_cudagraph_mode(M.FULL_AND_PIECEWISE, S.UNIFORM_SINGLE_TOKEN_DECODE, **kw) is M.FULL_AND_PIECEWISE
    with pytest.raises(ValueError, match="uniform_decode_query_len must be a positive int, got 0"):
        pb.resolve_cudagraph_mode(M.FULL, S.ALWAYS, uniform_decode_query_len=0)


def test_graph_runner_honours_single_token_decode_support():
    import torch

    runner = pb.GraphRunner(torch.nn.Linear(8, 8), SIM, [pb.StaticInput("x", (8,), torch.float32)],
                            attention_support=S.UNIFORM_SINGLE_TOKEN_DECODE, uniform_decode_query_len=4)
    assert runner.mode is M.PIECEWISE
    assert not runner.dispatcher.keys[M.FULL]


def test_max_num_seqs_keys_full_mixed_batches_by_request_count():
    d = pb.CudagraphDispatcher(SIM.replace(cudagraph_mode="FULL", capture_sizes=[4, 16], max_num_seqs=8))
    d.initialize_keys(M.FULL)
    assert d.dispatch(3) == (M.FULL, BD(4, num_reqs=4))
    assert d.dispatch(10) == (M.FULL, BD(16, num_reqs=8))
    assert {k.num_reqs for k in d.keys[M.FULL]} == {4, 8}
    # PIECEWISE keys and uniform decode keys are unchanged
    d = pb.CudagraphDispatcher(SIM.replace(capture_sizes=[4, 16], max_num_seqs=8))
    d.initialize_keys(M.FULL_AND_PIECEWISE)
    assert d.dispatch(10) == (M.PIECEWISE, BD(16))
    assert d.dispatch(16, uniform_decode=True) == (M.FULL, BD(16, num_reqs=16, uniform=True))


@pytest.mark.parametrize("bad", [-1, 0, 2.0, True, "3"])
def test_pad_rejects_non_positive_counts(bad):
    d = dispatcher(M.PIECEWISE)
    with pytest.raises(ValueError, match=rf"num_tokens must be a positive int, got {bad!r}"):
        d.pad(bad)
    assert d.pad(3) == 8 and d.pad(9) == 9


@pytest.mark.parametrize("field, bad", [("uniform_decode", "yes"), ("uniform_decode", 1), ("disable_full", None),
                                        ("num_reqs", 0), ("num_reqs", 2.5)])
def test_dispatch_rejects_bad_flags(field, bad):
    d = dispatcher(M.FULL_AND_PIECEWISE)
    with pytest.raises(ValueError, match=rf"{field} must be .*, got {bad!r}"):
        d.dispatch(2, **{field: bad})
