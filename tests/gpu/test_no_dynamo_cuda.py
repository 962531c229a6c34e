"""compile_pieces="none" on CUDA: examples/own_model.py's decoder served by serve.Engine with real FULL and breakable
PIECEWISE graphs and no Dynamo, tokens equal to a full recompute and to the engine with Inductor pieces; the capture
seconds of both printed side by side (the goal: "none" at most half of the compiled path's). The simulated twin is
tests/serve/test_no_dynamo.py."""

from __future__ import annotations

import time

import pytest

import piecewise_backend as pb
from pbtest.helpers import load_file
from piecewise_backend import serve

pytestmark = pytest.mark.cuda

own = load_file("examples/own_model.py")
M = pb.CUDAGraphMode
PROMPTS = [[5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25], [3, 1, 4, 1, 5], [42]]


def served(pieces: str) -> tuple[float, list[list[int]], set]:
    """Seconds of ``capture()`` (the compile included), the tokens, the modes the steps ran."""
    config = pb.CompilationConfig(capture_sizes=[1, 2, 4, 8], platform="cuda", compile_pieces=pieces)
    engine = serve.Engine(own.make_model().cuda(), config, kv_layout=own.KV_LAYOUT, vocab_size=own.VOCAB,
                          max_num_reqs=3, max_model_len=32, block_size=4, max_num_batched_tokens=8)
    began = time.perf_counter()
    engine.capture()
    seconds = time.perf_counter() - began
    steps: list[serve.StepInfo] = []
    tokens = engine.generate(PROMPTS, 8, on_step=steps.append)
    return seconds, tokens, {s.mode for s in steps}


def test_capture_without_dynamo_gives_the_tokens_of_inductor_pieces_in_less_time():
    reference = [own.reference(own.make_model(), p, 8) for p in PROMPTS]
    inductor_s, compiled, compiled_modes = served("inductor")
    graphs_before = pb.counters["graphs"]
    none_s, bare, bare_modes = served("none")
    assert pb.counters["graphs"] == graphs_before  # no Dynamo graph
    assert compiled == reference and bare == reference
    assert compiled_modes == bare_modes == {M.FULL, M.PIECEWISE}
    print(f"capture(): Inductor pieces {inductor_s:.2f} s, compile_pieces='none' {none_s:.2f} s "
          f"({none_s / inductor_s:.2f}x)")
    assert none_s <= 0.5 * inductor_s
