"""HFEngine's serving loop (serve/loop.py, serve/scheduler.py): chunked prefill, preemption, sampling,
streaming, the online API, lazy capture with idle-time capture, and a local checkpoint; simulated platform."""

from __future__ import annotations

import copy
import gc
import threading

import pytest
import torch

import piecewise_backend as pb
from piecewise_backend.capture.memory import fresh_pool
from piecewise_backend.platforms import get_platform

transformers = pytest.importorskip("transformers")
from piecewise_backend import hf

M = pb.CUDAGraphMode
SIZES = [1, 2, 4, 8]
CONFIG = pb.CompilationConfig(platform="simulated", compile_pieces="eager", capture_sizes=SIZES)
ENGINE = dict(max_num_reqs=3, max_model_len=32, block_size=4)
PROMPTS = [list(range(10, 13)), list(range(40, 51)), [77], list(range(90, 94))]
BUDGETS = [5, 2, 6, 3]
SAMPLED = hf.SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=1234)


@pytest.fixture(autouse=True)
def _cheap_gc(monkeypatch):
    monkeypatch.setattr(gc, "collect", lambda *a: 0)  # each capture collects once: seconds on a loaded machine


def reference_tokens(model: torch.nn.Module, prompt: list[int], new: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def reference():
    return hf.tiny_random_model("llama")  # HF's own attention; every engine's model has these weights


@pytest.fixture(scope="module")
def engine():
    """Captured up front (today's default)."""
    e = hf.HFEngine(hf.tiny_random_model("llama"), CONFIG, **ENGINE)
    e.capture()
    return e


@pytest.fixture(scope="module")
def lazy_engine():
    """Serves before any capture; the tests capture it in idle time as they go (no catch-up inside steps)."""
    return hf.HFEngine(hf.tiny_random_model("llama"), CONFIG, lazy_capture=True, step_capture_budget_s=0, **ENGINE)


# ------------------------------------------------------------------ chunked prefill


def test_a_prompt_longer_than_the_step_budget_is_prefilled_in_chunks_on_graphs(engine, reference):
    steps: list[hf.StepInfo] = []
    prompt = list(range(3, 24))  # 21 tokens, budget 8: three chunks
    with pb.expect(captures=0):
        out = engine.generate([prompt, [5, 6]], [4, 6], on_step=steps.append)
    assert max(s.num_tokens for s in steps) <= engine.max_num_batched_tokens == 8
    assert {s.mode for s in steps} == {M.PIECEWISE, M.FULL}  # no eager step: every chunk fits a graph
    assert [s.num_tokens for s in steps[:3]] == [8, 8, 7]  # [5, 6] and the chunks; then its decode token first
    assert out == [reference_tokens(reference, prompt, 4), reference_tokens(reference, [5, 6], 6)]
    with pytest.raises(ValueError, match="max_num_batched_tokens must be None or a positive int"):
        engine.max_num_batched_tokens = 0


# ------------------------------------------------------------------ streaming and sampling


def test_on_token_streams_every_token_in_order_as_it_is_produced(engine):
    seen: list[tuple[int, int]] = []
    steps: list[int] = []
    out = engine.generate(PROMPTS, BUDGETS, on_token=lambda i, t: seen.append((i, t)),
                          on_step=lambda info: steps.append(len(seen)))
    assert sorted(seen) == sorted((i, t) for i, o in enumerate(out) for t in o)
    assert [[t for i, t in seen if i == r] for r in range(len(out))] == out  # each request's tokens in order
    assert steps == sorted(steps) and steps[0] > 0 and steps[-1] == len(seen)  # delivered during the steps


def test_a_seed_gives_the_same_tokens_on_every_run_and_in_every_mode(engine, lazy_engine):
    """Graphs (PIECEWISE and FULL steps) and eager steps (a lazy engine before any capture) sample the same
    tokens from the same seeds; another seed gives other tokens; greedy rows beside sampled ones stay greedy."""
    mixed = [SAMPLED, None, hf.SamplingParams(1.5, seed=7), SAMPLED]
    first = engine.generate(PROMPTS, 6, sampling=mixed)
    assert engine.generate(PROMPTS, 6, sampling=mixed) == first
    steps: list[hf.StepInfo] = []
    assert lazy_engine.runner.lazy.captured == set()
    with pb.expect(captures=0):
        eager = lazy_engine.generate(PROMPTS, 6, sampling=mixed, on_step=steps.append)
    assert {s.mode for s in steps} == {M.NONE} and eager == first
    assert first[1] == engine.generate([PROMPTS[1]], 6)[0]  # sampling=None in the list: greedy
    other = engine.generate(PROMPTS, 6, sampling=hf.SamplingParams(0.8, top_k=40, top_p=0.9, seed=99))
    assert other != first
    with pytest.raises(ValueError, match="sampling has 2 entries for 4 prompts"):
        engine.generate(PROMPTS, 2, sampling=[SAMPLED, SAMPLED])


def test_unseeded_sampling_follows_torch_manual_seed(engine):
    torch.manual_seed(3)
    a = engine.generate(PROMPTS[:2], 5, sampling=hf.SamplingParams(1.0))
    torch.manual_seed(3)
    assert engine.generate(PROMPTS[:2], 5, sampling=hf.SamplingParams(1.0)) == a


# ------------------------------------------------------------------ the online API


def test_online_requests_join_while_others_run_and_cancel_frees_blocks_at_once(engine, reference):
    engine.reset_prefix_cache()  # the steps below are counted from whole prompts: none found cached
    first = engine.add_request(PROMPTS[0], 6)
    second = engine.add_request(PROMPTS[1], 4, request_id="b")
    assert (first, second) == (0, "b") and engine.has_unfinished_requests()
    assert engine.step() == [] and engine.step() == []  # two steps: both prompts prefilled, one decode
    late = engine.add_request(PROMPTS[3], 3)  # joins the next step
    engine.step()
    held = engine.cache.num_free_blocks
    assert engine.cancel_request("b") and "b" not in {r.request_id for r in engine._loop.scheduler.running}
    assert engine.cache.num_free_blocks > held  # its blocks are free before the next step
    assert not engine.cancel_request("b") and not engine.cancel_request("nope")
    results = {r.request_id: r for r in engine.results()}
    assert set(results) == {first, "b", late} and not engine.has_unfinished_requests()
    assert results["b"].finish_reason == "cancelled" and len(results["b"].token_ids) == 2
    assert results[first].token_ids == reference_tokens(reference, PROMPTS[0], 6)
    assert results[late].token_ids == reference_tokens(reference, PROMPTS[3], 3)
    assert results[late].finish_reason == "length" and results[late].prompt == PROMPTS[3]
    assert engine.cache.tables == {} and engine.cache.num_free_blocks == engine.cache.total_blocks  # free or evictable


def test_stop_token_ids_end_a_request_and_keep_the_stop_token(engine):
    full = engine.generate([PROMPTS[0]], 6)[0]
    stop = full[2]
    rid = engine.add_request(PROMPTS[0], 6, stop_token_ids=[stop])
    (result,) = list(engine.results())
    cut = full[: full.index(stop) + 1]
    assert result.request_id == rid and result.token_ids == cut and result.finish_reason == "stop"
    assert engine.generate([PROMPTS[0]], 6, eos_token_id=stop) == [cut]


def test_an_online_request_stops_at_the_models_eos_where_generate_does(engine, monkeypatch):
    """``stop_token_ids=None`` is ``generate``'s ``eos_token_id=None``: the model's generation_config.eos_token_id
    (an int or a list, as HF configs hold either); ``[]``: none; the same checks and errors."""
    full = engine.generate([PROMPTS[0]], 6, eos_token_id=[])[0]
    eos = [full[2], 255]
    monkeypatch.setattr(engine.model.generation_config, "eos_token_id", eos)
    stopped = engine.generate([PROMPTS[0]], 6)[0]
    assert len(stopped) < len(full) and stopped[-1] in eos and stopped == full[: len(stopped)]
    rid = engine.add_request(PROMPTS[0], 6)
    (result,) = list(engine.results())
    assert (result.request_id, result.token_ids, result.finish_reason) == (rid, stopped, "stop")
    engine.add_request(PROMPTS[0], 6, stop_token_ids=[])  # no stop token: as eos_token_id=[]
    (result,) = list(engine.results())
    assert (result.token_ids, result.finish_reason) == (full, "length")
    monkeypatch.setattr(engine.model.generation_config, "eos_token_id", full[2])  # an int
    engine.add_request(PROMPTS[0], 6)
    assert [r.token_ids for r in engine.results()] == engine.generate([PROMPTS[0]], 6)
    with pytest.raises(ValueError, match=r"stop_token_ids 256 is outside the vocabulary \(ids 0..255\)"):
        engine.add_request(PROMPTS[0], 6, stop_token_ids=[3, 256])
    with pytest.raises(ValueError, match=r"stop_token_ids must be an int, a list or tuple of ints \(\[\]: no stop token\)"):
        engine.add_request(PROMPTS[0], 6, stop_token_ids=[2.5])
    assert not engine.has_unfinished_requests()


def test_requests_added_from_callbacks_and_other_threads_are_served(engine):
    streamed: list[tuple[object, int]] = []

    def on_token(request_id, token):
        streamed.append((request_id, token))
        if request_id == "first" and len(streamed) == 1:
            engine.add_request(PROMPTS[2], 2, request_id="from-callback", on_token=on_token)

    engine.add_request(PROMPTS[0], 3, request_id="first", on_token=on_token)
    worker = threading.Thread(target=lambda: engine.add_request(PROMPTS[3], 2, request_id="from-thread"))
    worker.start()
    worker.join()
    done = {r.request_id: r.token_ids for r in engine.results()}
    assert set(done) == {"first", "from-callback", "from-thread"}
    assert [t for r, t in streamed if r == "from-callback"] == done["from-callback"]


def test_online_api_refuses_bad_requests_naming_them(engine):
    with pytest.raises(ValueError, match=r"request 'x': token id 256 is outside the vocabulary \(ids 0..255\)"):
        engine.add_request([1, 256], 2, request_id="x")
    with pytest.raises(ValueError, match=r"request \d+: 30 tokens \+ 5 new must be in 1..max_model_len=32"):
        engine.add_request([1] * 30, 5)
    with pytest.raises(TypeError, match="sampling must be a SamplingParams or None, got float"):
        engine.add_request([1], 2, sampling=0.5)
    # the checks generate makes (serve/arguments.py): a float id is refused, a 1-D tensor taken
    with pytest.raises(ValueError, match=r"request 'f': token id 5.5 \(float\) at position 1 is not an integer"):
        engine.add_request([1, 5.5], 2, request_id="f")
    with pytest.raises(TypeError, match=r"request 's' is text \('hi'\): generate takes token ids"):
        engine.add_request("hi", 2, request_id="s")
    engine.add_request([1, 2], 2, request_id="dup")
    with pytest.raises(ValueError, match="request id 'dup' is already running or waiting"):
        engine.add_request([3], 2, request_id="dup")
    with pytest.raises(RuntimeError, match=r"generate\(\) serves a batch of its own, but requests added with add_request"):
        engine.generate([[1]], 1)
    assert [r.request_id for r in engine.results()] == ["dup"]


# ------------------------------------------------------------------ preemption


@pytest.fixture(scope="module")
def small_cache_engine():
    """6 blocks of 4 tokens for 3 requests that need 3 blocks each: the newest gets preempted."""
    e = hf.HFEngine(hf.tiny_random_model("llama"), CONFIG, num_blocks=6, **ENGINE)
    e.capture()
    return e


def test_preempted_requests_are_recomputed_and_complete_with_their_own_tokens(small_cache_engine, reference):
    engine = small_cache_engine
    prompts = [list(range(20, 27)), list(range(60, 66)), list(range(100, 107))]
    steps: list[hf.StepInfo] = []
    out = engine.generate(prompts, 6, on_step=steps.append)
    assert any(s.preempted for s in steps) and engine._loop.scheduler.preemptions > 0
    assert out == [reference_tokens(reference, p, 6) for p in prompts]
    assert engine.cache.num_free_blocks == engine.cache.total_blocks  # free or evictable
    sampled = engine.generate(prompts, 6, sampling=SAMPLED, on_step=steps.append)
    alone = []
    for i, p in enumerate(prompts):  # one at a time (nothing to preempt), under the same request ids
        engine.add_request(p, 6, sampling=SAMPLED, request_id=i)
        alone += [r.token_ids for r in engine.results()]
    assert sampled == alone


def test_a_request_that_cannot_fit_even_alone_is_refused_before_anything_runs(small_cache_engine):
    engine = small_cache_engine
    with pytest.raises(ValueError, match=r"request 1: 20 prompt tokens \+ 8 new need 7 KV blocks of 4 tokens.*"
                                         r"the cache has 6 blocks in all"):
        engine.generate([[5, 6], list(range(3, 23))], 8)
    assert engine.cache.tables == {} and not engine.has_unfinished_requests()


# ------------------------------------------------------------------ lazy capture


def test_lazy_engine_serves_at_once_then_idle_time_captures_what_traffic_asked_for(lazy_engine, reference):
    engine = lazy_engine
    engine.runner.clear_graphs()
    steps: list[hf.StepInfo] = []
    with pb.expect(captures=0):  # no capture inside generate
        out = engine.generate(PROMPTS, BUDGETS, on_step=steps.append)
    assert {s.mode for s in steps} == {M.NONE}
    assert out == [reference_tokens(reference, p, n) for p, n in zip(PROMPTS, BUDGETS)]
    wanted = set(engine.runner.demand)
    captured = engine.capture_idle(120.0)
    assert set(captured) == wanted and engine.runner.demand == {}
    assert [d.num_tokens for _, d in captured] == sorted((d.num_tokens for _, d in captured), reverse=True)
    again: list[hf.StepInfo] = []
    with pb.expect(captures=0):
        assert engine.generate(PROMPTS, BUDGETS, on_step=again.append) == out
    assert {s.mode for s in again} == {M.PIECEWISE, M.FULL}  # the same traffic now replays graphs
    assert len(engine.backend.splits) == 1  # eager steps of every size and the captures: one Dynamo graph


def test_capture_idle_keeps_the_engine_within_graph_memory_budget(lazy_engine):
    engine = lazy_engine
    engine.runner.clear_graphs()
    engine.generate(PROMPTS, BUDGETS)
    platform = get_platform("simulated")
    with fresh_pool(platform):
        first = engine.capture_idle(120.0)[0]
        one = platform.memory()  # what the largest demanded capture cost
        engine.runner.clear_graphs()
    engine.runner.graph_memory_budget = budget = int(1.5 * one)
    try:
        engine.generate(PROMPTS, BUDGETS)
        with fresh_pool(platform):
            captured = engine.capture_idle(120.0)
            assert captured and platform.memory() <= budget and engine.runner.lazy.grown <= budget
            assert first not in captured or len(captured) < 3  # the budget left demand uncaptured
            assert engine.runner.demand  # what it left runs eagerly, and stays demand
            with pb.expect(captures=0):
                assert engine.generate(PROMPTS, BUDGETS) == engine.generate(PROMPTS, BUDGETS)
    finally:
        engine.runner.graph_memory_budget = None
        engine.runner.clear_graphs()


# ------------------------------------------------------------------ a local checkpoint


def test_from_pretrained_serves_a_local_save_pretrained_folder(tmp_path, reference):
    copy.deepcopy(reference).save_pretrained(tmp_path)
    engine = hf.HFEngine.from_pretrained(tmp_path, CONFIG, lazy_capture=True, dtype=torch.float32, **ENGINE)
    assert engine.cache.max_model_len == 32 and engine.runner.lazy_capture
    assert engine.generate([PROMPTS[0]], 4) == [reference_tokens(reference, PROMPTS[0], 4)]
    with pytest.raises(ValueError, match=r"is not a folder written by save_pretrained \(no config.json there\)"):
        hf.HFEngine.from_pretrained(tmp_path / "missing", CONFIG)


# ------------------------------------------------------------------ prefix caching


def test_prompts_sharing_a_prefix_reuse_its_blocks_and_match_generate(engine, reference):
    """A 12-token shared prefix (3 blocks): later requests start their prefill after it, tokens equal
    model.generate's and caching off's; every block free or evictable at the end."""
    engine.reset_prefix_cache()
    system = list(range(100, 112))
    prompts = [system + [5, 6], system + [7], system, system[:8] + [9, 9, 9]]
    first = engine.add_request(prompts[0], 4, stop_token_ids=[])
    done = {o.request_id: o for o in engine.results()}
    ids = [engine.add_request(p, 4, stop_token_ids=[]) for p in prompts[1:]]
    done.update({o.request_id: o for o in engine.results()})
    outs = [done[i] for i in [first, *ids]]
    assert [o.num_cached_tokens for o in outs] == [0, 12, 8, 8]  # the whole-prompt one recomputes its last block
    assert [o.token_ids for o in outs] == [reference_tokens(reference, p, 4) for p in prompts]
    off = hf.HFEngine(hf.tiny_random_model("llama"), CONFIG, enable_prefix_caching=False, **ENGINE)
    assert off.generate(prompts, 4, eos_token_id=[]) == [o.token_ids for o in outs]
    assert engine.cache.tables == {} and engine.cache.num_free_blocks == engine.cache.total_blocks


@pytest.mark.parametrize("arch", ["gemma3_text", "deepseek_v32"])  # sliding-window layers; indexed attention
def test_prefix_caching_with_sliding_windows_and_indexed_attention(arch):
    """A shared prefix longer than gemma3's sliding window (8), and deepseek_v32's indexer keys kept in the
    shared blocks: later requests reuse the prefix, tokens equal model.generate's."""
    reference = hf.tiny_random_model(arch)
    # served before any capture (lazy, no catch-up): what is shared is the cache, graphs or not
    engine = hf.HFEngine(copy.deepcopy(reference), CONFIG, lazy_capture=True, step_capture_budget_s=0, **ENGINE)
    system = list(range(100, 112))
    prompts = [system + [5, 6], system + [7, 8, 9]]
    first = engine.add_request(prompts[0], 4, stop_token_ids=[])
    done = {o.request_id: o for o in engine.results()}
    second = engine.add_request(prompts[1], 4, stop_token_ids=[])
    done.update({o.request_id: o for o in engine.results()})
    assert done[second].num_cached_tokens == 12
    assert [done[first].token_ids, done[second].token_ids] == [reference_tokens(reference, p, 4) for p in prompts]
