"""The engine's ladder covers its limits (serve/ladder.py): ``max_num_reqs`` as a FULL decode size and
``max_num_batched_tokens`` as a PIECEWISE one; an explicit ``max_capture_size`` bounds what is added and
says so; a step that still runs without the graph its mode asked for says why, per step and per counter."""

from __future__ import annotations

import pytest

import piecewise_backend as pb
from pbtest.helpers import load_file
from piecewise_backend import serve
from piecewise_backend.serve import ladder
from piecewise_backend.serve.ladder import cover_limits

own = load_file("examples/own_model.py")
M = pb.CUDAGraphMode
# six requests, one of a 12-token prompt: decode steps of 6 requests and a 12-token prefill chunk
PROMPTS = [[5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27], [3, 1, 4], [2, 7, 1], [8, 2, 8], [1, 8, 2], [4, 5, 9]]


def make_engine(capture_sizes=(1, 2, 4), **kw) -> serve.Engine:
    config = pb.CompilationConfig(cudagraph_mode=kw.pop("mode", "FULL_AND_PIECEWISE"), capture_sizes=list(capture_sizes),
                                  platform="simulated", compile_pieces="eager", **kw.pop("config", {}))
    args = dict(kv_layout=own.KV_LAYOUT, vocab_size=own.VOCAB, max_num_reqs=6, max_model_len=32, block_size=4,
                max_num_batched_tokens=16)
    return serve.Engine(own.make_model(), config, **{**args, **kw})


@pytest.fixture(scope="module")
def reference():
    model = own.make_model()
    return [own.reference(model, p, 6) for p in PROMPTS]


def test_no_step_runs_without_a_graph_when_the_sizes_stop_short_of_the_limits(reference):
    engine = make_engine()
    assert engine.model_runners[0].ladder.added == (6, 16)
    assert engine.runner.downgrades == ()
    engine.capture()
    steps: list[serve.StepInfo] = []
    assert engine.generate(PROMPTS, 6, on_step=steps.append) == reference
    assert any(s.uniform_decode and s.num_reqs == 6 for s in steps)  # the decode step the ladder lacked
    assert any(s.num_tokens > 4 and not s.uniform_decode for s in steps)
    for s in steps:
        assert s.mode == (M.FULL if s.uniform_decode else M.PIECEWISE), s
        assert s.reason == ""


def test_an_explicit_max_capture_size_bounds_the_ladder_and_says_so(reference, monkeypatch):
    warned: list[str] = []  # the logger itself: other tests may stop the package's records reaching the root
    monkeypatch.setattr(ladder.logger, "warning", lambda msg, *a: warned.append(msg % a))
    engine = make_engine(config=dict(max_capture_size=8))
    assert engine.model_runners[0].ladder.added == (6,)
    assert engine.model_runners[0].ladder.uncovered == (("max_num_batched_tokens", 16),)
    assert len(warned) == 1 and "max_num_batched_tokens=16" in warned[0] and "max_capture_size=8" in warned[0]
    assert len(engine.runner.downgrades) == 1 and "max_num_batched_tokens=16" in engine.runner.downgrades[0]


def test_each_eager_step_names_its_reason_and_is_counted(reference):
    """Sizes bounded at 4 by hand (max_capture_size=4): a 6-request decode step and a 12-token chunk run
    eagerly, each StepInfo says "above_ladder", and the counter counts them."""
    engine = make_engine(config=dict(max_capture_size=4), max_num_batched_tokens=8)
    assert engine.model_runners[0].ladder.uncovered == (("max_num_reqs", 6), ("max_num_batched_tokens", 8))
    engine.capture()
    steps: list[serve.StepInfo] = []
    before = pb.counters["eager_steps_above_ladder"]
    assert engine.generate(PROMPTS, 6, on_step=steps.append) == reference
    eager = [s for s in steps if s.mode == M.NONE]
    assert eager and all(s.reason == "above_ladder" and s.num_tokens > 4 for s in eager)
    assert all(s.reason == "" for s in steps if s.mode != M.NONE)
    assert pb.counters["eager_steps_above_ladder"] - before == len(eager)


def test_lazy_capture_steps_name_not_captured(reference):
    engine = make_engine(lazy_capture=True)
    steps: list[serve.StepInfo] = []
    assert engine.generate(PROMPTS[:2], 3, on_step=steps.append) == [r[:3] for r in reference[:2]]
    assert steps[0].mode == M.NONE and steps[0].reason == "not_captured"


@pytest.mark.parametrize("mode, added", [("FULL_DECODE_ONLY", (6,)), ("PIECEWISE", (16,)), ("NONE", ())])
def test_the_limits_added_follow_the_mode(mode, added):
    config = pb.CompilationConfig(cudagraph_mode=mode, capture_sizes=[1, 2, 4])
    ladder = cover_limits(config, max_num_reqs=6, max_num_batched_tokens=16)
    assert ladder.added == added
    assert ladder.config.sizes == tuple(sorted({1, 2, 4, *added}))


def test_a_uniform_decode_query_len_scales_the_decode_size():
    config = pb.CompilationConfig(cudagraph_mode="FULL_AND_PIECEWISE", capture_sizes=[1, 2, 4])
    assert cover_limits(config, max_num_reqs=3, max_num_batched_tokens=None, uniform_decode_query_len=3).added == (9,)
