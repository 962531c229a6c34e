"""The mode policy (runner/mode_policy.py): the mode a runner runs and each downgrade, as one value."""

from __future__ import annotations

import piecewise_backend as pb
from piecewise_backend.runner.mode_policy import RunnerModes, runner_modes
from pbtest.helpers import SIM

M = pb.CUDAGraphMode
S = pb.AttentionGraphSupport


def test_a_config_kept_whole_has_no_downgrades():
    assert runner_modes(SIM.replace(cudagraph_mode=M.FULL_AND_PIECEWISE)) == RunnerModes(
        M.FULL_AND_PIECEWISE, M.FULL_AND_PIECEWISE, False, ()
    )


def test_each_downgrade_lowers_the_mode_and_says_why():
    modes = runner_modes(SIM.replace(cudagraph_mode=M.FULL), attention_support=S.UNIFORM_BATCH)
    assert modes.mode == M.FULL_AND_PIECEWISE
    assert modes.downgrades == ("attention support UNIFORM_BATCH: cudagraph_mode FULL -> FULL_AND_PIECEWISE",)
    ubatch = runner_modes(SIM.replace(cudagraph_mode=M.FULL_AND_PIECEWISE, use_ubatching=True))
    assert ubatch.mode == M.FULL_DECODE_ONLY and ubatch.ubatching
    assert any("use_ubatching with use_breakable=True" in d for d in ubatch.downgrades)


def test_a_drafter_dispatches_piecewise_and_is_never_micro_batched():
    modes = runner_modes(SIM.replace(cudagraph_mode=M.FULL, use_ubatching=True), drafter=True)
    assert (modes.mode, modes.dispatch_mode, modes.ubatching) == (M.FULL, M.PIECEWISE, False)
    assert modes.downgrades == ("use_ubatching: a drafter's steps are never micro-batched",)
    runner = pb.GraphRunner(
        lambda x: x, SIM.replace(cudagraph_mode=M.FULL, use_ubatching=True),
        [pb.StaticInput("x")], drafter=True,
    )
    assert runner.downgrades == modes.downgrades and runner.dispatcher.mode == M.PIECEWISE
