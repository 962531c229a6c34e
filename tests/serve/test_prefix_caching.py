"""Prefix caching in serve.Engine (examples/own_model.py's decoder, simulated platform): shared prompt blocks
reused, tokens equal to caching off and to a full recompute, under chunked prefill, eviction, preemption and
cancels; every block free (or evictable) at the end."""

from __future__ import annotations

import logging

import pytest

import piecewise_backend as pb
from pbtest.helpers import load_file, nudged
from piecewise_backend import serve

own = load_file("examples/own_model.py")
SYSTEM = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26]  # 12 tokens: 3 blocks of 4


def make_engine(**kw) -> serve.Engine:
    config = pb.CompilationConfig(cudagraph_mode=kw.pop("mode", "FULL_AND_PIECEWISE"), capture_sizes=[1, 2, 4, 8],
                                  platform="simulated", compile_pieces="eager")
    args = dict(kv_layout=own.KV_LAYOUT, vocab_size=own.VOCAB, max_num_reqs=4, max_model_len=40, block_size=4)
    return serve.Engine(own.make_model(), config, **{**args, **kw})


@pytest.fixture(scope="module")
def model():
    return own.make_model()


def expected(model, prompts, n):
    return [own.reference(model, p, n) for p in prompts]


def served(engine: serve.Engine, prompts, n) -> list[serve.RequestOutput]:
    ids = [engine.add_request(p, n, stop_token_ids=[]) for p in prompts]
    done = {o.request_id: o for o in engine.results()}
    return [done[i] for i in ids]


def assert_all_free(engine: serve.Engine) -> None:
    assert engine.cache.tables == {}
    assert engine.cache.num_free_blocks == engine.cache.total_blocks


def test_a_shared_system_prompt_is_computed_once_and_tokens_equal_caching_off(model):
    prompts = [SYSTEM + [7, 8], SYSTEM + [9], SYSTEM + [1, 2, 3, 4, 5]]
    on, off = make_engine(), make_engine(enable_prefix_caching=False)
    assert on.prefix_caching and not off.prefix_caching
    first = served(on, prompts[:1], 6)
    assert first[0].num_cached_tokens == 0
    before = pb.counters["prefix_cache_hits"]
    later = served(on, prompts[1:], 6)
    assert [o.num_cached_tokens for o in later] == [12, 12]
    assert pb.counters["prefix_cache_hits"] - before == 24
    tokens = [o.token_ids for o in first + later]
    assert tokens == [o.token_ids for o in served(off, prompts, 6)] == expected(model, prompts, 6)
    assert_all_free(on)
    assert on.cache.prefix.num_evictable > 0  # kept cached, counted free


def test_a_prompt_cached_whole_recomputes_its_last_block_and_an_exact_multiple_of_the_block_size(model):
    engine = make_engine()
    prompt = SYSTEM  # 12 tokens: an exact multiple of block_size 4
    a = served(engine, [prompt], 5)[0]
    b = served(engine, [prompt], 5)[0]
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 8)  # the last block is computed again (its logits)
    assert a.token_ids == b.token_ids == expected(model, [prompt], 5)[0]
    assert_all_free(engine)


def test_two_requests_with_the_same_prompt_in_the_same_step(model):
    engine = make_engine(max_num_batched_tokens=32)  # both prompts whole in the first step
    out = served(engine, [SYSTEM + [5], SYSTEM + [5]], 6)
    assert [o.num_cached_tokens for o in out] == [0, 0]  # neither was computed when both joined
    assert out[0].token_ids == out[1].token_ids == expected(model, [SYSTEM + [5]], 6)[0]
    assert engine.cache.prefix.num_cached == 3  # one block per key: the twin's blocks were freed
    assert_all_free(engine)
    assert served(engine, [SYSTEM + [6]], 2)[0].num_cached_tokens == 12


def test_chunked_prefill_and_lazy_capture_compose(model):
    engine = make_engine(max_num_batched_tokens=4, lazy_capture=True)
    prompts = [SYSTEM + [1, 2], SYSTEM + [3], SYSTEM[:8] + [4, 4, 4]]
    out = served(engine, prompts[:1], 4) + served(engine, prompts[1:], 4)
    assert [o.num_cached_tokens for o in out] == [0, 12, 8]
    assert [o.token_ids for o in out] == expected(model, prompts, 4)
    assert_all_free(engine)


def test_a_cancel_while_blocks_are_shared_leaves_the_other_request_exact(model):
    engine = make_engine()
    served(engine, [SYSTEM + [1]], 1)
    a = engine.add_request(SYSTEM + [2], 8, stop_token_ids=[])
    b = engine.add_request(SYSTEM + [3], 8, stop_token_ids=[])
    engine.step()
    slots = list(engine.cache.tables)
    assert engine.cache.tables[slots[0]][:3] == engine.cache.tables[slots[1]][:3]  # both hold the cached blocks
    assert engine.cancel_request(a)
    done = {o.request_id: o for o in engine.results()}
    assert done[a].finish_reason == "cancelled"
    assert done[b].token_ids == expected(model, [SYSTEM + [3]], 8)[0] and done[b].num_cached_tokens == 12
    assert_all_free(engine)


def test_eviction_and_preemption_under_pressure_keep_tokens_exact(model):
    # 12 blocks of 4 for 4 requests of up to 26 tokens: evictions of cached blocks and preemptions
    engine = make_engine(num_blocks=12, max_num_batched_tokens=8)
    prompts = [SYSTEM + [i, i + 1] for i in range(1, 5)] + [[9, 9, 9, 9, 8, 8, 8, 8, 7], SYSTEM + [60]]
    steps: list[serve.StepInfo] = []
    out = engine.generate(prompts, 12, eos_token_id=[], on_step=steps.append)
    assert sum(len(s.preempted) for s in steps) > 0
    assert out == expected(model, prompts, 12)
    assert_all_free(engine)
    other = [[50 + i, 51, 52, 53, 54, 55, 56, 57, 1] for i in range(4)]  # evicts the system prompt's blocks
    assert engine.generate(other, 10, eos_token_id=[]) == expected(model, other, 10)
    assert_all_free(engine)
    back = served(engine, [SYSTEM + [2]], 4)[0]  # its prefix evicted (or partly): served from what is cached
    assert back.token_ids == expected(model, [SYSTEM + [2]], 4)[0]
    assert_all_free(engine)


def test_reset_prefix_cache_drops_the_unreferenced_blocks(model):
    engine = make_engine()
    served(engine, [SYSTEM + [1]], 2)
    assert engine.reset_prefix_cache() == 3
    assert engine.cache.prefix.num_cached == 0 and engine.reset_prefix_cache() == 0
    assert served(engine, [SYSTEM + [1]], 2)[0].num_cached_tokens == 0
    assert_all_free(engine)


def test_an_engine_with_state_layers_serves_with_caching_off_said_once(caplog):
    from piecewise_backend.serve import engine as engine_module

    assert engine_module.prefix_caching_off(serve.EngineArgs(), None, 0) == ""
    assert "state layers" in engine_module.prefix_caching_off(serve.EngineArgs(), object(), 0)
    assert engine_module.prefix_caching_off(serve.EngineArgs(), None, 2) == ""  # speculative decoding composes
    with pytest.raises(ValueError, match="enable_prefix_caching must be a bool"):
        serve.EngineArgs(enable_prefix_caching=1)
    with caplog.at_level(logging.WARNING):
        make_engine(enable_prefix_caching=False)
    assert "prefix caching is off" not in caplog.text  # turned off by the caller: nothing to say


def test_micro_batching_composes_shared_blocks_are_only_read(model):
    config = pb.CompilationConfig(cudagraph_mode="FULL_AND_PIECEWISE", capture_sizes=[1, 2, 4, 8], platform="simulated",
                                  compile_pieces="eager", use_ubatching=True, dbo_decode_token_threshold=2,
                                  dbo_prefill_token_threshold=2)
    engine = serve.Engine(own.make_model(), config, kv_layout=own.KV_LAYOUT, vocab_size=own.VOCAB, max_num_reqs=4,
                          max_model_len=40, block_size=4, max_num_batched_tokens=32)
    prompts = [SYSTEM + [i] for i in range(1, 5)]
    engine.generate(prompts[:1], 3, eos_token_id=[])
    steps: list[serve.StepInfo] = []
    before = pb.counters["prefix_cache_hits"]
    assert engine.generate(prompts, 6, eos_token_id=[], on_step=steps.append) == expected(model, prompts, 6)
    assert pb.counters["prefix_cache_hits"] - before == 48 and steps[0].num_tokens == 4  # 4 requests, 1 token each
    assert_all_free(engine)


def salted(engine: serve.Engine, prompt, salt) -> serve.RequestOutput:
    rid = engine.add_request(prompt, 4, stop_token_ids=[], cache_salt=salt)
    return {o.request_id: o for o in engine.results()}[rid]


def test_a_cache_salt_shares_blocks_only_with_an_equal_salt(model):
    engine = make_engine()
    cached = [salted(engine, SYSTEM + [i], salt).num_cached_tokens
              for i, salt in enumerate([None, "tenant a", "tenant a", "tenant b", None, "", ""])]
    assert cached == [0, 0, 12, 0, 12, 0, 12]  # "" is a salt of its own, not None
    for i in range(3):
        assert salted(engine, SYSTEM + [i], "tenant a").token_ids == expected(model, [SYSTEM + [i]], 4)[0]
    before = pb.counters["prefix_cache_hits"]
    prompts = [SYSTEM + [1], SYSTEM + [2], SYSTEM + [3]]
    out = engine.generate(prompts, 4, eos_token_id=[], cache_salt=["tenant b", "tenant c", None])
    assert out == expected(model, prompts, 4)
    assert pb.counters["prefix_cache_hits"] - before == 24  # tenant b's and None's blocks were cached, c's were not
    before = pb.counters["prefix_cache_hits"]
    engine.generate(prompts, 2, eos_token_id=[], cache_salt="tenant c")  # one salt for all: c's first block is cached
    assert pb.counters["prefix_cache_hits"] - before == 36
    assert_all_free(engine)


def test_a_bad_cache_salt_is_refused_naming_it():
    engine = make_engine()
    with pytest.raises(ValueError, match=r"cache_salt must be a str or None .*got int 3"):
        engine.add_request(SYSTEM, 2, cache_salt=3)
    with pytest.raises(ValueError, match=r"cache_salt must be a str or None .*got bytes b'x'"):
        engine.add_request(SYSTEM, 2, cache_salt=b"x")
    with pytest.raises(ValueError, match=r"one per prompt \(a list or tuple of 2 strs or Nones\), got \['a'\]"):
        engine.generate([SYSTEM, SYSTEM], 2, cache_salt=["a"])
    with pytest.raises(ValueError, match=r"cache_salt\[1\] must be a str or None .*got int 5"):
        engine.generate([SYSTEM, SYSTEM], 2, cache_salt=[None, 5])
    assert not engine.has_unfinished() and engine.cache.tables == {}


def _worker_prefix_agreement(rank: int, mesh) -> dict:
    said = {}
    try:
        make_engine(enable_prefix_caching=rank == 0, mode="NONE")
        said["built"] = "built"
    except ValueError as e:
        said["built"] = str(e)
    engine = make_engine(mode="NONE")
    try:
        engine.generate([SYSTEM + [1]], 2, cache_salt=f"rank {rank}")
        said["salt"] = "served"
    except ValueError as e:
        said["salt"] = str(e)
    said["same"] = engine.generate([SYSTEM + [1]], 2, eos_token_id=[], cache_salt="t") == [own.reference(
        own.make_model(), SYSTEM + [1], 2)]
    return said


def test_ranks_disagreeing_on_prefix_caching_or_a_salt_are_refused_on_every_rank():
    from pbtest.dist_harness import oks, run_ranks

    for said in oks(run_ranks(_worker_prefix_agreement, timeout_s=240)):
        assert ("the ranks were given different prefix caching settings (rank 0: enable_prefix_caching=True (on: True), "
                "rank 1: enable_prefix_caching=False (on: False))") in said["built"]
        assert ("has a different cache_salt on each rank (rank 0: 'rank 0', rank 1: 'rank 1')") in said["salt"]
        assert said["same"]


def spec_engine(**kw) -> serve.SpeculativeEngine:
    config = pb.CompilationConfig(cudagraph_mode="FULL_AND_PIECEWISE", capture_sizes=[1, 2, 4, 8], platform="simulated",
                                  compile_pieces="eager")
    return serve.SpeculativeEngine(own.make_model(0), nudged(own.make_model(0), 0.3), config, num_speculative_tokens=3,
                                   target_layout=own.KV_LAYOUT, drafter_layout=own.KV_LAYOUT, vocab_size=own.VOCAB,
                                   max_num_reqs=3, max_model_len=40, block_size=4, **kw)


def test_speculative_decoding_reuses_shared_prefixes_in_both_caches_tokens_equal_caching_off():
    on, off = spec_engine(num_blocks=14, max_num_batched_tokens=12), spec_engine(enable_prefix_caching=False)
    assert on.prefix_caching and not off.prefix_caching
    prompts = [SYSTEM + [7, 8], SYSTEM + [9], SYSTEM[:8] + [1, 2, 3], SYSTEM]
    first = served(on, prompts[:1], 8)
    later = served(on, prompts[1:], 8)  # 3 requests in 14 blocks: evictions and preemptions too
    assert [o.num_cached_tokens for o in first + later] == [0, 12, 8, 8]
    assert 0 < on.stats.accepted < on.stats.proposed  # drafts rejected: both caches rolled back past shared blocks
    tokens = [o.token_ids for o in first + later]
    target = own.make_model(0)
    assert tokens == [o.token_ids for o in served(off, prompts, 8)] == [own.reference(target, p, 8) for p in prompts]
    for cache in (on.target.cache, on.drafter.cache):
        assert cache.tables == {} and cache.num_free_blocks == cache.total_blocks
        assert cache.prefix.num_cached > 0
    assert on.reset_prefix_cache() > 0 and on.target.cache.prefix.num_cached == on.drafter.cache.prefix.num_cached == 0


def test_the_drafters_shared_blocks_hold_its_own_kv_its_drafts_equal_caching_off():
    # tokens are the target's whatever the drafter proposes; its acceptance shows its cache read valid K/V
    on, off = spec_engine(max_num_batched_tokens=64), spec_engine(max_num_batched_tokens=64, enable_prefix_caching=False)
    prompts = [SYSTEM + [9], SYSTEM[:8] + [1, 2, 3], SYSTEM + [4, 4]]
    for engine in (on, off):
        engine.generate([SYSTEM + [7, 8]], 4, eos_token_id=[])
    hits = pb.counters["prefix_cache_hits"]
    assert on.generate(prompts, 9, eos_token_id=[]) == off.generate(prompts, 9, eos_token_id=[])
    assert pb.counters["prefix_cache_hits"] - hits == 32
    assert (on.stats.proposed, on.stats.accepted) == (off.stats.proposed, off.stats.accepted)
    assert 0 < on.stats.accepted < on.stats.proposed
