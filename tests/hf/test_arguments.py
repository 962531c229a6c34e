"""The checks of generate's arguments shared by every engine (hf/arguments.py), without a model."""

from __future__ import annotations

import pytest

from piecewise_backend.hf import arguments

LIMITS = dict(vocab_size=256, max_model_len=32)


@pytest.mark.parametrize(
    "max_new_tokens, message",
    [
        (2.5, r"max_new_tokens must be a positive int or one per prompt \(a list or tuple of 2 positive ints\), got 2.5"),
        (None, r"max_new_tokens must be a positive int or one per prompt .*, got None"),
        ("3", r"max_new_tokens must be a positive int or one per prompt .*, got '3'"),
        ([3], r"one per prompt \(a list or tuple of 2 positive ints\), got \[3\]"),
        (True, r"max_new_tokens must be a positive int or one per prompt .*, got True"),
        (0, r"max_new_tokens must be a positive int \(tokens to generate\), got 0"),
        ([2.5, 1], r"max_new_tokens\[0\] must be a positive int \(tokens to generate\), got 2.5"),
        ([1, False], r"max_new_tokens\[1\] must be a positive int \(tokens to generate\), got False"),
        ([1, -2], r"max_new_tokens\[1\] must be a positive int \(tokens to generate\), got -2"),
    ],
)
def test_max_new_tokens_is_a_positive_int_or_one_per_prompt(max_new_tokens, message):
    with pytest.raises(ValueError, match=message):
        arguments.check_generate([[1, 2], [3]], max_new_tokens, **LIMITS)


def test_budgets_are_plain_ints_one_per_prompt():
    np = pytest.importorskip("numpy")
    assert arguments.check_generate([[1], [2]], 3, **LIMITS).budgets == [3, 3]
    got = arguments.check_generate([[1], [2]], (np.int64(4), 2), **LIMITS).budgets
    assert got == [4, 2] and all(type(b) is int for b in got)


def test_prompts_must_fit_the_vocabulary_and_the_model_length():
    with pytest.raises(ValueError, match=r"prompt 1: token id 256 is outside the vocabulary \(ids 0..255\)"):
        arguments.check_generate([[3, 4], [5, 256]], 2, **LIMITS)
    with pytest.raises(ValueError, match=r"prompt 0: token id -1 is outside the vocabulary"):
        arguments.check_generate([[-1]], 2, **LIMITS)
    with pytest.raises(ValueError, match=r"prompt 0 is empty: a prompt needs at least one token id"):
        arguments.check_generate([[]], 2, **LIMITS)
    with pytest.raises(ValueError, match=r"prompt 0: 30 tokens \+ 5 new must be in 1..max_model_len=32"):
        arguments.check_generate([[1] * 30], 5, **LIMITS)
    arguments.check_generate([[1] * 27], 5, **LIMITS)  # exactly max_model_len
    with pytest.raises(ValueError, match=r"prompt 0: 26 tokens \+ 5 new \+ 2 \(speculative tokens - 1\) must be"):
        arguments.check_generate([[1] * 26], 5, reserve=2, reserve_reason="speculative tokens - 1", **LIMITS)
