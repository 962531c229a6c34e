"""Per-token rules on a step's logits: what transformers' ``generation_config`` does beside sampling.

:class:`TokenRules` holds the settings ``model.generate`` applies to every step's scores before it
picks a token (a repetition penalty, n-grams that may not repeat, banned and suppressed tokens, a
minimum length, a forced first or last token). :meth:`TokenRules.apply` gives the rows of a step's
logits those rules for each row's request, on the logits' device, in ``generate``'s order, so greedy
tokens equal ``generate``'s with the same settings. An engine with no rules (the default, and any
HF model whose ``generation_config`` sets none) skips them: one truth test per step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from ..validation import is_int

__all__ = ["RULE_FIELDS", "TokenRules"]


def _ids(value: Any, name: str) -> tuple[int, ...]:
    if value is None:
        return ()
    if is_int(value) or not isinstance(value, (list, tuple)) or not all(is_int(t) for t in value):
        raise ValueError(f"{name} must be a list of token ids, got {value!r}")
    return tuple(int(t) for t in value)


def _optional_count(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if not is_int(value) or value < 0:
        raise ValueError(f"{name} must be None or an int >= 0, got {value!r}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class TokenRules:
    """``generate``'s per-token settings, named as in transformers' ``GenerationConfig``.

    A request's length below counts its prompt and the tokens it generated so far; the token being
    chosen is the next one. ``min_length`` / ``min_new_tokens`` keep the request's own stop tokens
    out until it is that long (a request without stop tokens is unaffected); ``forced_eos_token_id``
    is chosen as a request's last token (at its ``max_new_tokens`` budget); ``forced_bos_token_id``
    as the token after a one-token prompt; ``begin_suppress_tokens`` are banned as a request's first
    new token (its second after a one-token prompt with a forced BOS); ``bad_words_ids`` are token sequences whose last token is banned after the others
    (a one-token entry always; entries that are a stop token alone are dropped, as ``generate`` does).
    """

    repetition_penalty: float | None = None  # > 0; scores of tokens seen: negative ones * it, others / it
    no_repeat_ngram_size: int | None = None  # no n-gram of this size occurs twice
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    min_length: int | None = None
    min_new_tokens: int | None = None
    forced_bos_token_id: int | None = None
    forced_eos_token_id: tuple[int, ...] = ()  # one id or several (any of them is allowed then)
    suppress_tokens: tuple[int, ...] = ()
    begin_suppress_tokens: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        p = self.repetition_penalty
        if p is not None:
            if isinstance(p, bool) or not isinstance(p, (int, float)) or not p > 0 or p == float("inf"):
                raise ValueError(f"repetition_penalty must be None or a finite number > 0, got {p!r}")
            object.__setattr__(self, "repetition_penalty", None if p == 1 else float(p))
        object.__setattr__(self, "no_repeat_ngram_size", _optional_count(self.no_repeat_ngram_size, "no_repeat_ngram_size") or None)
        object.__setattr__(self, "min_length", _optional_count(self.min_length, "min_length") or None)
        object.__setattr__(self, "min_new_tokens", _optional_count(self.min_new_tokens, "min_new_tokens") or None)
        bos = self.forced_bos_token_id
        if bos is not None and (not is_int(bos) or bos < 0):
            raise ValueError(f"forced_bos_token_id must be None or a token id, got {bos!r}")
        eos = self.forced_eos_token_id
        object.__setattr__(self, "forced_eos_token_id", (int(eos),) if is_int(eos) else _ids(eos, "forced_eos_token_id"))
        words = self.bad_words_ids or ()
        if not isinstance(words, (list, tuple)) or not all(isinstance(w, (list, tuple)) and w for w in words):
            raise ValueError(f"bad_words_ids must be a list of non-empty lists of token ids, got {words!r}")
        object.__setattr__(self, "bad_words_ids", tuple(_ids(w, "each of bad_words_ids") for w in words))
        object.__setattr__(self, "suppress_tokens", _ids(self.suppress_tokens, "suppress_tokens"))
        object.__setattr__(self, "begin_suppress_tokens", _ids(self.begin_suppress_tokens, "begin_suppress_tokens"))

    def __bool__(self) -> bool:
        """Whether any rule is set (an engine skips the rules otherwise)."""
        return any(bool(getattr(self, f)) for f in RULE_FIELDS)

    def names(self) -> list[str]:
        """The rules set, by name."""
        return [f for f in RULE_FIELDS if getattr(self, f)]

    def check(self, vocab_size: int) -> None:
        """Refuse a token id outside ``0 .. vocab_size - 1`` (it could never be banned or forced)."""
        for name in RULE_FIELDS:
            value = getattr(self, name)
            ids = ([value] if is_int(value) else [t for w in value for t in w] if name == "bad_words_ids"
                   else value if isinstance(value, tuple) else [])
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"token_rules.{name} holds token id {bad[0]}, outside the vocabulary "
                                 f"(0 .. {vocab_size - 1})")

    def apply(self, rows: torch.Tensor, requests: Sequence[Any]) -> torch.Tensor:
        """``rows`` (``(len(requests), vocab)``, the logits of each request's next token) with the rules
        applied for that request (a new tensor; ``rows`` is not written). A request has ``prompt``,
        ``output`` (lists of ints), ``max_new_tokens`` and ``stop_token_ids``."""
        out = rows.clone()
        if self.repetition_penalty is not None:
            r, t = [], []
            for i, req in enumerate(requests):
                seen = set(req.prompt) | set(req.output)
                r.extend([i] * len(seen))
                t.extend(seen)
            index = (torch.tensor(r, device=out.device), torch.tensor(t, device=out.device))
            scores = out[index]
            out[index] = torch.where(scores < 0, scores * self.repetition_penalty, scores / self.repetition_penalty)
        banned: list[tuple[int, int]] = []  # (row, token) set to -inf
        forced: list[tuple[int, tuple[int, ...]]] = []  # (row, tokens allowed), in generate's order below
        for i, req in enumerate(requests):
            length, new = len(req.prompt) + len(req.output), len(req.output)
            if self.no_repeat_ngram_size is not None:
                banned.extend((i, t) for t in _repeated_ngram_ends(req, self.no_repeat_ngram_size))
            for word in self.bad_words_ids:
                if len(word) == 1 and word[0] in req.stop_token_ids:
                    continue
                if len(word) == 1 or _ends_with(req, word[:-1]):
                    banned.append((i, word[-1]))
            if (self.min_length is not None and length < self.min_length) or (
                    self.min_new_tokens is not None and new < self.min_new_tokens):
                banned.extend((i, t) for t in req.stop_token_ids)
            if self.forced_bos_token_id is not None and length == 1:
                forced.append((i, (self.forced_bos_token_id,)))
            if self.forced_eos_token_id and new == req.max_new_tokens - 1:
                forced.append((i, self.forced_eos_token_id))
        if banned:
            self._fill(out, banned, float("-inf"))
        for i, allowed in forced:  # every other token -inf, the allowed ones 0 (as generate)
            out[i] = float("-inf")
            self._fill(out, [(i, t) for t in allowed], 0.0)
        late = [(i, t) for i, req in enumerate(requests) for t in self.suppress_tokens]
        late.extend((i, t) for i, req in enumerate(requests) if len(req.output) == self._begin(req)
                    for t in self.begin_suppress_tokens)
        if late:
            self._fill(out, late, float("-inf"))
        return out

    def _begin(self, req: Any) -> int:
        """How many new tokens precede the one ``begin_suppress_tokens`` applies to: none, or one (the
        forced BOS) after a one-token prompt, as ``generate``."""
        return int(len(req.prompt) == 1 and self.forced_bos_token_id is not None)

    @staticmethod
    def _fill(out: torch.Tensor, at: list[tuple[int, int]], value: float) -> None:
        rows, tokens = zip(*at)
        out[torch.tensor(rows, device=out.device), torch.tensor(tokens, device=out.device)] = value


#: The fields of :class:`TokenRules`, in the order ``generate`` applies them.
RULE_FIELDS = tuple(f.name for f in dataclasses.fields(TokenRules))


def _sequence(req: Any) -> list[int]:
    return [*req.prompt, *req.output]


def _ends_with(req: Any, prefix: Sequence[int]) -> bool:
    seq = _sequence(req)
    return len(seq) >= len(prefix) and seq[len(seq) - len(prefix):] == list(prefix)


def _repeated_ngram_ends(req: Any, n: int) -> set[int]:
    """Tokens that would complete an n-gram the request's sequence already holds."""
    seq = _sequence(req)
    if len(seq) + 1 < n:
        return set()
    head = tuple(seq[len(seq) - n + 1:]) if n > 1 else ()
    return {seq[j + n - 1] for j in range(len(seq) - n + 1) if tuple(seq[j:j + n - 1]) == head}
