"""serve.Engine(token_rules=...): generate's per-token settings for one's own model (serve/token_rules.py);
the HF engines and the comparison with transformers' processors are tests/hf/test_generation_rules.py."""

from __future__ import annotations

import pytest

import piecewise_backend as pb
from pbtest.helpers import load_file
from piecewise_backend import serve

own = load_file("examples/own_model.py")
SIM = pb.CompilationConfig(cudagraph_mode="FULL_AND_PIECEWISE", platform="simulated", compile_pieces="eager",
                           capture_sizes=[1, 2])
ENGINE = dict(kv_layout=own.KV_LAYOUT, vocab_size=own.VOCAB, max_num_reqs=2, max_model_len=32, block_size=4)
PROMPTS = [[5, 7, 9], [11, 3]]


def test_rules_reach_every_step_graph_replays_included():
    """Suppressed tokens never come out (prefill and FULL decode replays alike); a forced EOS ends each
    request at its budget; without rules the same engine's tokens hold the suppressed ones."""
    plain = serve.Engine(own.make_model(), SIM, **ENGINE).generate(PROMPTS, 6)
    suppressed = sorted({t for out in plain for t in out})[:3]
    rules = serve.TokenRules(suppress_tokens=suppressed, forced_eos_token_id=1)
    engine = serve.Engine(own.make_model(), SIM, token_rules=rules, **ENGINE)
    engine.capture()
    replays = pb.counters["replays"]
    out = engine.generate(PROMPTS, 6)
    assert pb.counters["replays"] > replays
    assert engine.token_rules == rules
    assert all(len(o) == 6 and o[-1] == 1 and not set(o[:-1]) & set(suppressed) for o in out), (out, suppressed)


def test_no_rules_is_none_and_bad_rules_are_refused():
    assert serve.Engine(own.make_model(), SIM, token_rules=serve.TokenRules(), **ENGINE).token_rules is None
    with pytest.raises(ValueError, match=rf"token_rules.forced_eos_token_id holds token id {own.VOCAB}, outside"):
        serve.Engine(own.make_model(), SIM, token_rules=serve.TokenRules(forced_eos_token_id=own.VOCAB), **ENGINE)
    with pytest.raises(ValueError, match=r"speculative engine does not apply token_rules yet \(given: min_new_tokens\)"):
        serve.SpeculativeEngine(own.make_model(), own.make_model(), SIM, num_speculative_tokens=2,
                                target_layout=own.KV_LAYOUT, drafter_layout=own.KV_LAYOUT, vocab_size=own.VOCAB,
                                token_rules=serve.TokenRules(min_new_tokens=2), max_num_reqs=2, max_model_len=32,
                                block_size=4)
