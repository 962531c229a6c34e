"""CompilationConfig validation and defaults (DESIGN 2)."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest
import torch

import piecewise_backend as pb

M = pb.CUDAGraphMode
EAGER = dict(compile_pieces="eager")  # so platform="simulated" is allowed where a case needs it

LADDER_512 = [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)]


def test_defaults():
    c = pb.CompilationConfig()
    assert c.cudagraph_mode is M.FULL_AND_PIECEWISE
    assert c.splitting_ops is None
    assert c.capture_sizes is None
    assert c.max_capture_size == 512
    assert c.compile_pieces == "inductor"
    assert c.use_breakable is True
    assert c.platform == "auto"
    assert c.num_warmups == 1
    assert c.debug_dump_dir is None


def test_default_ladder_51_sizes_up_to_512():
    sizes = list(pb.CompilationConfig().sizes)
    assert len(sizes) == 51
    assert sizes[:6] == [1, 2, 4, 8, 16, 24]
    assert sizes[-3:] == [480, 496, 512]
    assert 248 in sizes and 256 in sizes and 264 not in sizes and 272 in sizes
    assert sizes == LADDER_512
    assert list(pb.default_capture_sizes(512)) == LADDER_512


@pytest.mark.parametrize("max_size", [1, 3, 8, 100, 256, 300])
def test_ladder_is_cut_at_max_capture_size(max_size):
    sizes = list(pb.CompilationConfig(max_capture_size=max_size).sizes)
    assert sizes == [s for s in LADDER_512 if s <= max_size]
    assert sizes == sorted(set(sizes)) and sizes[0] == 1


def test_capture_sizes_deduplicated_and_sorted():
    c = pb.CompilationConfig(capture_sizes=[16, 1, 8, 4, 8, 16, 2])
    assert c.capture_sizes == (1, 2, 4, 8, 16)
    assert c.sizes == (1, 2, 4, 8, 16)
    assert pb.CompilationConfig(capture_sizes=(3,)).sizes == (3,)
    assert pb.CompilationConfig(capture_sizes={4, 2}).sizes == (2, 4)
    assert pb.CompilationConfig(capture_sizes=[512]).sizes == (512,)


def test_mode_given_by_name_is_parsed():
    assert pb.CompilationConfig(cudagraph_mode="piecewise").cudagraph_mode is M.PIECEWISE
    assert pb.CompilationConfig(cudagraph_mode="FULL_DECODE_ONLY").cudagraph_mode is M.FULL_DECODE_ONLY
    assert pb.CompilationConfig(cudagraph_mode=M.NONE).cudagraph_mode is M.NONE


def test_splitting_ops_canonicalized_and_empty_kept():
    from pbtest.helpers import double

    c = pb.CompilationConfig(splitting_ops=["pb_test::double", torch.ops.pb_test.double.default, double])
    assert c.splitting_ops == ("pb_test::double", "pb_test::double.default", "pb_test::double")
    assert pb.CompilationConfig(splitting_ops=[]).splitting_ops == ()  # [] means "do not split", not None


def test_valid_values_accepted(tmp_path):
    c = pb.CompilationConfig(
        cudagraph_mode="NONE",
        splitting_ops=[torch.nn.functional.scaled_dot_product_attention],
        capture_sizes=[4, 2],
        max_capture_size=4,
        compile_pieces="eager",
        use_breakable=False,
        platform="simulated",
        num_warmups=0,
        debug_dump_dir=tmp_path,
    )
    assert (c.platform, c.num_warmups, c.use_breakable, c.debug_dump_dir) == ("simulated", 0, False, tmp_path)
    assert pb.CompilationConfig(debug_dump_dir=str(tmp_path)).debug_dump_dir == str(tmp_path)
    assert pb.CompilationConfig(platform="cuda").platform == "cuda"


BAD = [
    ("cudagraph_mode", "FULLEST"),
    ("cudagraph_mode", 3),
    ("cudagraph_mode", None),
    ("splitting_ops", "pb_test::double"),  # a bare string, not a list
    ("splitting_ops", 3),
    ("splitting_ops", ["noseparator"]),
    ("splitting_ops", [3]),
    ("splitting_ops", [int]),
    ("capture_sizes", []),
    ("capture_sizes", [0, 8]),
    ("capture_sizes", [-1]),
    ("capture_sizes", [1.5]),
    ("capture_sizes", ["8"]),
    ("capture_sizes", [True]),
    ("capture_sizes", 8),
    ("capture_sizes", "8"),
    ("capture_sizes", [1 << 17]),  # above the size limit
    ("max_capture_size", 0),
    ("max_capture_size", -4),
    ("max_capture_size", 8.0),
    ("max_capture_size", "512"),
    ("max_capture_size", True),
    ("max_capture_size", 10**9),  # would build a multi-GB padding table
    ("compile_pieces", "tvm"),
    ("compile_pieces", None),
    ("compile_pieces", "Inductor "),
    ("use_breakable", 1),
    ("use_breakable", "yes"),
    ("use_breakable", None),
    ("platform", "tpu"),
    ("platform", None),
    ("platform", "CUDA"),
    ("num_warmups", -1),
    ("num_warmups", 1.5),
    ("num_warmups", "1"),
    ("num_warmups", False),
    ("debug_dump_dir", 3),
    ("debug_dump_dir", ["/tmp"]),
    ("max_num_seqs", 0),
    ("max_num_seqs", 2.0),
    ("max_num_seqs", True),
    ("debug_checks", 1),
    ("debug_checks", "yes"),
    ("cache_dir", 3),
    ("cache_dir", ["/tmp"]),
    ("use_ubatching", 1),
    ("use_ubatching", None),
    ("dbo_decode_token_threshold", 1),  # a half would be empty
    ("dbo_decode_token_threshold", 32.0),
    ("dbo_decode_token_threshold", True),
    ("dbo_prefill_token_threshold", 0),
    ("dbo_prefill_token_threshold", "512"),
    ("use_inductor_graph_partition", "yes"),
    ("standalone_capture", "yes"),
    ("standalone_max_graphs", -1),
    ("standalone_memory_budget", 1.5),
]


@pytest.mark.parametrize("field,value", BAD, ids=[f"{f}={v!r}" for f, v in BAD])
def test_bad_value_raises_value_error_naming_field(field, value):
    with pytest.raises(ValueError) as info:
        pb.CompilationConfig(**{field: value, **({} if field == "compile_pieces" else EAGER)})
    assert field in str(info.value)


def test_every_field_has_a_bad_value_case():
    assert {f.name for f in dataclasses.fields(pb.CompilationConfig)} == {f for f, _ in BAD}


def test_capture_size_above_max_names_both():
    with pytest.raises(ValueError, match="max_capture_size") as info:
        pb.CompilationConfig(capture_sizes=[8, 64], max_capture_size=32)
    assert "64" in str(info.value) and "capture_sizes" in str(info.value)


def test_simulated_platform_refuses_inductor_pieces():
    with pytest.raises(ValueError, match="simulated") as info:
        pb.CompilationConfig(platform="simulated", compile_pieces="inductor")
    assert "compile_pieces" in str(info.value)
    with pytest.raises(ValueError, match="compile_pieces"):
        pb.CompilationConfig(platform="simulated")  # inductor is the default
    assert pb.CompilationConfig(platform="simulated", compile_pieces="eager").platform == "simulated"


def test_frozen_and_replace_revalidates():
    c = pb.CompilationConfig(capture_sizes=[4, 1])
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.max_capture_size = 8
    d = c.replace(max_capture_size=4, cudagraph_mode="piecewise")
    assert (d.max_capture_size, d.cudagraph_mode, d.capture_sizes) == (4, M.PIECEWISE, (1, 4))
    assert c.max_capture_size == 4  # original untouched (derived from capture_sizes)
    with pytest.raises(ValueError, match="capture_sizes"):
        c.replace(max_capture_size=2)  # 4 no longer fits
    with pytest.raises(ValueError, match="num_warmups"):
        c.replace(num_warmups=-1)


def test_config_is_hashable_and_comparable():
    a = pb.CompilationConfig(capture_sizes=[2, 1], splitting_ops=["pb_test::double"])
    b = pb.CompilationConfig(capture_sizes=(1, 2, 2), splitting_ops=("pb_test::double",))
    assert a == b and hash(a) == hash(b)
    assert a != a.replace(num_warmups=2)
    assert pb.CompilationConfig(debug_dump_dir=pathlib.Path("/tmp")) != pb.CompilationConfig()


# ---------------------------------------------------------------- issue 10.19: vLLM-compatible sizes


def test_max_capture_size_follows_capture_sizes_unless_given():
    assert pb.CompilationConfig().max_capture_size == 512
    c = pb.CompilationConfig(capture_sizes=[1024, 8])
    assert (c.max_capture_size, c.sizes) == (1024, (8, 1024))
    assert c.replace(capture_sizes=[2048]).max_capture_size == 2048  # derived again, not frozen at 1024
    assert pb.CompilationConfig(capture_sizes=[8], max_capture_size=64).max_capture_size == 64


def test_explicit_max_capture_size_below_largest_capture_size_names_both():
    with pytest.raises(ValueError, match=r"capture_sizes \[1024\] exceed max_capture_size=512"):
        pb.CompilationConfig(capture_sizes=[8, 1024], max_capture_size=512)


def test_no_sizes_accepted_for_mode_none_only():
    for kwargs in (dict(capture_sizes=[]), dict(max_capture_size=0), dict(capture_sizes=[], max_capture_size=0)):
        c = pb.CompilationConfig(cudagraph_mode="NONE", **kwargs)
        assert c.sizes == ()
        d = pb.CudagraphDispatcher(c)
        d.initialize_keys(c.cudagraph_mode)
        assert d.dispatch(5) == (M.NONE, pb.BatchDescriptor(5))
        with pytest.raises(ValueError, match="capture_sizes|max_capture_size"):
            pb.CompilationConfig(cudagraph_mode="PIECEWISE", **kwargs)


def test_huge_max_capture_size_is_refused_quickly():
    with pytest.raises(ValueError, match=r"max_capture_size must be an int in \[1, 65536\].*1000000000"):
        pb.CompilationConfig(max_capture_size=10**9)


def test_ubatching_defaults_and_thresholds_kept():
    config = pb.CompilationConfig()
    assert (config.use_ubatching, config.dbo_decode_token_threshold, config.dbo_prefill_token_threshold) == (
        False, 32, 512,
    )
    config = pb.CompilationConfig(use_ubatching=True, dbo_decode_token_threshold=2, dbo_prefill_token_threshold=9)
    assert (config.use_ubatching, config.dbo_decode_token_threshold, config.dbo_prefill_token_threshold) == (
        True, 2, 9,
    )


def test_inductor_graph_partition_is_a_field_refused_with_its_reason():
    assert pb.CompilationConfig().use_inductor_graph_partition is False
    reason = "Inductor partitions only GPU nodes" if not torch.cuda.is_available() else "pass use_breakable=False"
    with pytest.raises(ValueError, match=rf"use_inductor_graph_partition=True is refused: .*{reason}"):
        pb.CompilationConfig(use_inductor_graph_partition=True)
    with pytest.raises(ValueError, match="use_inductor_graph_partition must be a bool, got 'yes'"):
        pb.CompilationConfig(use_inductor_graph_partition="yes")
