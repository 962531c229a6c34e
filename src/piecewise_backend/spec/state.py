"""Bookkeeping of :class:`~piecewise_backend.spec.SpecEngine`: what a round reports, totals, per-request state."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from ..context import BatchDescriptor
from ..modes import CUDAGraphMode


@dataclasses.dataclass(frozen=True)
class RoundInfo:
    """One round: what the target and the drafter ran, and what each request kept."""

    round: int
    requests: tuple[int, ...]  # prompt indices verified this round, in step order
    target_mode: CUDAGraphMode
    target_key: BatchDescriptor  # the graph key the target's step dispatched to
    target_tokens: int
    verify_only: bool  # no prompt in the step: every request has exactly k + 1 query tokens
    drafter_modes: tuple[CUDAGraphMode, ...]  # one per drafter step (k of them)
    accepted: tuple[int, ...]  # per request: drafts equal to the target's argmax (0..k)
    emitted: tuple[int, ...]  # per request: tokens appended (accepted + 1, cut at eos or budget)


@dataclasses.dataclass
class SpecStats:
    """Totals over a :meth:`SpecEngine.generate` call."""

    rounds: int = 0
    request_steps: int = 0  # target forwards summed over requests (plain decoding: one per token)
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_target_step(self) -> float:
        """Tokens a request gains per target forward it takes part in (plain greedy decoding: 1)."""
        return self.emitted / self.request_steps if self.request_steps else 0.0


class RequestStates:
    """Per-request bookkeeping of one :meth:`SpecEngine.generate` call."""

    def __init__(self, prompts: Sequence[Sequence[int]], budgets: list[int], eos: frozenset[int] = frozenset()):
        self.prompts, self.budgets, self.eos = [list(p) for p in prompts], budgets, eos
        self.outputs: list[list[int]] = [[] for _ in prompts]
        self.waiting, self.running = list(range(len(prompts))), []
        self.target_len = [0] * len(prompts)  # tokens whose K/V the target's cache holds, per request
        self.draft_len = [0] * len(prompts)
        self._finished = [False] * len(prompts)

    def seq(self, r: int) -> list[int]:
        return self.prompts[r] + self.outputs[r]

    def length(self, r: int) -> int:
        return len(self.prompts[r]) + len(self.outputs[r])

    def extend(self, r: int, tokens: list[int]) -> int:
        """Append ``tokens`` up to eos or the budget; returns how many were kept."""
        kept = 0
        for t in tokens:
            self.outputs[r].append(t)
            kept += 1
            if len(self.outputs[r]) >= self.budgets[r] or t in self.eos:
                self._finished[r] = True
                break
        return kept

    def done(self, r: int) -> bool:
        return self._finished[r]


def chunk_ends(chunks: Sequence[tuple[Any, int, int]]) -> list[int]:
    """Row of each chunk's last token in the step's token layout."""
    ends, total = [], 0
    for _, _, n in chunks:
        total += n
        ends.append(total - 1)
    return ends
