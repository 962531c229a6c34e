"""serve.SpeculativeEngine on decoders that are not Hugging Face models (examples/own_model.py's): a
drafter with other weights proposes, the target verifies; tokens equal the target's full recompute."""

from __future__ import annotations

import pytest
import torch

import piecewise_backend as pb
from pbtest.helpers import NaNLogitsAt, load_file, nudged
from piecewise_backend import serve

own = load_file("examples/own_model.py")
M = pb.CUDAGraphMode
PROMPTS = [[5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25], [3, 1, 4, 1, 5], [42]]


def drafter(scale: float) -> torch.nn.Module:
    """The target's weights plus noise: a drafter that agrees with it often, not always."""
    return nudged(own.make_model(0), scale)


def test_a_drafter_with_other_weights_keeps_the_targets_tokens():
    config = pb.CompilationConfig(cudagraph_mode="FULL_AND_PIECEWISE", capture_sizes=[1, 2, 4, 8], platform="simulated",
                                  compile_pieces="eager")
    engine = serve.SpeculativeEngine(
        own.make_model(0), drafter(0.3), config, num_speculative_tokens=3, target_layout=own.KV_LAYOUT,
        drafter_layout=own.KV_LAYOUT, vocab_size=own.VOCAB, max_num_reqs=3, max_model_len=40, block_size=4, num_blocks=12,
    )
    engine.capture()
    rounds: list[serve.RoundInfo] = []
    out = engine.generate(PROMPTS, 10, on_round=rounds.append)
    target = own.make_model(0)
    assert out == [own.reference(target, p, 10) for p in PROMPTS]
    assert 0 < engine.stats.accepted < engine.stats.proposed  # drafts were rejected, both caches rolled back
    assert any(r.verify_only and r.target_mode == M.FULL for r in rounds)
    assert engine.target.cache.tables == {} == engine.drafter.cache.tables


def test_the_budget_must_hold_a_token_and_its_drafts():
    config = pb.CompilationConfig(cudagraph_mode="NONE")
    with pytest.raises(ValueError, match=r"max_num_batched_tokens=3 leaves no room .* at least num_speculative_tokens \+ 1 = 4"):
        serve.SpeculativeEngine(own.make_model(), own.make_model(), config, num_speculative_tokens=3,
                                target_layout=own.KV_LAYOUT, drafter_layout=own.KV_LAYOUT, vocab_size=own.VOCAB,
                                max_num_batched_tokens=3)


def exact_two_tokens(model: torch.nn.Module, prompt: list[int], params: serve.SamplingParams) -> dict[tuple[int, int], float]:
    """p(t1) * p(t2 | t1) of the target under ``params``, from full recomputes (dense attention)."""
    from piecewise_backend.serve.sampling import probabilities

    def dist(seq: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor(seq), torch.arange(len(seq)), dense=True)[-1:]
        return probabilities(logits, [params])[0]

    first = dist(prompt)
    joint = {}
    for t1 in first.nonzero().flatten().tolist():
        second = dist(prompt + [t1])
        for t2 in second.nonzero().flatten().tolist():
            joint[(t1, t2)] = float(first[t1] * second[t2])
    return joint


def test_sampled_tokens_follow_the_targets_distribution_with_a_differing_drafter():
    """Many seeded requests of one prompt: the empirical joint distribution of the first two tokens
    against the target's exact p(t1) p(t2 | t1), within a total-variation bound drawn from the
    sample size (the 99.9th percentile of the TV of exact samples of that size); no token outside
    top-k; a drafter that often disagrees, so rejections and resamples are exercised."""
    config = pb.CompilationConfig(cudagraph_mode="FULL_AND_PIECEWISE", capture_sizes=[4, 8, 16], platform="simulated",
                                  compile_pieces="eager")
    engine = serve.SpeculativeEngine(
        own.make_model(0), drafter(0.6), config, num_speculative_tokens=2, target_layout=own.KV_LAYOUT,
        drafter_layout=own.KV_LAYOUT, vocab_size=own.VOCAB, max_num_reqs=8, max_model_len=16, block_size=4,
    )
    prompt = [3, 1, 4, 1, 5]
    n = 3000
    params = [serve.SamplingParams(temperature=1.5, top_k=4, seed=s) for s in range(n)]
    out = engine.generate([prompt] * n, 2, sampling=params, eos_token_id=[])
    stats = engine.stats
    assert 0.1 < stats.acceptance_rate < 0.9, stats  # drafts both accepted and rejected
    exact = exact_two_tokens(own.make_model(0), prompt, params[0])
    cells = sorted(exact)
    counts = torch.zeros(len(cells), dtype=torch.float64)
    index = {c: i for i, c in enumerate(cells)}
    for tokens in out:
        assert tuple(tokens) in index, (tokens, cells)  # no token outside the target's top-k
        counts[index[tuple(tokens)]] += 1
    probs = torch.tensor([exact[c] for c in cells], dtype=torch.float64)
    tv = 0.5 * (counts / n - probs).abs().sum().item()
    gen = torch.Generator().manual_seed(0)
    null = [0.5 * (torch.bincount(torch.multinomial(probs, n, replacement=True, generator=gen), minlength=len(cells))
                   .double() / n - probs).abs().sum().item() for _ in range(400)]
    bound = sorted(null)[int(0.999 * len(null))]
    assert tv <= bound, (tv, bound)


def test_a_seed_gives_the_same_speculative_tokens_alone_and_in_a_batch():
    config = pb.CompilationConfig(cudagraph_mode="NONE")
    engine = serve.SpeculativeEngine(
        own.make_model(0), drafter(0.3), config, num_speculative_tokens=3, target_layout=own.KV_LAYOUT,
        drafter_layout=own.KV_LAYOUT, vocab_size=own.VOCAB, max_num_reqs=3, max_model_len=40, block_size=4,
    )
    params = serve.SamplingParams(temperature=0.9, top_p=0.9, seed=77)
    alone = engine.generate([PROMPTS[1]], 10, sampling=params)[0]
    crowd = engine.generate([PROMPTS[0], PROMPTS[2], PROMPTS[1]], 10, sampling=[None, params, params])
    assert crowd[2] == alone and crowd[0] == own.reference(own.make_model(0), PROMPTS[0], 10)
    shifted = engine.generate([PROMPTS[1], PROMPTS[1] + alone[:1]], 9, sampling=params)
    assert shifted[0] == alone[:9] and shifted[1] != alone[1:]  # sharing a seed: independent noise


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_nan_target_logits_end_their_request_with_an_error_and_the_others_are_served(sampled):
    """PROMPTS[1] (5 tokens) verifies position 7 while decoding, where the target's logits are NaN: it keeps
    the 3 tokens before (the drafts accepted on finite rows), as plain decoding would; PROMPTS[0] passes
    position 7 inside its prompt only: it keeps the target's tokens."""
    config = pb.CompilationConfig(cudagraph_mode="FULL_AND_PIECEWISE", capture_sizes=[1, 2, 4, 8], platform="simulated",
                                  compile_pieces="eager")
    engine = serve.SpeculativeEngine(
        NaNLogitsAt(own.make_model(0), 7), drafter(0.3), config, num_speculative_tokens=3, target_layout=own.KV_LAYOUT,
        drafter_layout=own.KV_LAYOUT, vocab_size=own.VOCAB, max_num_reqs=3, max_model_len=40, block_size=4,
    )
    params = serve.SamplingParams(0.8, seed=3) if sampled else None
    good, bad = engine.add_request(PROMPTS[0], 10, sampling=params), engine.add_request(PROMPTS[1], 10, sampling=params)
    done = {r.request_id: r for r in engine.results()}
    assert done[bad].finish_reason == "error" and len(done[bad].token_ids) == 3, done[bad]
    assert "hold NaN" in done[bad].error and "or for one of its 3 drafts after it" in done[bad].error
    assert done[good].finish_reason == "length" and len(done[good].token_ids) == 10
    if not sampled:
        assert done[good].token_ids == own.reference(own.make_model(0), PROMPTS[0], 10)
        assert done[bad].token_ids == own.reference(own.make_model(0), PROMPTS[1], 3)
    assert engine.target.cache.tables == {} == engine.drafter.cache.tables
