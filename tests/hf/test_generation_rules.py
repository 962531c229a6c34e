"""generation_config's per-token settings (serve/token_rules.py, hf/engine.py generation_rules): the engine's
rules equal transformers' own logits processors, HFEngine's tokens equal model.generate's with them, and the
settings no engine applies are named once; simulated platform."""

from __future__ import annotations

import copy
import logging
import random
import types

import pytest
import torch

import piecewise_backend as pb
from piecewise_backend.serve import TokenRules

transformers = pytest.importorskip("transformers")
from piecewise_backend import hf

VOCAB = 64
CONFIG = pb.CompilationConfig(platform="simulated", compile_pieces="eager", capture_sizes=[1, 2, 4])
ENGINE = dict(max_num_reqs=3, max_model_len=48, block_size=4, lazy_capture=True, step_capture_budget_s=0)

#: each case: generation_config settings (an eos of 3 where a rule reads it)
CASES = {
    "repetition_penalty": dict(repetition_penalty=1.7),
    "repetition_penalty_below_1": dict(repetition_penalty=0.6),
    "no_repeat_ngram_size": dict(no_repeat_ngram_size=2),
    "bad_words_ids": dict(bad_words_ids=[[5], [7, 9], [3]]),
    "min_length": dict(min_length=9),
    "min_new_tokens": dict(min_new_tokens=3),
    "forced_bos_token_id": dict(forced_bos_token_id=11),
    "forced_eos_token_id": dict(forced_eos_token_id=4),
    "forced_eos_token_ids": dict(forced_eos_token_id=[4, 6]),
    "suppress_tokens": dict(suppress_tokens=[1, 2, 8]),
    "begin_suppress_tokens": dict(begin_suppress_tokens=[1, 2, 8]),
    "begin_suppress_after_bos": dict(begin_suppress_tokens=[1, 2, 8], forced_bos_token_id=11),
    "all": dict(repetition_penalty=1.3, no_repeat_ngram_size=3, bad_words_ids=[[5, 6]], min_new_tokens=2,
                forced_eos_token_id=4, suppress_tokens=[9], begin_suppress_tokens=[10]),
}


@pytest.fixture(scope="module")
def reference():
    return hf.tiny_random_model("llama", vocab_size=VOCAB)


def _generation_config(reference, settings: dict, prompt_len: int, new: int):
    config = copy.deepcopy(reference.generation_config)
    for name, value in settings.items():
        setattr(config, name, value)
    config.eos_token_id, config.max_length, config.do_sample = 3, prompt_len + new, False
    config._eos_token_tensor = torch.tensor([3])
    return config


@pytest.mark.parametrize("case", sorted(CASES))
def test_rules_equal_transformers_processors(reference, case):
    """On random scores and sequences (one-token prompts, the last budgeted token, repeats, bad-word
    prefixes among them), TokenRules.apply gives the scores transformers' processors give."""
    settings = CASES[case]
    rules = TokenRules(**settings)
    rng = random.Random(case)
    checked = 0
    for trial in range(40):
        prompt = [rng.choice([5, 7, 9, 6, 10, 3]) for _ in range(rng.choice([1, 1, 2, 4, 6]))]
        new = rng.randint(1, 6)
        output = [rng.choice([5, 7, 9, 6, 3]) for _ in range(rng.randint(0, new - 1))]
        scores = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(trial)) * 3
        config = _generation_config(reference, settings, len(prompt), new)
        processors = reference._get_logits_processor(config, input_ids_seq_length=len(prompt), device="cpu")
        expected = processors(torch.tensor([prompt + output]), scores.clone())
        request = types.SimpleNamespace(prompt=prompt, output=output, max_new_tokens=new, stop_token_ids=frozenset({3}))
        got = rules.apply(scores, [request])
        assert torch.equal(got.isinf(), expected.isinf()), (case, prompt, output, new)
        torch.testing.assert_close(got[~got.isinf()], expected[~expected.isinf()])
        checked += int(not torch.equal(expected, scores))
    assert checked, f"{case}: no trial changed a score: the comparison tests nothing"


def _reference_tokens(model, prompt: list[int], new: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False, eos_token_id=3,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("case", ["all", "forced_bos_token_id", "repetition_penalty"])
def test_hf_engine_equals_generate_with_the_models_settings(reference, case):
    """The settings in the model's generation_config reach every step (a chunked prefill, decode steps of
    several requests); the tokens equal model.generate's, and differ from the tokens without them."""
    prompts, budgets = [[5, 7, 9, 6, 5, 7], [10], [6, 6, 9]], [7, 5, 6]
    served, plain = hf.tiny_random_model("llama", vocab_size=VOCAB), copy.deepcopy(reference)
    for model in (served, reference):
        for name, value in CASES[case].items():
            setattr(model.generation_config, name, value)
    try:
        engine = hf.HFEngine(served, CONFIG, max_num_batched_tokens=4, **ENGINE)
        assert engine.token_rules.names() == sorted(CASES[case], key=list(TokenRules.__dataclass_fields__).index)
        got = [engine.generate([p], n, eos_token_id=3)[0] for p, n in zip(prompts, budgets)]
        together = engine.generate(prompts, budgets, eos_token_id=3)
        expected = [_reference_tokens(reference, p, n) for p, n in zip(prompts, budgets)]
        without = [_reference_tokens(plain, p, n) for p, n in zip(prompts, budgets)]
    finally:
        for name in CASES[case]:
            setattr(reference.generation_config, name, None)
    assert got == expected and together == expected
    assert expected != without, "the settings change nothing here: the test could not fail"


def test_bart_forced_eos_ends_like_generate(caplog):
    """The issue's repro: tiny bart's generation_config forces EOS (2) as the last token, as generate does;
    token_rules=TokenRules() turns the model's settings off."""
    model = hf.tiny_random_model("bart", vocab_size=VOCAB)
    assert model.generation_config.forced_eos_token_id == 2
    reference = copy.deepcopy(model)
    ids = torch.tensor([[5, 6, 7, 8]])
    expected = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    expected = expected[0, 4:].tolist()
    assert expected[-1] == 2
    engine = hf.HFEngine(model, CONFIG, **ENGINE)
    assert engine.generate([[5, 6, 7, 8]], 6) == [expected]
    reference.generation_config.forced_eos_token_id = None
    plain = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)[0, 4:].tolist()
    assert plain != expected
    off = hf.HFEngine(reference, CONFIG, token_rules=TokenRules(), **ENGINE)
    assert off.token_rules is None and off.generate([[5, 6, 7, 8]], 6) == [plain]


def test_unapplied_settings_are_named_once(caplog):
    """do_sample=True and settings no engine applies are named in one warning at build."""
    model = hf.tiny_random_model("llama", vocab_size=VOCAB)
    model.generation_config.do_sample, model.generation_config.sequence_bias = True, {(5,): 1.0}
    with caplog.at_level(logging.WARNING, logger="piecewise_backend.hf.engine"):
        hf.HFEngine(model, CONFIG, **ENGINE)
    warned = [r.getMessage() for r in caplog.records if "does not apply" in r.getMessage()]
    assert len(warned) == 1 and "do_sample=True" in warned[0] and "sequence_bias=" in warned[0], warned


def test_bad_rules_are_refused():
    with pytest.raises(ValueError, match=r"token_rules.suppress_tokens holds token id 64, outside the vocabulary \(0 .. 63\)"):
        hf.HFEngine(hf.tiny_random_model("llama", vocab_size=VOCAB), CONFIG, token_rules=TokenRules(suppress_tokens=[64]),
                    **ENGINE)
    with pytest.raises(ValueError, match="repetition_penalty must be None or a finite number > 0, got -1"):
        TokenRules(repetition_penalty=-1)
    with pytest.raises(ValueError, match=r"bad_words_ids must be a list of non-empty lists of token ids"):
        TokenRules(bad_words_ids=[[]])
    with pytest.raises(ValueError, match="token_rules must be None or a serve.TokenRules"):
        pb.serve.EngineArgs(token_rules={"suppress_tokens": [1]})


def test_spec_engine_names_what_it_leaves_out(caplog):
    """SpecEngine applies no rules yet: the target's settings are named in its warning; given rules are refused."""
    target = hf.tiny_random_model("llama", vocab_size=VOCAB)
    target.generation_config.forced_eos_token_id = 4
    with pytest.raises(ValueError, match=r"does not apply token_rules yet \(given: suppress_tokens\)"):
        hf.SpecEngine(target, target, CONFIG, num_speculative_tokens=2, token_rules=TokenRules(suppress_tokens=[1]),
                      **ENGINE)
    with caplog.at_level(logging.WARNING, logger="piecewise_backend.hf.engine"):
        hf.SpecEngine(target, target, CONFIG, num_speculative_tokens=2, **ENGINE)
    warned = [r.getMessage() for r in caplog.records if "SpecEngine does not apply" in r.getMessage()]
    assert len(warned) == 1 and "forced_eos_token_id=(4,)" in warned[0], warned
