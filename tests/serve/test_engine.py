"""serve.Engine on a decoder that is not a Hugging Face model (examples/own_model.py's), on the simulated
platform: graph modes, chunked prefill, preemption, streaming, the online API, lazy capture, seeds,
callbacks that raise, and the constructor's checks. The CUDA twin is the example under
scripts/gpu_check.sh (it picks CUDA when one is present)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import piecewise_backend as pb
from pbtest.helpers import CUDA, NaNLogitsAt, load_file
from piecewise_backend import serve

own = load_file("examples/own_model.py")
M = pb.CUDAGraphMode
PROMPTS = [[5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25], [3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8], [42]]


def make_engine(platform: str = "simulated", model: torch.nn.Module | None = None, **kw) -> serve.Engine:
    device = "cuda" if platform == "cuda" else "cpu"
    extra = dict(CUDA) if platform == "cuda" else dict(platform="simulated", compile_pieces="eager")
    config = pb.CompilationConfig(cudagraph_mode=kw.pop("mode", "FULL_AND_PIECEWISE"), capture_sizes=[1, 2, 4, 8], **extra)
    args = dict(kv_layout=own.KV_LAYOUT, vocab_size=own.VOCAB, max_num_reqs=4, max_model_len=32, block_size=4)
    return serve.Engine((model or own.make_model()).to(device), config, **{**args, **kw})


@pytest.fixture(scope="module")
def reference():
    model = own.make_model()
    return {tuple(p): own.reference(model, p, 12) for p in PROMPTS}


@pytest.fixture(scope="module")
def crowded():
    """8 tokens a step and 14 blocks of 4 tokens for 4 requests of up to 22 tokens: chunks and preemptions."""
    engine = make_engine(num_blocks=14, max_num_batched_tokens=8)
    engine.capture()
    return engine


def test_full_and_piecewise_with_chunks_and_preemption_equals_a_full_recompute(crowded, reference):
    steps: list[serve.StepInfo] = []
    streamed: dict[int, list[int]] = {}
    with pb.expect(captures=0):  # every key was captured up front
        out = crowded.generate(PROMPTS, 12, on_token=lambda i, t: streamed.setdefault(i, []).append(t),
                               on_step=steps.append)
    assert out == [reference[tuple(p)] for p in PROMPTS]
    assert [streamed[i] for i in range(len(PROMPTS))] == out
    for s in steps:  # uniform decode steps replay FULL graphs, steps with prompt tokens PIECEWISE ones
        assert s.mode == (M.FULL if s.uniform_decode else M.PIECEWISE), s
        assert s.num_tokens <= 8
    assert any(s.num_tokens == 8 and not s.uniform_decode for s in steps)  # the 11-token prompt: two chunks
    assert sum(len(s.preempted) for s in steps) > 0
    assert crowded.cache.tables == {} and crowded.cache.num_free_blocks == 14


def test_the_online_api_adds_and_cancels_while_others_run(crowded, reference):
    a = crowded.add_request(PROMPTS[0], 12)
    b = crowded.add_request(PROMPTS[1], 12, request_id="b")
    assert crowded.step() == [] and crowded.has_unfinished()
    assert crowded.cancel_request("b") and not crowded.cancel_request("b")
    c = crowded.add_request(PROMPTS[2], 12)
    done = {r.request_id: r for r in crowded.results()}
    assert done[a].token_ids == reference[tuple(PROMPTS[0])] and done[a].finish_reason == "length"
    assert done[c].token_ids == reference[tuple(PROMPTS[2])]
    assert done[b].finish_reason == "cancelled" and len(done[b].token_ids) < 12
    assert not crowded.has_unfinished()


def test_generate_ids_never_meet_online_ids(crowded, reference):
    """An online client's cancel_request(1), made while generate runs, must not cut generate's prompt 1."""
    crowded.add_request(PROMPTS[3], 1, request_id=1)
    assert [r.request_id for r in crowded.results()] == [1]
    answers = []
    out = crowded.generate(PROMPTS, 12, on_token=lambda i, t: answers.append(crowded.cancel_request(1)))
    assert not any(answers) and out == [reference[tuple(p)] for p in PROMPTS]


def test_a_request_added_while_generate_runs_is_served_not_dropped(crowded, reference):
    added = []
    out = crowded.generate(PROMPTS[:2], 12, on_token=lambda i, t: added or added.append(crowded.add_request(PROMPTS[2], 12)))
    assert out == [reference[tuple(p)] for p in PROMPTS[:2]]
    assert crowded.has_unfinished()  # generate left the online request alone
    assert [r.token_ids for r in crowded.results()] == [reference[tuple(PROMPTS[2])]]


def test_generate_or_step_from_a_callback_is_refused_naming_the_reentrant_call(crowded, reference):
    with pytest.raises(RuntimeError, match=r"generate\(\) called from inside generate\(\)"):
        crowded.generate(PROMPTS[:1], 3, on_token=lambda i, t: crowded.generate([[1]], 1))
    with pytest.raises(RuntimeError, match=r"step\(\) called from inside generate\(\)"):
        crowded.generate(PROMPTS[:1], 3, on_step=lambda info: crowded.step())
    crowded.add_request(PROMPTS[1], 2, on_token=lambda i, t: crowded.generate([[1]], 1))
    with pytest.raises(RuntimeError, match=r"generate\(\) called from inside step\(\)"):
        crowded.step()
    assert [r.finish_reason for r in crowded.results()] == ["error"]
    assert crowded.generate(PROMPTS[:1], 12) == [reference[tuple(PROMPTS[0])]]  # nothing left wedged
    assert crowded.cache.num_free_blocks == 14


def test_a_raising_callback_ends_its_request_and_the_others_finish(crowded, reference):
    def boom(request_id, token):
        if len(seen) == 1:
            raise KeyError("client went away")
        seen.append(token)

    seen: list[int] = []
    bad = crowded.add_request(PROMPTS[1], 12, on_token=boom)
    good = crowded.add_request(PROMPTS[0], 12)
    errors, done = 0, {}
    while crowded.has_unfinished():
        try:
            done.update((r.request_id, r) for r in crowded.step())
        except KeyError:
            errors += 1
    done.update((r.request_id, r) for r in crowded.step())
    assert errors == 1
    assert done[bad].finish_reason == "error" and len(done[bad].token_ids) == 2
    assert done[bad].error == "its on_token callback raised KeyError: 'client went away'" and done[good].error == ""
    assert done[good].token_ids == reference[tuple(PROMPTS[0])]
    with pytest.raises(ZeroDivisionError):  # generate re-raises, and frees what its requests held
        crowded.generate(PROMPTS, 4, on_token=lambda i, t: 1 / 0)
    assert crowded.cache.tables == {} and crowded.generate(PROMPTS[:1], 12) == [reference[tuple(PROMPTS[0])]]


def test_a_seed_gives_the_same_tokens_at_any_batch_index_and_under_any_id(crowded):
    params = serve.SamplingParams(temperature=0.8, top_k=20, seed=1234)
    alone = crowded.generate([PROMPTS[1]], 12, sampling=params)[0]
    crowd = crowded.generate([PROMPTS[0], PROMPTS[2], PROMPTS[1]], 12, sampling=[None, params, params])
    assert crowd[2] == alone and crowd[1] != alone
    crowded.add_request(PROMPTS[3], 3)
    rid = crowded.add_request(PROMPTS[1], 12, sampling=params, request_id="someone")
    assert {r.request_id: r.token_ids for r in crowded.results()}[rid] == alone


def test_requests_sharing_a_seed_draw_independent_noise(crowded):
    """Noise keyed by (seed, position) only gave a prompt extended by another's first token that
    request's tokens shifted by one position; the prompt is in the key now (and, within one call,
    which copy of an identical prompt it is), while a request still reproduces alone, in any batch,
    through preemption (the crowded engine preempts) and from the online API."""
    params = serve.SamplingParams(temperature=1.0, seed=1234)
    alone = crowded.generate([PROMPTS[1]], 12, sampling=params)[0]
    shifted = PROMPTS[1] + [alone[0]]
    both = crowded.generate([PROMPTS[1], shifted], 11, sampling=params)
    assert both[0] == alone[:11]
    assert both[1] != alone[1:]  # was equal: row 1 was row 0 shifted by one position
    twins = crowded.generate([PROMPTS[1], shifted, PROMPTS[1]], 11, sampling=params)
    assert twins[:2] == both and twins[2] != twins[0]  # the second copy of a prompt: its own noise
    rid = crowded.add_request(shifted, 11, sampling=params, request_id="shifted")
    assert {r.request_id: r.token_ids for r in crowded.results()}[rid] == both[1]


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_nan_logits_end_their_request_with_an_error_and_the_others_are_served(reference, sampled, caplog):
    """PROMPTS[1] (5 tokens) reaches position 7 while decoding: NaN logits for its 4th token (argmax took
    the NaN's index); PROMPTS[0] and [2] pass position 7 inside a prompt chunk only, in FULL and
    PIECEWISE steps with preemptions."""
    engine = make_engine(model=NaNLogitsAt(own.make_model(), 7), num_blocks=14, max_num_batched_tokens=8)
    engine.capture()
    prompts = PROMPTS[:3]
    params = serve.SamplingParams(0.7, seed=5) if sampled else None
    ids = {engine.add_request(p, 12, sampling=params): p for p in prompts}
    with caplog.at_level("WARNING", logger="piecewise_backend.serve.loop"):
        done = {r.request_id: r for r in engine.results()}
    bad = next(i for i, p in ids.items() if p == PROMPTS[1])
    assert done[bad].finish_reason == "error" and len(done[bad].token_ids) == 3
    assert "logits for its token at position 8 hold NaN (after 3 generated tokens)" in done[bad].error
    assert f"request {bad!r} ends with finish_reason='error'" in caplog.text
    for i, p in ids.items():
        if i != bad:
            assert done[i].finish_reason == "length" and done[i].error == ""
            if not sampled:
                assert done[i].token_ids == reference[tuple(p)]
    assert engine.cache.tables == {} and engine.cache.num_free_blocks == 14
    out = engine.generate(prompts, 12, sampling=params)  # generate: the tokens before the NaN, the others whole
    assert [len(o) for o in out] == [12, 3, 12] and out[1] == done[bad].token_ids


def test_lazy_capture_serves_at_once_and_captures_when_idle(reference):
    engine = make_engine(lazy_capture=True, step_capture_budget_s=0)  # only capture_idle captures
    steps: list[serve.StepInfo] = []
    with pb.expect(captures=0):
        first = engine.generate(PROMPTS, 12, on_step=steps.append)
    assert first == [reference[tuple(p)] for p in PROMPTS] and {s.mode for s in steps} == {M.NONE}
    captured = engine.capture_idle(60.0)
    assert captured and {mode for mode, _ in captured} <= {M.FULL, M.PIECEWISE}
    again: list[serve.StepInfo] = []
    assert engine.generate(PROMPTS, 12, on_step=again.append) == first
    assert M.FULL in {s.mode for s in again}


def test_no_graphs_and_no_capture_sizes_serve_whole_prompts(reference):
    config = pb.CompilationConfig(cudagraph_mode="NONE", capture_sizes=[])
    engine = serve.Engine(own.make_model(), config, kv_layout=own.KV_LAYOUT, vocab_size=own.VOCAB, max_model_len=32,
                          block_size=4, eos_token_id=reference[tuple(PROMPTS[2])][2])
    assert engine.max_num_batched_tokens == 32
    out = engine.generate(PROMPTS, 12)
    assert out[2] == reference[tuple(PROMPTS[2])][:3]  # the engine's eos_token_id is the default stop token
    assert engine.generate(PROMPTS[2:3], 12, eos_token_id=[]) == [reference[tuple(PROMPTS[2])]]


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_num_reqs=0), r"max_num_reqs must be a positive int \(requests a step runs at most\), got 0"),
    (dict(max_num_reqs=2.5), r"max_num_reqs must be a positive int .* got 2.5"),
    (dict(block_size=0), r"block_size must be a positive int \(tokens per KV block\), got 0"),
    (dict(num_blocks=0), r"num_blocks must be None .* or a positive int, got 0"),
    (dict(lazy_capture="yes"), r"lazy_capture must be a bool, got 'yes'"),
    (dict(max_num_batched_tokens=0), r"max_num_batched_tokens must be None or a positive int"),
    (dict(graph_memory_budget=-1), r"graph_memory_budget must be None or a number of bytes >= 0"),
    (dict(vocab_size=0), r"vocab_size must be a positive int"),
    (dict(eos_token_id=own.VOCAB), rf"eos_token_id {own.VOCAB} is outside the vocabulary"),
    (dict(attention_backend="nope"), r"unknown attention backend 'nope'"),
])
def test_the_constructor_names_each_bad_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_engine(**kwargs)


def test_the_constructor_refuses_what_is_not_a_served_model():
    config = pb.CompilationConfig(platform="simulated", compile_pieces="eager")
    args = dict(kv_layout=own.KV_LAYOUT, vocab_size=own.VOCAB)
    with pytest.raises(TypeError, match="already compiled"):
        serve.Engine(torch.compile(own.make_model()), config, **args)
    with pytest.raises(ValueError, match="has no parameters"):
        serve.Engine(torch.nn.Identity(), config, **args)
    with pytest.raises(TypeError, match=r"kv_layout must be a serve.KVLayout"):
        serve.Engine(own.make_model(), config, kv_layout=(2, 2, 8), vocab_size=own.VOCAB)
    with pytest.raises(ValueError, match=r"KVLayout.num_kv_heads must be an int >= 1, got 0"):
        serve.KVLayout(2, 0, 8)
    with pytest.raises(TypeError, match="config must be a piecewise_backend.CompilationConfig"):
        serve.Engine(own.make_model(), "FULL", **args)


def test_the_engine_arguments_come_as_keywords_or_as_one_engine_args():
    """``args=EngineArgs(...)`` is the keywords' dataclass (keywords beside it replace its fields); both are
    checked once, by the same messages; an unknown keyword is Python's TypeError; the signature lists the fields."""
    import inspect

    args = serve.EngineArgs(max_num_reqs=2, max_model_len=32, block_size=4, eos_token_id=[7, 9])
    assert args.eos_token_id == (7, 9)  # frozen: a list given is kept as a tuple
    config = pb.CompilationConfig(cudagraph_mode="NONE")
    engine = serve.Engine(own.make_model(), config, kv_layout=own.KV_LAYOUT, vocab_size=own.VOCAB, args=args,
                          num_blocks=5)
    assert engine.args == serve.EngineArgs(max_num_reqs=2, max_model_len=32, block_size=4, eos_token_id=(7, 9),
                                           num_blocks=5)
    assert (engine.max_num_reqs, engine.cache.max_model_len, engine.cache.total_blocks) == (2, 32, 5)
    assert engine.default_eos() == [7, 9] and engine.model_runners[0].runner is engine.runner
    with pytest.raises(ValueError, match=r"max_num_reqs must be a positive int \(requests a step runs at most\), got 0"):
        serve.EngineArgs(max_num_reqs=0)
    with pytest.raises(ValueError, match=r"eos_token_id must be an int, a list or tuple of ints .*got 2.5"):
        serve.EngineArgs(eos_token_id=2.5)
    with pytest.raises(ValueError, match=r"block_size must be a positive int \(tokens per KV block\), got 0"):
        make_engine(args=args, block_size=0)
    with pytest.raises(TypeError, match=r"Engine.__init__\(\) got an unexpected keyword argument 'max_num_seqs'"):
        make_engine(max_num_seqs=2)
    with pytest.raises(TypeError, match=r"args must be a serve.EngineArgs .*got dict"):
        make_engine(args=dict(max_num_reqs=2))
    names = [f.name for f in dataclasses.fields(serve.EngineArgs)]
    params = inspect.signature(serve.Engine).parameters
    assert all(params[n].default == getattr(serve.EngineArgs, n) for n in names) and list(params)[-1] == "args"


def test_add_request_checks_without_using_up_an_id(crowded):
    with pytest.raises(ValueError, match="request_id must be None, an int or another hashable that is not a bool"):
        crowded.add_request(PROMPTS[0], 2, request_id=True)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        crowded.add_request([own.VOCAB], 2)
    first = crowded.add_request(PROMPTS[0], np.int64(2))  # numpy ints are ints
    assert first == crowded.add_request(PROMPTS[1], 2) - 1
    assert [len(r.token_ids) for r in crowded.results()] == [2, 2]


@pytest.mark.cuda
def test_own_decoder_on_cuda(reference):
    engine = make_engine("cuda", num_blocks=14, max_num_batched_tokens=8)
    engine.capture()
    steps: list[serve.StepInfo] = []
    out = engine.generate(PROMPTS, 12, on_step=steps.append)
    assert out == [reference[tuple(p)] for p in PROMPTS]
    assert {s.mode for s in steps} == {M.FULL, M.PIECEWISE}


def test_a_lazy_engine_catches_up_under_continuous_traffic(reference):
    """No idle time, no capture_idle: each step may spend step_capture_budget_s capturing what traffic asked
    for, so a lazy engine ends up replaying graphs; tokens stay the full recompute's."""
    engine = make_engine(lazy_capture=True, step_capture_budget_s=5.0)  # generous: the simulator records every op
    assert make_engine(lazy_capture=True).step_capture_budget_s == 0.05  # the default with lazy_capture
    modes: list[pb.CUDAGraphMode] = []
    for _ in range(3):  # the same traffic three times, requests added while others run
        ids = [engine.add_request(p, 12) for p in PROMPTS[:2]]
        engine.step()
        modes.append(engine.runner.last_mode)
        ids += [engine.add_request(p, 12) for p in PROMPTS[2:]]
        done = {}
        while engine.has_unfinished_requests():
            done.update((r.request_id, r) for r in engine.step())
            modes.append(engine.runner.last_mode)
        done.update((r.request_id, r) for r in engine.step())
        assert [done[i].token_ids for i in ids] == [reference[tuple(p)] for p in PROMPTS]
    assert modes[0] == M.NONE and M.FULL in modes[len(modes) // 2:], modes
    assert engine.runner.lazy.captured  # captured inside steps


def test_step_capture_budget_is_checked():
    with pytest.raises(ValueError, match=r"step_capture_budget_s must be None .* got -1"):
        make_engine(lazy_capture=True, step_capture_budget_s=-1)
    assert make_engine().step_capture_budget_s == 0.0  # not lazy: steps never capture


def test_a_lazy_engine_serves_before_compiling_and_capture_idle_compiles_first(reference):
    """The first steps run the model uncompiled (no Dynamo graph reaches the backend); capture_idle compiles
    (one graph) and then captures; tokens equal the full recompute's before and after."""
    engine = make_engine(lazy_capture=True, step_capture_budget_s=0)
    assert engine.runner.needs_compile
    with pb.expect(graphs=0, captures=0):
        first = engine.generate(PROMPTS, 12)
    assert first == [reference[tuple(p)] for p in PROMPTS] and engine.runner.needs_compile
    engine.runner.lazy.compile_estimate_s = 30.0
    with pb.expect(graphs=0, captures=0):  # a compile predicted past the time given does not start
        assert engine.capture_idle(10.0) == []
    engine.runner.lazy.compile_estimate_s = None
    with pb.expect(graphs=1):
        captured = engine.capture_idle(60.0)
    assert captured and not engine.runner.needs_compile and engine.runner.lazy.compile_seconds > 0
    again: list[serve.StepInfo] = []
    with pb.expect(graphs=0):
        assert engine.generate(PROMPTS, 12, on_step=again.append) == first
    assert M.FULL in {s.mode for s in again}


def test_the_catch_up_accrues_its_budget_towards_the_compile(reference):
    """0.5 s a step and a compile predicted at 1.2 s: the first step makes the demand, the next two accrue
    1.0 s, the fourth (1.5 s accrued) compiles before it runs; tokens stay the full recompute's."""
    engine = make_engine(lazy_capture=True, step_capture_budget_s=0.5)
    engine.runner.lazy.compile_estimate_s = 1.2
    compiled_at, done = [], {}
    ids = [engine.add_request(p, 12) for p in PROMPTS]
    while engine.has_unfinished_requests():
        done.update((r.request_id, r.token_ids) for r in engine.step())
        compiled_at.append(not engine.runner.needs_compile)
    done.update((r.request_id, r.token_ids) for r in engine.step())
    assert compiled_at[:4] == [False, False, False, True], compiled_at
    assert [done[i] for i in ids] == [reference[tuple(p)] for p in PROMPTS]
