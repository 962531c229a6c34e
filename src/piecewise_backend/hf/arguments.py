"""The arguments of an engine's ``generate``, checked in one place for every engine.

:class:`~piecewise_backend.hf.HFEngine` and :class:`~piecewise_backend.spec.SpecEngine` take the
same prompts and budgets; :func:`check_generate` turns them into plain lists or raises a
``ValueError`` that names the bad value and what is valid, before any request is admitted.
Imports neither transformers nor numpy.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any


@dataclasses.dataclass(frozen=True)
class GenerateArgs:
    """What :func:`check_generate` returns: every prompt as a list, one budget per prompt."""

    prompts: list[list[int]]
    budgets: list[int]


def is_int(value: Any) -> bool:
    """An integer that is not a bool (numpy's integer scalars count: they are ``numbers.Integral``)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def budgets(max_new_tokens: Any, num_prompts: int) -> list[int]:
    """``max_new_tokens`` (a positive int, or one per prompt) as one budget per prompt."""
    if is_int(max_new_tokens):
        per_prompt = [max_new_tokens] * num_prompts
    elif isinstance(max_new_tokens, (list, tuple)) and len(max_new_tokens) == num_prompts:
        per_prompt = list(max_new_tokens)
    else:
        raise ValueError(f"max_new_tokens must be a positive int or one per prompt (a list or tuple of "
                         f"{num_prompts} positive ints), got {_show(max_new_tokens)}")
    for i, b in enumerate(per_prompt):
        if not is_int(b) or b < 1:
            where = "max_new_tokens" if is_int(max_new_tokens) else f"max_new_tokens[{i}]"
            raise ValueError(f"{where} must be a positive int (tokens to generate), got {_show(b)}")
    return [int(b) for b in per_prompt]


def check_generate(
    prompts: Any,
    max_new_tokens: Any,
    *,
    vocab_size: int,
    max_model_len: int,
    reserve: int = 0,
    reserve_reason: str = "",
) -> GenerateArgs:
    """Check the arguments of ``generate`` for an engine of ``vocab_size`` tokens and ``max_model_len``
    positions. Each request needs ``len(prompt) + budget + reserve <= max_model_len`` (``reserve``:
    positions past the last token an engine writes, e.g. speculative decoding's ``k - 1``, said in
    the error as ``reserve_reason``)."""
    ids = [list(p) for p in prompts]
    per_prompt = budgets(max_new_tokens, len(ids))
    extra = f" + {reserve} ({reserve_reason})" if reserve_reason else ""
    for i, p in enumerate(ids):
        if not p:
            raise ValueError(f"prompt {i} is empty: a prompt needs at least one token id")
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:  # an embedding lookup out of range: IndexError here, a device-side assert inside a CUDA graph
            raise ValueError(f"prompt {i}: token id {bad[0]} is outside the vocabulary (ids 0..{vocab_size - 1})")
        if len(p) + per_prompt[i] + reserve > max_model_len:
            raise ValueError(f"prompt {i}: {len(p)} tokens + {per_prompt[i]} new{extra} must be in "
                             f"1..max_model_len={max_model_len}")
    return GenerateArgs(ids, per_prompt)
