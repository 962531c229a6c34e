"""serve.SpeculativeEngine on decoders that are not Hugging Face models (examples/own_model.py's): a
drafter with other weights proposes, the target verifies; tokens equal the target's full recompute."""

from __future__ import annotations

import pytest
import torch

import piecewise_backend as pb
from pbtest.helpers import load_file
from piecewise_backend import serve

own = load_file("examples/own_model.py")
M = pb.CUDAGraphMode
PROMPTS = [[5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25], [3, 1, 4, 1, 5], [42]]


def nudged(scale: float) -> torch.nn.Module:
    """The target's weights plus noise: a drafter that agrees with it often, not always."""
    model = own.make_model(0)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale * p.std())
    return model


def test_a_drafter_with_other_weights_keeps_the_targets_tokens():
    config = pb.CompilationConfig(cudagraph_mode="FULL_AND_PIECEWISE", capture_sizes=[1, 2, 4, 8], platform="simulated",
                                  compile_pieces="eager")
    engine = serve.SpeculativeEngine(
        own.make_model(0), nudged(0.3), config, num_speculative_tokens=3, target_layout=own.KV_LAYOUT,
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
