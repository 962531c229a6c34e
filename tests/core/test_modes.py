"""CUDAGraphMode and AttentionGraphSupport (DESIGN 4.1)."""

from __future__ import annotations

import pytest

import piecewise_backend as pb

M = pb.CUDAGraphMode
NONE, PIECEWISE, FULL = M.NONE, M.PIECEWISE, M.FULL

# member: (decode_mode, mixed_mode, separate_routine, max_cudagraph_mode)
TABLE = {
    M.NONE: (NONE, NONE, False, NONE),
    M.PIECEWISE: (PIECEWISE, PIECEWISE, False, PIECEWISE),
    M.FULL: (FULL, FULL, False, FULL),
    M.FULL_DECODE_ONLY: (FULL, NONE, True, FULL),
    M.FULL_AND_PIECEWISE: (FULL, PIECEWISE, True, FULL),
}


def test_table_covers_every_member():
    assert set(TABLE) == set(M)
    assert [m.name for m in M] == ["NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"]


@pytest.mark.parametrize("mode", list(M), ids=lambda m: m.name)
def test_decode_mixed_separate_max(mode):
    decode, mixed, separate, strongest = TABLE[mode]
    assert mode.decode_mode() is decode
    assert mode.mixed_mode() is mixed
    assert mode.separate_routine() is separate
    assert mode.max_cudagraph_mode() is strongest


@pytest.mark.parametrize("mode", list(M), ids=lambda m: m.name)
def test_has_mode_for_every_runtime_mode(mode):
    decode, mixed, _, _ = TABLE[mode]
    for runtime in (NONE, PIECEWISE, FULL):
        assert mode.has_mode(runtime) is (runtime in (decode, mixed)), (mode, runtime)
    assert mode.has_full_cudagraphs() is (FULL in (decode, mixed))
    assert mode.has_piecewise_cudagraphs() is (PIECEWISE in (decode, mixed))


@pytest.mark.parametrize("config_mode", [M.FULL_DECODE_ONLY, M.FULL_AND_PIECEWISE], ids=lambda m: m.name)
def test_has_mode_rejects_configuration_modes(config_mode):
    with pytest.raises(ValueError, match=config_mode.name):
        M.FULL.has_mode(config_mode)


def test_full_decode_only_and_full_and_piecewise_contracts():
    # DESIGN 4.1: FULL_DECODE_ONLY = (decode FULL, mixed NONE); FULL_AND_PIECEWISE = (FULL, PIECEWISE)
    assert (M.FULL_DECODE_ONLY.decode_mode(), M.FULL_DECODE_ONLY.mixed_mode()) == (FULL, NONE)
    assert (M.FULL_AND_PIECEWISE.decode_mode(), M.FULL_AND_PIECEWISE.mixed_mode()) == (FULL, PIECEWISE)
    assert not M.FULL_DECODE_ONLY.has_piecewise_cudagraphs()
    assert M.FULL_AND_PIECEWISE.has_piecewise_cudagraphs()


@pytest.mark.parametrize("mode", list(M), ids=lambda m: m.name)
def test_valid_runtime_modes_from_class_and_member(mode):
    expected = {NONE, PIECEWISE, FULL}
    assert set(M.valid_runtime_modes()) == expected
    assert set(mode.valid_runtime_modes()) == expected
    # decode and mixed halves of every mode are runtime modes
    assert mode.decode_mode() in expected and mode.mixed_mode() in expected
    assert (mode in expected) is (not mode.separate_routine())


def test_parse_accepts_member_and_case_insensitive_name():
    for m in M:
        assert M.parse(m) is m
        assert M.parse(m.name) is m
        assert M.parse(m.name.lower()) is m


@pytest.mark.parametrize("bad", ["FULLISH", "", 2, None, 2.0])
def test_parse_rejects_garbage(bad):
    with pytest.raises(ValueError, match="cudagraph mode"):
        M.parse(bad)


def test_attention_graph_support_is_ordered_int_enum():
    S = pb.AttentionGraphSupport
    assert [(s.name, int(s)) for s in S] == [
        ("NEVER", 0),
        ("UNIFORM_SINGLE_TOKEN_DECODE", 1),
        ("UNIFORM_BATCH", 2),
        ("ALWAYS", 3),
    ]
    assert S.NEVER < S.UNIFORM_SINGLE_TOKEN_DECODE < S.UNIFORM_BATCH < S.ALWAYS
    assert max(S.UNIFORM_BATCH, S.NEVER) is S.UNIFORM_BATCH
    assert S(2) is S.UNIFORM_BATCH
