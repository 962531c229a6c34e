"""serve.Engine with ``compile_pieces="none"``: the model's own forward, no Dynamo at all (issue 45 point 2).

FULL steps replay graphs of the whole forward, PIECEWISE steps breakable graphs whose breaks are the
splitting ops met at run time (capture/op_breaks.py); tokens equal the compiled engine's and a full
recompute's; nothing is compiled (``torch.compile`` patched to raise, the backend's graph counter still).
"""

from __future__ import annotations

import pytest
import torch

import piecewise_backend as pb
from pbtest.helpers import load_file
from piecewise_backend import serve
from piecewise_backend.runner import StaticInput

own = load_file("examples/own_model.py")
M = pb.CUDAGraphMode
PROMPTS = [[5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25], [3, 1, 4, 1, 5], [42]]
ARGS = dict(kv_layout=own.KV_LAYOUT, vocab_size=own.VOCAB, max_num_reqs=3, max_model_len=32, block_size=4,
            max_num_batched_tokens=8)


def config(pieces: str = "none", **kw) -> pb.CompilationConfig:
    return pb.CompilationConfig(capture_sizes=[1, 2, 4, 8], platform="simulated", compile_pieces=pieces, **kw)


@pytest.fixture
def no_compile(monkeypatch):
    """torch.compile raises, and the backend's compiled-graph count must stay as it was."""
    def refuse(*args, **kwargs):
        raise AssertionError("torch.compile was called under compile_pieces='none'")

    monkeypatch.setattr(torch, "compile", refuse)
    before = pb.counters["graphs"]
    yield
    assert pb.counters["graphs"] == before, "a Dynamo graph was compiled"


@pytest.fixture(scope="module")
def reference():
    model = own.make_model()
    return [own.reference(model, p, 8) for p in PROMPTS]


def test_full_and_piecewise_steps_replay_graphs_without_dynamo(no_compile, reference):
    engine = serve.Engine(own.make_model(), config(), **ARGS)
    assert engine.backend is None and engine.runner.downgrades == ()
    with pb.expect(graphs=0):
        report = engine.capture()
    assert report.graphs > 0
    steps: list[serve.StepInfo] = []
    before = pb.counters["replays"]
    with pb.expect(captures=0, graphs=0):
        out = engine.generate(PROMPTS, 8, on_step=steps.append)
    assert out == reference
    assert {s.mode for s in steps} == {M.FULL, M.PIECEWISE}
    assert pb.counters["replays"] - before == len(steps)
    # each PIECEWISE graph breaks at the model's two attention calls: 3 graph segments, 2 eager breaks
    entries = engine.runner.model.runnable.entries
    assert entries and all(len(e.segments) == 5 for e in entries.values())


def test_tokens_equal_the_compiled_engine():
    compiled = serve.Engine(own.make_model(), config("eager"), **ARGS)
    compiled.capture()
    want = compiled.generate(PROMPTS, 8)
    assert pb.counters["graphs"] > 0
    mine = serve.Engine(own.make_model(), config(), **ARGS)
    with pb.expect(graphs=0, compiles=0):
        mine.capture()
        got = mine.generate(PROMPTS, 8)
    assert got == want


def test_lazy_capture_and_capture_idle_capture_without_compiling(no_compile, reference):
    engine = serve.Engine(own.make_model(), config(), lazy_capture=True, step_capture_budget_s=0, **ARGS)
    assert not engine.runner.needs_compile
    steps: list[serve.StepInfo] = []
    assert engine.generate(PROMPTS, 8, on_step=steps.append) == reference
    assert {s.mode for s in steps} == {M.NONE}
    captured = engine.capture_idle(60.0)
    assert {mode for mode, _ in captured} == {M.FULL, M.PIECEWISE}
    again: list[serve.StepInfo] = []
    assert engine.generate(PROMPTS, 8, on_step=again.append) == reference
    assert {M.FULL, M.PIECEWISE} <= {s.mode for s in again}


def test_a_speculative_engine_serves_without_dynamo(no_compile, reference):
    engine = serve.SpeculativeEngine(
        own.make_model(0), own.make_model(1), config(), num_speculative_tokens=2, target_layout=own.KV_LAYOUT,
        drafter_layout=own.KV_LAYOUT, vocab_size=own.VOCAB, max_num_reqs=3, max_model_len=40, block_size=4,
    )
    engine.capture()
    before = pb.counters["replays"]
    assert engine.generate(PROMPTS, 8) == reference
    assert pb.counters["replays"] > before


def test_micro_batching_composes_with_full_graphs(no_compile, reference):
    engine = serve.Engine(own.make_model(), config(cudagraph_mode="FULL_DECODE_ONLY", use_ubatching=True,
                                                    dbo_decode_token_threshold=2), **ARGS)
    engine.capture()
    steps: list[tuple[M, bool]] = []
    out = engine.generate(PROMPTS, 8, on_step=lambda s: steps.append((s.mode, engine.runner.last_ubatched)))
    assert out == reference
    assert (M.FULL, True) in steps  # a micro-batched step replayed its FULL graph


def test_a_compiled_model_is_refused_by_the_runner():
    compiled = torch.compile(torch.nn.Linear(2, 2), backend="eager")
    with pytest.raises(ValueError, match=r"compile_pieces='none'\) takes the model uncompiled .* OptimizedModule"):
        pb.GraphRunner(compiled, config(cudagraph_mode="FULL"), [StaticInput("x", shape=(2,), dtype=torch.float32)])
