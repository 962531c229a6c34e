"""Speculative decoding (serve/speculative.py, hf/speculative.py) on the simulated platform, with CUDA twins of the graph-facing tests."""

from __future__ import annotations

import copy
import dataclasses
import re

import pytest
import torch

import piecewise_backend as pb
from piecewise_backend import attention
from piecewise_backend.attention import backends as attention_backends

pytest.importorskip("transformers")
from pbtest.helpers import CUDA, load_file  # noqa: E402

from piecewise_backend import hf, spec  # noqa: E402

M = pb.CUDAGraphMode
LAYERS = 2
PROMPTS = ((5, 7, 9, 200), (11, 3, 8, 21, 40, 60, 2, 9, 77, 4, 5), (12,), (30, 31, 32))


def make_engine(k: int, mode: str = "FULL", draft_layers: int = LAYERS, platform: str = "simulated", **kw):
    """A target of LAYERS layers and its drafter (the target itself at draft_layers == LAYERS)."""
    device = "cuda" if platform == "cuda" else "cpu"
    extra = dict(CUDA) if platform == "cuda" else dict(platform="simulated", compile_pieces="eager")
    config = pb.CompilationConfig(cudagraph_mode=mode, capture_sizes=[2, 4, 8, 16], **extra, **kw.pop("config", {}))
    target = hf.tiny_random_model("llama", num_hidden_layers=LAYERS, device=device)
    reference = copy.deepcopy(target)
    drafter = target if draft_layers == LAYERS else spec.truncated_drafter(target, draft_layers)
    engine = spec.SpecEngine(target, drafter, config, num_speculative_tokens=k, max_num_reqs=3, max_model_len=48,
                             block_size=4, **kw)
    return engine, reference


def greedy(reference: torch.nn.Module, prompt, n: int, eos: int | list[int] | None = None) -> list[int]:
    """``reference.generate`` greedy, stopping at ``eos`` (an int or a list) or only at ``n`` (None)."""
    device = next(reference.parameters()).device
    ids = torch.tensor([list(prompt)], device=device)
    with torch.no_grad():
        out = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                                 eos_token_id=eos, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def check_modes(engine: spec.SpecEngine, rounds: list[spec.RoundInfo], mode: str) -> None:
    """Verify steps replay FULL graphs keyed by k + 1 tokens per request; mixed steps run as the mode
    says; the drafter never runs FULL."""
    q = engine.k + 1
    for info in rounds:
        assert set(info.drafter_modes) <= {M.PIECEWISE, M.NONE} and len(info.drafter_modes) == engine.k, info
        if info.target_tokens > 16:
            assert info.target_mode == M.NONE, info
        elif info.verify_only:
            assert info.target_mode == M.FULL, info
            if mode == "FULL_AND_PIECEWISE":  # the uniform key: exact request count of k + 1 tokens each
                assert info.target_key.uniform and info.target_key.num_reqs * q == info.target_key.num_tokens, info
        else:
            assert info.target_mode == (M.FULL if mode == "FULL" else M.PIECEWISE), info
    assert any(i.verify_only and i.target_mode == M.FULL for i in rounds), rounds
    assert any(M.PIECEWISE in i.drafter_modes for i in rounds), rounds


def captured(k: int, mode: str, draft_layers: int = LAYERS, **kw):
    engine, reference = make_engine(k, mode, draft_layers, **kw)
    estimate = engine.estimate_capture_memory()
    engine.capture()
    return engine, reference, estimate


# Engines are shared by the tests of this module: each costs two Dynamo traces.
@pytest.fixture(scope="module", params=[(1, "FULL_AND_PIECEWISE"), (4, "FULL")], ids=["k1-F&P", "k4-FULL"])
def self_draft(request):
    return captured(*request.param)


@pytest.fixture(scope="module")
def partial():
    """k=2, a 1-layer drafter of the 2-layer target, target FULL, stale outputs poisoned (debug_checks)."""
    return captured(2, "FULL", draft_layers=1, config=dict(debug_checks=True))


def test_target_as_its_own_drafter_accepts_every_draft(self_draft):
    engine, reference, _ = self_draft
    k, mode = engine.k, engine.target.runner.mode.name
    budgets = [7, 3, 10, 5]
    rounds: list[spec.RoundInfo] = []
    with pb.expect(captures=0):  # both runners captured every key up front
        outputs = engine.generate(PROMPTS, budgets, on_round=rounds.append)
    assert outputs == [greedy(reference, p, n) for p, n in zip(PROMPTS, budgets)]
    s = engine.stats
    assert s.accepted == s.proposed > 0 and s.acceptance_rate == 1.0
    assert all(a == k for i in rounds for a in i.accepted)
    assert s.tokens_per_target_step > 1 and s.emitted == sum(budgets)
    check_modes(engine, rounds, mode)
    for side in (engine.target, engine.drafter):
        assert side.cache.tables == {} and side.cache.num_free_blocks == side.cache.total_blocks  # cached blocks count free


@pytest.mark.parametrize("self_draft", [(4, "FULL")], ids=["k4-FULL"], indirect=True)
def test_requests_finish_mid_run_at_eos_or_budget(self_draft):
    """k=4, every draft accepted (5 tokens a round): an eos inside an accepted run and a budget
    reached mid-run cut the run there; other requests keep going."""
    engine, reference, _ = self_draft
    assert engine.k == 4
    budgets = [12, 12, 7, 9]
    free = [greedy(reference, p, n) for p, n in zip(PROMPTS, budgets)]
    # eos: a token some request first emits at its 2nd..4th token, inside its first run of 5
    eos = next(out[i] for out in free for i in range(1, 4) if out[i] not in out[:i])
    expected = [greedy(reference, p, n, eos) for p, n in zip(PROMPTS, budgets)]
    at_eos = {r for r, out in enumerate(expected) if out[-1] == eos and len(out) % 5}
    at_budget = {r for r, out in enumerate(expected) if out[-1] != eos and len(out) % 5}
    assert at_eos and at_budget, expected  # both kinds of mid-run stop happen
    rounds: list[spec.RoundInfo] = []
    outputs = engine.generate(PROMPTS, budgets, eos_token_id=eos, on_round=rounds.append)
    assert outputs == expected
    cut = {info.requests[i] for info in rounds for i, e in enumerate(info.emitted) if e < info.accepted[i] + 1}
    assert cut == at_eos | at_budget and all(a == 4 for i in rounds for a in i.accepted), rounds
    finished = {r: next(i.round for i in reversed(rounds) if r in i.requests) for r in range(4)}
    assert len(set(finished.values())) > 1, finished  # they finished at different rounds


@pytest.mark.parametrize("self_draft", [(4, "FULL")], ids=["k4-FULL"], indirect=True)
def test_eos_as_a_list_and_the_models_own_eos_stop_as_generate_does(self_draft):
    """A list of stop tokens (any of them stops a request, inside an accepted run too), and without
    ``eos_token_id`` the target's ``generation_config.eos_token_id``, as ``model.generate``."""
    engine, reference, _ = self_draft
    budgets = [12, 12, 7, 9]
    free = engine.generate(PROMPTS, budgets, eos_token_id=[])  # []: no stop token
    assert free == [greedy(reference, p, n) for p, n in zip(PROMPTS, budgets)]
    eos = [next(o[i] for i in range(j, len(o)) if o[i] not in o[:i]) for o, j in ((free[0], 2), (free[1], 3))]
    expected = [greedy(reference, p, n, eos) for p, n in zip(PROMPTS, budgets)]
    assert sum(len(o) for o in expected) < sum(budgets), expected
    assert engine.generate(PROMPTS, budgets, eos_token_id=eos) == expected
    target = engine.target_model
    saved = target.generation_config.eos_token_id, reference.generation_config.eos_token_id
    try:
        target.generation_config.eos_token_id = reference.generation_config.eos_token_id = eos
        ids = [torch.tensor([list(p)]) for p in PROMPTS]
        with torch.no_grad():  # generate without eos_token_id: the model's own
            expected = [reference.generate(i, attention_mask=torch.ones_like(i), do_sample=False, max_new_tokens=n,
                                           pad_token_id=0)[0, i.shape[1]:].tolist() for i, n in zip(ids, budgets)]
        assert engine.generate(PROMPTS, budgets) == expected
    finally:
        target.generation_config.eos_token_id, reference.generation_config.eos_token_id = saved
    with pytest.raises(ValueError, match=r"eos_token_id must be an int, a list or tuple of ints .*got 2.5"):
        engine.generate(PROMPTS, budgets, eos_token_id=2.5)


def test_a_failed_round_frees_both_caches(self_draft):
    engine, reference, _ = self_draft

    def stop(info: spec.RoundInfo) -> None:
        assert engine.cached_tokens()  # requests are running, with valid K/V in both caches
        if info.round == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        engine.generate(PROMPTS, 12, on_round=stop)
    assert engine.cached_tokens() == {}
    for side in (engine.target, engine.drafter):
        assert side.cache.tables == {} and side.cache.num_free_blocks == side.cache.total_blocks  # cached blocks count free
    assert engine.generate(PROMPTS[:1], 3) == [greedy(reference, PROMPTS[0], 3)]  # still serves


def test_partial_acceptance_rolls_back_both_caches_and_matches_generate(partial):
    """A 1-layer drafter of the 2-layer target: drafts get rejected, both caches roll back every
    round, and no valid K/V slot of any request ever changes afterwards."""
    engine, reference, _ = partial
    assert_rollback_exact(engine, reference, [9, 6, 12, 8])


def assert_rollback_exact(engine: spec.SpecEngine, reference: torch.nn.Module, budgets: list[int]) -> None:
    k = engine.k
    seen: dict[tuple[str, int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (side, request, position) -> K, V

    def snapshot(info: spec.RoundInfo) -> None:
        for r, lens in engine.cached_tokens().items():
            for name, side, valid in (("target", engine.target, lens[0]), ("drafter", engine.drafter, lens[1])):
                cache = side.cache
                assert len(cache.tables[r]) == -(-valid // cache.block_size)  # no block held past the valid tokens
                for p in range(valid):
                    slot = cache.slot(r, p)
                    now = tuple(torch.stack([c.flatten(0, 1)[slot] for c in caches])
                                for caches in (cache.key_caches, cache.value_caches))
                    old = seen.setdefault((name, r, p), now)
                    assert all(torch.equal(a, b) for a, b in zip(old, now)), (name, r, p, info.round)

    rounds: list[spec.RoundInfo] = []
    outputs = engine.generate(PROMPTS, budgets, on_round=lambda i: (rounds.append(i), snapshot(i)))
    assert outputs == [greedy(reference, p, n) for p, n in zip(PROMPTS, budgets)]
    accepted = [a for i in rounds for a in i.accepted]
    assert min(accepted) < k, accepted  # some drafts rejected: rollback ran
    assert 0 < engine.stats.acceptance_rate < 1
    assert len(seen) > 0
    check_modes(engine, rounds, engine.target.runner.mode.name)


def test_drafter_and_target_share_the_pool_without_reading_stale_outputs(partial):
    """With debug_checks, every replay poisons (NaN) the outputs of every other graph in the pool:
    the engine reads each step's logits before the other model replays, so tokens stay exact."""
    engine, reference, _ = partial
    assert engine.target.runner.config.debug_checks and engine.drafter.runner.config.debug_checks
    outputs = engine.generate(PROMPTS, [6, 4, 8, 5])
    assert outputs == [greedy(reference, p, n) for p, n in zip(PROMPTS, [6, 4, 8, 5])]
    # the control: a target output held across a drafter replay is poisoned, so a stale read would show
    t, d = engine.target, engine.drafter
    with torch.inference_mode():
        ids = torch.tensor([5, 6, 7, 8, 9, 10])
        logits = t.runner.run(uniform_decode=True, num_reqs=2, input_ids=ids, **t.cache.step_inputs([("a", 0, 3), ("b", 0, 3)]))
        assert t.runner.last_mode == M.FULL and not logits.isnan().any()
        d.runner.run(input_ids=ids[:4], **d.cache.step_inputs([("a", 0, 2), ("b", 0, 2)]))
        assert d.runner.last_mode == M.PIECEWISE
        assert logits.isnan().all()
        for side in (t, d):
            for r in ("a", "b"):
                side.cache.free(r)


def test_capture_covers_both_runners(partial):
    engine, _, estimate = partial
    report = engine.capture_report
    t, d = engine.target_report, engine.drafter_report
    assert report.graphs == t.graphs + d.graphs and d.graphs > 0 and t.graphs > 0
    # pool bytes added depend on what earlier graphs left free in the process-wide pool; the estimate,
    # measured in a scratch pool, bounds them
    assert report.memory_bytes == t.memory_bytes + d.memory_bytes and 0 < report.memory_bytes + estimate
    assert report.memory_bytes <= estimate
    assert "target:" in report.stats and "drafter:" in report.stats
    # the drafter holds only the breakable wrapper, and its dispatcher plans PIECEWISE keys only
    assert type(engine.drafter.runner.model) is pb.BreakableCUDAGraphWrapper
    assert {mode for mode, _ in engine.drafter.runner.dispatcher.capture_descriptors()} == {M.PIECEWISE}
    assert type(engine.target.runner.model) is pb.CUDAGraphWrapper


def test_late_upgrade_full_to_full_and_piecewise_serves_every_key():
    """A target asked for FULL whose attention supports only uniform batches resolves to
    FULL_AND_PIECEWISE after the FULL wrapper stack was planned: the breakable wrapper is there for
    the mixed steps, and every dispatched key replays a graph captured up front."""
    k = 4
    compiled = torch.compile(hf.adapt(hf.tiny_random_model("llama")), backend=pb.make_backend(pb.CompilationConfig(compile_pieces="eager")))
    full = pb.CompilationConfig(cudagraph_mode="FULL", platform="simulated", compile_pieces="eager", capture_sizes=[5, 10])
    wrapped = pb.wrap_model(compiled, full)  # installed for FULL
    dispatcher = pb.CudagraphDispatcher(full)
    dispatcher.initialize_keys(M.FULL_AND_PIECEWISE, uniform_decode_query_len=k + 1)  # resolved later
    pb.validate_capture_coverage(wrapped, dispatcher)
    engine, reference, _ = captured(k, "FULL", draft_layers=1, target_attention_support=pb.AttentionGraphSupport.UNIFORM_BATCH)
    assert engine.target.runner.mode == M.FULL_AND_PIECEWISE
    # every verify size r * (k + 1) has an exact FULL key
    full = engine.target.runner.dispatcher.keys[M.FULL]
    assert {pb.BatchDescriptor((k + 1) * r, num_reqs=r, uniform=True) for r in (1, 2, 3)} <= full
    with pb.expect(captures=0):
        assert_rollback_exact(engine, reference, [5, 4, 6, 3])


@pytest.mark.parametrize("mode", ["FULL", "NONE"])
def test_micro_batched_target_matches_generate(mode):
    """Verify steps of 3 requests (max_num_reqs) split 1 + 2: the second half's requests read their own
    block tables (before: an IndexError, or another request's keys with spare request rows)."""
    engine, reference, _ = captured(2, mode, draft_layers=1,
                                    config=dict(use_ubatching=True, dbo_decode_token_threshold=2))
    prompts, budgets = PROMPTS[:3], [6, 4, 7]
    rounds: list[spec.RoundInfo] = []
    split: list[bool] = []
    outputs = engine.generate(prompts, budgets, on_round=lambda r: (rounds.append(r), split.append(
        engine.target.runner.last_ubatched)))
    assert outputs == [greedy(reference, p, n) for p, n in zip(prompts, budgets)]
    full_split = [r for r, u in zip(rounds, split) if u and len(r.requests) == 3 and r.verify_only]
    assert full_split and all(r.target_mode == pb.CUDAGraphMode[mode] for r in full_split), list(zip(rounds, split))


def test_engine_rejects_bad_arguments():
    target = hf.tiny_random_model("llama", num_hidden_layers=2)
    config = pb.CompilationConfig(platform="simulated", compile_pieces="eager", capture_sizes=[2, 4])
    with pytest.raises(ValueError, match="num_speculative_tokens must be a positive int, got 0"):
        spec.SpecEngine(target, target, config, num_speculative_tokens=0)
    with pytest.raises(ValueError, match=r"drafter's vocabulary \(128 tokens\) must be the target's \(256\)"):
        spec.SpecEngine(target, hf.tiny_random_model("llama", vocab_size=128), config, num_speculative_tokens=1)
    with pytest.raises(ValueError, match="max_model_len=512 exceeds LlamaForCausalLM's max_position_embeddings=256"):
        spec.SpecEngine(target, target, config, num_speculative_tokens=1, max_model_len=512)
    with pytest.raises(ValueError, match=r"num_layers must be an int in 1..2 \(the target's layer count\), got 3"):
        spec.truncated_drafter(target, 3)
    engine = spec.SpecEngine(target, target, config, num_speculative_tokens=3, max_model_len=16, block_size=4)
    with pytest.raises(ValueError, match=r"prompt 0: 10 tokens \+ 5 new \+ 2 \(speculative tokens - 1\) must be in 1..max_model_len=16"):
        engine.generate([[1] * 10], 5)
    with pytest.raises(ValueError, match="max_new_tokens must be a positive int or one per prompt"):
        engine.generate([[1], [2]], [3])
    # the checks HFEngine makes too (one validator: serve/arguments.py)
    with pytest.raises(ValueError, match=r"prompt 1: token id 256 is outside the vocabulary \(ids 0..255\)"):
        engine.generate([[3], [4, 256]], 2)
    for bad, shown in ((2.5, "2.5"), (None, "None"), (True, "True")):
        with pytest.raises(ValueError, match=rf"max_new_tokens must be a positive int or one per prompt .*got {shown}$"):
            engine.generate([[1]], bad)
    with pytest.raises(ValueError, match=r"max_new_tokens\[0\] must be a positive int \(tokens to generate\), got 2.5"):
        engine.generate([[1]], [2.5])
    with pytest.raises(ValueError, match=r"prompt 0: token id 5.5 \(float\) at position 0 is not an integer"):
        engine.generate([[5.5, 6.9]], 2)
    assert engine.target.cache.tables == {} and engine.drafter.cache.tables == {}


def test_a_target_without_a_position_limit_is_served_as_hfengine_serves_it():
    """xlnet's ``max_position_embeddings=-1`` means no limit: HFEngine's check (``check_hf_model``) skips it,
    and SpecEngine shares that check (it refused the model with a check of its own before)."""
    target = hf.tiny_random_model("llama", num_hidden_layers=2)
    target.config.max_position_embeddings = -1  # as xlnet's config has it
    reference = copy.deepcopy(target)
    config = pb.CompilationConfig(platform="simulated", compile_pieces="eager", capture_sizes=[2, 4])
    drafter = spec.truncated_drafter(target, 1)
    engine = spec.SpecEngine(target, drafter, config, num_speculative_tokens=2, max_num_reqs=2, max_model_len=512,
                             block_size=16)
    assert engine.generate(PROMPTS[:2], 4, eos_token_id=[]) == [greedy(reference, p, 4, eos=[]) for p in PROMPTS[:2]]
    hf.HFEngine(copy.deepcopy(reference), config, max_num_reqs=2, max_model_len=512, block_size=16)  # accepted too
    limited = hf.tiny_random_model("llama", num_hidden_layers=1)  # 256 positions: still refused past them
    with pytest.raises(ValueError, match=r"max_model_len=512 exceeds LlamaForCausalLM's max_position_embeddings=256: "
                                         r"use max_model_len <= 256"):
        spec.SpecEngine(target, limited, config, num_speculative_tokens=2, max_model_len=512)


def test_the_hf_models_keep_their_own_names_beside_the_model_runners():
    """``.target_model`` / ``.drafter_model``: the HF models given; the runners keep the adapted models they compiled."""
    target = hf.tiny_random_model("llama", num_hidden_layers=2)
    drafter = spec.truncated_drafter(target, 1)
    config = pb.CompilationConfig(platform="simulated", compile_pieces="eager", capture_sizes=[2, 4])
    engine = spec.SpecEngine(target, drafter, config, num_speculative_tokens=2, max_model_len=32, block_size=4)
    assert engine.target_model is target and engine.drafter_model is drafter
    assert isinstance(engine.target.model, hf.TokensFirst) and engine.target.model.model is target
    assert isinstance(engine.drafter.model, hf.TokensFirst) and engine.drafter.model.model is drafter
    assert engine.model_runners == [engine.target, engine.drafter] and engine.runner is engine.target.runner
    with pytest.raises(TypeError, match=r"SpecEngine.__init__\(\) got an unexpected keyword argument 'eos_token_id'"):
        spec.SpecEngine(target, drafter, config, num_speculative_tokens=2, eos_token_id=3)


#: The library's backends that serve a float32 CPU cache (the attention backends of docs/compatibility.md).
CPU_BACKENDS = sorted(n for n, b in attention.attention_backends().items()
                      if b.available(torch.device("cpu"), 4, torch.float32) is None)


@pytest.mark.parametrize("name", ["auto", *CPU_BACKENDS])
def test_attention_backend_serves_both_caches_and_matches_generate(name, monkeypatch):
    """``attention_backend`` as HFEngine's: both caches run it (the op calls it for each), the engine
    reports it, and the tokens are the target's greedy ones (partial acceptance: both caches roll back)."""
    assert {"bounded", "reference"} <= set(CPU_BACKENDS)
    used = "bounded" if name == "auto" else name
    calls: list[int] = []
    original = attention_backends.get_attention_backend(used)

    def spy(q, key_cache, *args, **kwargs):
        calls.append(key_cache.data_ptr())
        return original.fn(q, key_cache, *args, **kwargs)

    monkeypatch.setitem(attention_backends._BACKENDS, used, dataclasses.replace(original, fn=spy))
    engine, reference, _ = captured(2, "FULL_AND_PIECEWISE", draft_layers=1, attention_backend=name)
    assert engine.attention_backend == engine.target.cache.attention_backend == engine.drafter.cache.attention_backend == used
    assert engine.target.runner.attention_backend == engine.drafter.runner.attention_backend == used
    calls.clear()
    outputs = engine.generate(PROMPTS, 6, eos_token_id=[])
    assert outputs == [greedy(reference, p, 6) for p in PROMPTS]
    assert engine.stats.accepted < engine.stats.proposed  # rejected drafts: both caches rolled back
    caches = {side: {c.data_ptr() for c in getattr(engine, side).cache.key_caches} for side in ("target", "drafter")}
    assert caches["target"] & set(calls) and caches["drafter"] & set(calls), "each cache's attention ran the backend"


def test_a_bad_attention_backend_is_refused_naming_the_valid_ones_before_either_model_is_touched():
    target = hf.tiny_random_model("llama", num_hidden_layers=2)
    drafter = spec.truncated_drafter(target, 1)
    config = pb.CompilationConfig(platform="simulated", compile_pieces="eager", capture_sizes=[2, 4])
    valid = re.escape(str(["auto", *CPU_BACKENDS]))
    cases = [
        ("flash", ValueError, rf"unknown attention backend 'flash': attention_backend is one of {valid} for this cache"),
        ("varlen", ValueError, rf"attention backend 'varlen' cannot serve a torch.float32 cache on cpu with "
                               rf"block_size=16: .*; valid for this cache: {valid}"),
        (None, TypeError, rf"attention_backend must be a backend's name, one of {valid} for this cache, got NoneType None"),
    ]
    for bad, error, message in cases:
        for make in (lambda: spec.SpecEngine(target, drafter, config, num_speculative_tokens=2, attention_backend=bad),
                     lambda: hf.HFEngine(target, config, attention_backend=bad)):  # one validator, one message
            with pytest.raises(error, match=message):
                make()
    # refused before adapt: both models keep their own attention
    assert target.config._attn_implementation != hf.ATTN_IMPLEMENTATION != drafter.config._attn_implementation


def test_spec_engine_streams_kept_tokens_samples_with_a_seed_and_preempts_when_blocks_run_out():
    """SpecEngine streams; samples (a seed reproduces the tokens); a batch that runs out of KV blocks is
    preempted and recomputed, as HFEngine's, and still matches generate."""
    target = hf.tiny_random_model("llama", num_hidden_layers=2)
    reference = copy.deepcopy(target)
    config = pb.CompilationConfig(cudagraph_mode="NONE", platform="simulated", compile_pieces="eager", capture_sizes=[2, 4])
    engine = spec.SpecEngine(target, target, config, num_speculative_tokens=2, max_model_len=32, block_size=4, num_blocks=8,
                             max_num_batched_tokens=32)
    sampled = [engine.generate([[1, 2]], 6, sampling=hf.SamplingParams(0.7, seed=3), eos_token_id=[]) for _ in range(2)]
    assert sampled[0] == sampled[1] and len(sampled[0][0]) == 6
    crowded = [[1 + i] * 9 for i in range(3)]  # 3 x 4 blocks of K/V (drafts included) in a cache of 8
    steps: list = []
    out = engine.generate(crowded, 4, eos_token_id=[], on_step=steps.append)
    assert out == [greedy(reference, p, 4) for p in crowded]
    assert any(info.preempted for info in steps), steps
    assert engine.target.cache.tables == {} and engine.drafter.cache.num_free_blocks == 8
    seen: list[tuple[int, int]] = []
    out = engine.generate(PROMPTS[:2], 5, sampling=hf.SamplingParams(0), on_token=lambda i, t: seen.append((i, t)))
    assert out == [greedy(reference, p, 5) for p in PROMPTS[:2]]
    assert [[t for i, t in seen if i == r] for r in range(2)] == out


def test_truncated_drafter_shares_the_targets_first_layers():
    target = hf.tiny_random_model("qwen2", num_hidden_layers=3)
    draft = spec.truncated_drafter(target, 1)
    assert draft.config.num_hidden_layers == 1 and target.config.num_hidden_layers == 3
    t, d = target.state_dict(), draft.state_dict()
    assert set(d) < set(t) and all(torch.equal(d[n], t[n]) for n in d)


@pytest.mark.cuda
@pytest.mark.parametrize("k, mode", [(2, "FULL"), (4, "FULL_AND_PIECEWISE")])
def test_self_draft_on_cuda(k, mode):
    """The twin of the 100 % acceptance test on real CUDA graphs (Inductor pieces)."""
    engine, reference = make_engine(k, mode, platform="cuda")
    engine.capture()
    rounds: list[spec.RoundInfo] = []
    outputs = engine.generate(PROMPTS, [7, 3, 10, 5], on_round=rounds.append)
    assert outputs == [greedy(reference, p, n) for p, n in zip(PROMPTS, [7, 3, 10, 5])]
    assert engine.stats.acceptance_rate == 1.0
    check_modes(engine, rounds, mode)


@pytest.mark.cuda
def test_partial_acceptance_with_debug_checks_on_cuda():
    """The twin of the rollback and pool-sharing tests: one CUDA pool, stale outputs poisoned."""
    engine, reference = make_engine(2, "FULL_AND_PIECEWISE", draft_layers=1, platform="cuda", config=dict(debug_checks=True))
    engine.capture()
    outputs = engine.generate(PROMPTS, [9, 6, 12, 8])
    assert outputs == [greedy(reference, p, n) for p, n in zip(PROMPTS, [9, 6, 12, 8])]
    assert 0 < engine.stats.acceptance_rate < 1


def _spec_decode_example():
    return load_file("examples/spec_decode.py")


@pytest.mark.parametrize("arch", ["gpt_bigcode", "deepseek_v2", "deepseek_v3", "minicpm3"])
def test_spec_engine_sizes_its_caches_from_the_attention_modules(arch):
    """Multi-query (gpt_bigcode: the config says 2 KV heads, its attention has 1) and MLA
    (deepseek_v2/v3, minicpm3: K/V head dim 24, not the config's 8): both caches have HFEngine's
    layout, the one the probe of the attention modules reads, not the one computed from the config."""
    target = hf.tiny_random_model(arch, num_hidden_layers=LAYERS)
    probed = hf.kv_shape(target)
    assert probed != hf.kv_shape(target.config)  # the config would size the cache wrongly
    config = pb.CompilationConfig(platform="simulated", compile_pieces="eager", capture_sizes=[2, 4])
    engine = spec.SpecEngine(target, spec.truncated_drafter(target, 1), config, num_speculative_tokens=2,
                             max_model_len=16, block_size=4)
    for side, layers in ((engine.target, LAYERS), (engine.drafter, 1)):
        caches = side.cache.key_caches
        assert (len(caches), *caches[0].shape[2:]) == (layers, *probed[1:])


@pytest.mark.parametrize("arch", ["gpt_bigcode", "minicpm3"])
def test_spec_decode_example_checks_multi_query_and_mla_models(arch, capsys):
    """``examples/spec_decode.py --arch NAME --num-speculative-tokens 2 --check``, in this process
    (deepseek_v2 and deepseek_v3 pass it too; 15 and 29 s here, so the suite runs one MLA model)."""
    assert _spec_decode_example().main(["--arch", arch, "--num-speculative-tokens", "2", "--check"]) == 0
    assert "check: 5/5 requests match model.generate token for token" in capsys.readouterr().out


def test_spec_engine_online_with_chunked_prefill_cancel_and_lazy_capture():
    """The loop's features on SpecEngine: add/cancel while others run, an 11-token prompt prefilled in
    chunks of an 8-token budget (drafts count), serving before any capture and any compile, capture_idle
    compiling both models, then capturing."""
    engine, reference = make_engine(2, "FULL_AND_PIECEWISE", draft_layers=1, lazy_capture=True, max_num_batched_tokens=8,
                                    step_capture_budget_s=0)
    ids = [engine.add_request(p, 6) for p in PROMPTS[:2]]
    steps = [engine.step() for _ in range(2)]
    assert engine.cancel_request(ids[0]) and engine.last_round is not None
    late = engine.add_request(PROMPTS[3], 6, request_id="late")
    done = {r.request_id: r for out in steps for r in out}
    done.update((r.request_id, r) for r in engine.results())
    assert done[ids[0]].finish_reason == "cancelled"
    assert done[ids[1]].token_ids == greedy(reference, PROMPTS[1], 6) and done[late].token_ids == greedy(reference, PROMPTS[3], 6)
    rounds: list[spec.RoundInfo] = []
    first = engine.generate(PROMPTS, 6, on_round=rounds.append)
    assert first == [greedy(reference, p, 6) for p in PROMPTS]
    assert {r.target_mode for r in rounds} == {M.NONE} and max(r.target_tokens for r in rounds) <= 8
    assert engine.target.runner.needs_compile and engine.drafter.runner.needs_compile  # served uncompiled so far
    with pb.expect(graphs=2):  # capture_idle compiles both models (one Dynamo graph each), then captures
        assert engine.capture_idle(120.0)
    assert not engine.target.runner.needs_compile and not engine.drafter.runner.needs_compile
    rounds.clear()
    assert engine.generate(PROMPTS, 6, on_round=rounds.append) == first
    assert any(r.verify_only and r.target_mode == M.FULL for r in rounds), rounds
    assert engine.cached_tokens() == {} and engine.target.cache.tables == {} == engine.drafter.cache.tables


def test_spec_decode_example_samples_and_serves_a_state_layer_model(capsys):
    example = load_file("examples/spec_decode.py")
    assert example.main(["--arch", "qwen3_next", "--num-speculative-tokens", "2", "--draft-layers", "1", "--check",
                         "--sample"]) == 0
    out = capsys.readouterr().out
    assert "check: 5/5 requests match model.generate token for token" in out
    assert "check: 5/5 sampled requests reproduced by their seeds" in out
    assert re.search(r"^sampled \(temperature 0.7, top-p 0.9\): acceptance rate (\S+)", out, re.M)


def test_any_small_causal_lm_with_the_targets_vocabulary_drafts():
    """A drafter of another architecture (a 1-layer qwen2 for a llama target, both 256 tokens): the
    target's greedy tokens; one of another vocabulary keeps its clear error."""
    target = hf.tiny_random_model("llama", num_hidden_layers=2)
    reference = copy.deepcopy(target)
    config = pb.CompilationConfig(cudagraph_mode="FULL_AND_PIECEWISE", platform="simulated", compile_pieces="eager",
                                  capture_sizes=[2, 4, 8, 16])
    engine = spec.SpecEngine(target, hf.tiny_random_model("qwen2", num_hidden_layers=1, seed=3), config,
                             num_speculative_tokens=2, max_num_reqs=3, max_model_len=48, block_size=4)
    assert engine.generate(PROMPTS, 6, eos_token_id=[]) == [greedy(reference, p, 6, eos=[]) for p in PROMPTS]
    with pytest.raises(ValueError, match=r"the drafter's vocabulary \(128 tokens\) must be the target's \(256\)"):
        spec.SpecEngine(target, hf.tiny_random_model("qwen2", num_hidden_layers=1, vocab_size=128), config,
                        num_speculative_tokens=2)


def test_truncated_drafter_of_a_model_whose_layer_types_follow_its_layer_count():
    """mamba2's ``layer_types`` is a read-only property derived from ``num_hidden_layers``: left alone, not set."""
    target = hf.tiny_random_model("mamba2", num_hidden_layers=3)
    drafter = spec.truncated_drafter(target, 1)
    assert drafter.config.num_hidden_layers == 1 and len(drafter.config.layer_types) == 1
    assert len(target.config.layer_types) == 3


def test_a_refused_spec_engine_leaves_both_models_as_they_were():
    """A drafter adapt() refuses (after the target was adapted) undoes the target's adaptation; a step budget
    too small for a token and its drafts is refused before either model is touched (issue 46 item 10)."""
    drafter = hf.tiny_random_model("dory", recurrent_kv_cache_mode="last_loop")
    target = hf.tiny_random_model("llama", num_hidden_layers=2, vocab_size=drafter.config.get_text_config().vocab_size)
    before = target.config._attn_implementation
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        expected = target(ids).logits
    config = pb.CompilationConfig(platform="simulated", compile_pieces="eager", capture_sizes=[2, 4])
    with pytest.raises(ValueError, match="recurrent_kv_cache_mode='last_loop'"):
        spec.SpecEngine(target, drafter, config, num_speculative_tokens=2)
    assert target.config._attn_implementation == before != hf.ATTN_IMPLEMENTATION
    with torch.no_grad():
        assert torch.equal(target(ids).logits, expected)  # a plain forward, as before
    with pytest.raises(ValueError, match=r"max_num_batched_tokens=2 leaves no room .* at least num_speculative_tokens \+ 1 = 3"):
        spec.SpecEngine(target, target, config, num_speculative_tokens=2, max_num_batched_tokens=2)
    assert target.config._attn_implementation == before


SIM_NONE = pb.CompilationConfig(cudagraph_mode="NONE", platform="simulated", compile_pieces="eager")


def test_a_state_layer_target_rolls_back_to_its_last_token_not_its_chunk_start():
    """qwen3_next verified against an unrelated drafter (every draft rejected), with a prompt longer than the
    step budget: a rejection recomputes at most k + 1 tokens in a catch-up step, so the target's work stays
    linear in the tokens (the old rollback re-ran the prompt's last chunk and everything since, every round,
    until a chunk outgrew the budget and an empty drafter step raised); tokens equal HFEngine's (issue 46 item 2)."""
    target = hf.tiny_random_model("qwen3_next")
    vocab = target.config.get_text_config().vocab_size
    drafter = hf.tiny_random_model("llama", num_hidden_layers=1, vocab_size=vocab)
    plain = hf.HFEngine(copy.deepcopy(target), SIM_NONE, max_model_len=96, max_num_batched_tokens=8)
    k, new = 2, 24
    prompts = [list(range(3, 23)), [9, 8, 7]]  # 20 tokens: prefilled in chunks of the 8-token budget
    expected = plain.generate(prompts, new, eos_token_id=[])
    engine = spec.SpecEngine(target, drafter, SIM_NONE, num_speculative_tokens=k, max_model_len=96,
                             max_num_batched_tokens=8)
    rounds: list = []
    assert engine.generate(prompts, new, eos_token_id=[], on_step=lambda _: rounds.append(engine.last_round)) == expected
    s = engine.stats
    assert s.accepted < s.proposed
    prompt_tokens = sum(map(len, prompts))
    assert s.target_tokens <= prompt_tokens + s.rounds * 2 * (1 + k) + s.emitted * (k + 1)  # linear
    late = rounds[len(rounds) // 2:]
    assert late and all(r.catch_up_tokens <= len(r.requests) * (k + 1) for r in late), late
