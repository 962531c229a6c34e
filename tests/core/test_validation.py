"""The argument checks every edge shares (``validation.is_int``), and what they make of numpy's scalars."""

from __future__ import annotations

import enum

import numpy as np
import pytest

import piecewise_backend as pb
from piecewise_backend.validation import is_int


class Size(enum.IntEnum):
    SMALL = 4


@pytest.mark.parametrize("value", [0, -3, 2**70, np.int64(8), np.uint8(3), np.int32(-1), Size.SMALL])
def test_integers_count(value):
    assert is_int(value)


@pytest.mark.parametrize("value", [True, False, np.bool_(True), 1.0, np.float64(2.0), "1", None, [1], 1 + 0j])
def test_everything_else_does_not(value):
    assert not is_int(value)


def test_the_config_accepts_numpy_integers_and_holds_python_ints():
    config = pb.CompilationConfig(capture_sizes=[np.int64(4), 2], num_warmups=np.int32(2), max_num_seqs=np.int64(3),
                                  dbo_decode_token_threshold=np.int16(8))
    assert config.capture_sizes == (2, 4) and config.max_capture_size == 4
    for value in (*config.capture_sizes, config.max_capture_size, config.num_warmups, config.max_num_seqs,
                  config.dbo_decode_token_threshold):
        assert type(value) is int
    assert config == pb.CompilationConfig(capture_sizes=[2, 4], num_warmups=2, max_num_seqs=3, dbo_decode_token_threshold=8)


def test_the_config_still_refuses_bools_and_floats():
    with pytest.raises(ValueError, match=r"num_warmups must be an int >= 0, got True"):
        pb.CompilationConfig(num_warmups=True)
    with pytest.raises(ValueError, match=r"max_capture_size must be an int in \[1, 65536\].*got 8.0"):
        pb.CompilationConfig(max_capture_size=8.0)


def test_the_dispatcher_takes_a_numpy_token_count_like_an_int():
    d = pb.CudagraphDispatcher(pb.CompilationConfig(cudagraph_mode="PIECEWISE", capture_sizes=[4, 8]))
    d.initialize_keys(pb.CUDAGraphMode.PIECEWISE)
    assert d.dispatch(np.int64(3)) == d.dispatch(3) == (pb.CUDAGraphMode.PIECEWISE, pb.BatchDescriptor(4))
    with pytest.raises(ValueError):
        d.dispatch(True)
