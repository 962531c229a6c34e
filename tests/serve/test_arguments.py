"""The checks of generate's arguments shared by every engine (serve/arguments.py), without a model."""

from __future__ import annotations

import pytest

from piecewise_backend.serve import arguments

LIMITS = {"vocab_size": 256, "max_model_len": 32}


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


def test_token_ids_must_be_integers_and_name_the_first_bad_one():
    with pytest.raises(ValueError, match=r"prompt 0: token id 5.5 \(float\) at position 0 is not an integer"):
        arguments.check_generate([[5.5, 6.9]], 2, **LIMITS)
    with pytest.raises(ValueError, match=r"prompt 1: token id 6.0 \(float\) at position 1 is not an integer"):
        arguments.check_generate([[1], [5, 6.0]], 2, **LIMITS)
    with pytest.raises(ValueError, match=r"prompt 0: token id True \(bool\) at position 0 is not an integer"):
        arguments.check_generate([[True]], 2, **LIMITS)
    with pytest.raises(ValueError, match=r"prompt 0: token id '5' \(str\) at position 0 is not an integer"):
        arguments.check_generate([["5"]], 2, **LIMITS)


def test_prompts_as_tensors_and_arrays():
    torch = pytest.importorskip("torch")
    np = pytest.importorskip("numpy")
    got = arguments.check_generate([torch.tensor([5, 6]), np.array([7, 8], dtype=np.int32), (9,), range(3, 5)], 2,
                                   **LIMITS).prompts
    assert got == [[5, 6], [7, 8], [9], [3, 4]] and all(type(t) is int for p in got for t in p)
    with pytest.raises(ValueError, match=r"prompt 0: token id 5.5 \(float\) at position 0 is not an integer"):
        arguments.check_generate([torch.tensor([5.5, 6.0])], 2, **LIMITS)
    with pytest.raises(ValueError, match=r"prompt 0: token id 5.0 \(float\) at position 0 is not an integer"):
        arguments.check_generate([np.array([5.0])], 2, **LIMITS)
    with pytest.raises(ValueError, match=r"prompt 0 is a 2-D Tensor of shape \(1, 3\); a prompt is a list or tuple of "
                                         r"ints, a 1-D integer tensor"):
        arguments.check_generate([torch.tensor([[5, 6, 7]])], 2, **LIMITS)
    with pytest.raises(TypeError, match=r"prompts must be a list or tuple of prompts .* got Tensor .*padded batch"):
        arguments.check_generate(torch.tensor([[5, 6, 7]]), 2, **LIMITS)


@pytest.mark.parametrize(
    "prompts, message",
    [
        ("hello", r"prompts must be a list or tuple of prompts .*got str 'hello'"),
        (["hello"], r"prompt 0 is text \('hello'\): generate takes token ids; tokenize it first"),
        ([1, 2, 3], r"prompt 0 is an int \(1\), not a sequence of token ids: .*wrap a single prompt as \[prompt\]"),
        ([{1, 2}], r"prompt 0 is a set \({1, 2}\); a prompt is a list or tuple of ints"),
        (None, r"prompts must be a list or tuple of prompts .*got NoneType None"),
    ],
)
def test_prompts_of_the_wrong_kind_are_refused(prompts, message):
    with pytest.raises(TypeError, match=message):
        arguments.check_generate(prompts, 2, **LIMITS)
