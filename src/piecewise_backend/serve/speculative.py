"""Speculative decoding on the serving loop: a drafter proposes k tokens, the target verifies them in one step.

:class:`SpeculativeEngine` is :class:`~.engine.Engine` with two :class:`~.model_runner.ModelRunner`
(each its own KV cache and GraphRunner) and the :class:`Speculate` step executor; scheduling,
chunked prefill, preemption, streaming, the online API and lazy capture are the loop's. The
scheduler runs with ``lookahead = k``: every *final* chunk (one that reaches its request's last
token) carries k drafted tokens, so its budget and KV blocks count them. One step:

1. the drafter catches up on what it has not cached of each scheduled chunk (a prompt chunk, or
   the last round's new tokens) and proposes the first draft of each final chunk; k - 1 more
   drafter steps (one token per final chunk) propose the rest. The drafter runner is built with
   ``drafter=True``: breakable PIECEWISE graphs only;
2. the target runs one step over every chunk plus its drafts. A step of decoding requests only is
   uniform, ``k + 1`` query tokens each: FULL graphs keyed with ``uniform_decode_query_len = k + 1``;
   a step with a prompt chunk is a mixed batch;
3. acceptance keeps a prefix of the drafts plus one token of the target's (greedy: the drafts equal
   to its argmax; sampled: rejection sampling, see :class:`Speculate`); both caches drop the
   rejected tokens (:meth:`PagedKVCache.truncate`) and state layers keep no rejected token.

Two caches rather than one with two layer groups: the models differ in layer count (and may
differ in KV heads), each model's attention indexes its cache by its own layer number, and the
two run ahead of each other by different amounts, so each keeps its own block tables; the
scheduler plans over both at once (:class:`CachesInStep`), so a preemption frees both.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from ..config import CompilationConfig
from ..context import BatchDescriptor
from ..kv.cache import PagedKVCache
from ..modes import AttentionGraphSupport, CUDAGraphMode
from ..runner import CaptureReport
from ..state.cache import StateCache, StateSpec
from .arguments import EngineArgs, check_config, check_tokens_budget, check_vocab, engine_args, is_int, takes_engine_args
from .engine import Engine
from .loop import Executed, StepInfo, chunk_ends
from .model_runner import KVLayout, ModelRunner
from .sampling import (
    ACCEPT, DRAFT, NAN_TOKEN, RESAMPLE, TOKEN, SamplingParams, noise_key, probabilities, sample_from, uniform_noise,
)
from .scheduler import Request, StepPlan


@dataclasses.dataclass(frozen=True)
class RoundInfo:
    """One round: what the target and the drafter ran, and what each verified request kept."""

    round: int
    requests: tuple[Hashable, ...]  # verified this round, in step order (generate: prompt indices; else ids)
    target_mode: CUDAGraphMode
    target_key: BatchDescriptor  # the graph key the target's step dispatched to
    target_tokens: int
    verify_only: bool  # no prompt chunk in the step: every request has exactly k + 1 query tokens
    drafter_modes: tuple[CUDAGraphMode, ...]  # one per drafter step (k of them when a request was verified)
    accepted: tuple[int, ...]  # per request: drafts equal to the target's argmax (0..k)
    emitted: tuple[int, ...]  # per request: tokens appended (accepted + 1, cut at eos or budget)
    #: tokens of the target's catch-up step before the verify (state layers: a final chunk's tokens but its last)
    catch_up_tokens: int = 0


@dataclasses.dataclass
class SpecStats:
    """Totals over a ``generate`` call (or, online, since the engine was built)."""

    rounds: int = 0
    request_steps: int = 0  # target forwards summed over verified requests (plain decoding: one per token)
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0
    target_tokens: int = 0  # tokens the target's steps ran (verify steps and catch-ups, drafts included)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_target_step(self) -> float:
        """Tokens a request gains per target forward it takes part in (plain greedy decoding: 1)."""
        return self.emitted / self.request_steps if self.request_steps else 0.0


@dataclasses.dataclass(frozen=True)
class SpecModel:
    """One model of a speculative engine as its :class:`~.model_runner.ModelRunner` takes it: the protocol
    model (checked), its config, its cache layout, the specs of its state layers' states, and what was taken
    from the config given (``downgrades``: sentences, listed first in its runner's ``downgrades``)."""

    model: torch.nn.Module
    config: CompilationConfig
    layout: KVLayout
    state_specs: Sequence[StateSpec] = ()
    downgrades: tuple[str, ...] = ()


class CachesInStep:
    """Several paged KV caches planned as one (the scheduler's :class:`~.scheduler.KVBlocks`): a
    reservation reserves in each, a free frees each, a request fits when it fits all of them."""

    def __init__(self, caches: Sequence[PagedKVCache]):
        self.caches = list(caches)
        first = self.caches[0]
        if any(c.block_size != first.block_size or c.max_model_len != first.max_model_len for c in self.caches):
            raise ValueError("caches planned together need one block_size and max_model_len")
        self.block_size, self.max_model_len = first.block_size, first.max_model_len

    @property
    def tables(self) -> dict:
        return self.caches[0].tables

    @property
    def num_free_blocks(self) -> int:
        return min(c.num_free_blocks for c in self.caches)

    @property
    def total_blocks(self) -> int:
        return min(c.total_blocks for c in self.caches)

    def blocks_for(self, num_tokens: int) -> int:
        return self.caches[0].blocks_for(num_tokens)

    def blocks_needed(self, request: Hashable, num_tokens: int) -> int:
        return max(c.blocks_needed(request, num_tokens) for c in self.caches)

    def reserve(self, request: Hashable, num_tokens: int) -> None:
        for c in self.caches:
            c.reserve(request, num_tokens)

    def free(self, request: Hashable) -> None:
        for c in self.caches:
            if request in c.tables:
                c.free(request)

    # prefix caching: each cache keeps its own cached blocks; a prefix is reused only as far as every cache holds it
    def match(self, keys: Sequence[bytes], tokens: Sequence[int], limit: int) -> list[tuple[int, ...]]:
        """The longest prefix every cache holds: one ``(block of each cache)`` per cached block."""
        found = [c.match(keys, tokens, limit) for c in self.caches]
        n = min(len(f) for f in found)
        return list(zip(*(f[:n] for f in found)))

    def blocks_to_attach(self, blocks: Sequence[tuple[int, ...]]) -> int:
        return max(c.blocks_to_attach([b[i] for b in blocks]) for i, c in enumerate(self.caches))

    def attach(self, request: Hashable, blocks: Sequence[tuple[int, ...]]) -> None:
        for i, c in enumerate(self.caches):
            c.attach(request, [b[i] for b in blocks])

    def register(self, request: Hashable, keys: Sequence[bytes], first: int, end: int, tokens: Sequence[int]) -> int:
        """Blocks ``first .. end - 1`` cached in every cache (their K/V written in each); returns the first cache's count."""
        return [c.register(request, keys, first, end, tokens) for c in self.caches][0]


class StatesInStep:
    """The state caches of both models, freed together when the scheduler releases a request."""

    def __init__(self, caches: Sequence[StateCache | None]):
        self.caches = [c for c in caches if c is not None]

    @property
    def slots(self) -> set:
        return {slot for c in self.caches for slot in c.slots}

    def free(self, request: Hashable) -> None:
        for c in self.caches:
            if request in c.slots:
                c.free(request)


@dataclasses.dataclass(frozen=True)
class RoundPlan:
    """One round, laid out from the scheduler's chunks: which chunks are final (they reach their
    request's last token, so they carry ``k`` drafts and are verified), the requests drafting (those
    of final chunks, in step order), the target's layout (each chunk, plus ``k`` positions after a
    final one), its input ids with the drafts' rows (``draft_rows``) left 0 to be filled on the
    device, and whether every request has exactly ``k + 1`` query tokens (a verify-only step).

    ``split`` (a target with state layers): a final chunk of more than one token runs all but its last
    token first, in a committed catch-up step (``catch_up``, ``catch_up_ids``), and verifies from its
    last token, so a rejected draft rolls the states back to the last token before the drafts, never
    to the chunk's start (at most ``k + 1`` tokens are recomputed next round)."""

    chunks: list[tuple[Request, int, int]]
    final: list[bool]
    drafting: list[Request]
    layout: list[tuple[Hashable, int, int]]
    host_ids: list[int]
    draft_rows: list[int]
    verify_only: bool
    catch_up: list[tuple[Hashable, int, int]] = dataclasses.field(default_factory=list)
    catch_up_ids: list[int] = dataclasses.field(default_factory=list)

    @classmethod
    def of(cls, chunks: list[tuple[Request, int, int]], k: int, split: bool = False) -> RoundPlan:
        final = [start + count == r.length for r, start, count in chunks]
        host: list[int] = []
        draft_rows: list[int] = []
        layout: list[tuple[Hashable, int, int]] = []
        catch_up: list[tuple[Hashable, int, int]] = []
        catch_up_ids: list[int] = []
        for (r, start, count), f in zip(chunks, final):
            if f and split and count > 1:  # all but the last token: states committed before the drafts
                catch_up.append((r.slot, start, count - 1))
                catch_up_ids += r.tokens(start, count - 1)
                start, count = start + count - 1, 1
            host += r.tokens(start, count)
            layout.append((r.slot, start, count + (k if f else 0)))
            if f:
                draft_rows += range(len(host), len(host) + k)
                host += [0] * k
        verify_only = all(f and n == 1 + k for (_, _, n), f in zip(layout, final))
        return cls(chunks, final, [r for (r, _, _), f in zip(chunks, final) if f], layout, host, draft_rows,
                   verify_only, catch_up, catch_up_ids)


@dataclasses.dataclass(frozen=True)
class Drafts:
    """The drafter's part of a round: the ``k`` proposals of each drafting request ``(requests, k)`` on
    the device, their distributions ``(requests, k, vocab)`` (None when every request is greedy), the
    mode of each drafter step, and the drafting requests' states after its first step (None without
    state layers: :meth:`ModelRunner.snapshot`)."""

    tokens: torch.Tensor
    q: torch.Tensor | None
    modes: tuple[CUDAGraphMode, ...]
    saved: list | None


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The target's answer to a round's drafts, read back once: per drafting request (in step order),
    its drafts, how many of them it accepts and the token it draws after them."""

    drafts: list[list[int]]
    accepted: list[int]
    next_tokens: list[int]

    def tokens(self, i: int) -> list[int]:
        """The tokens drafting request ``i`` gains: its accepted drafts and the target's next one."""
        return self.drafts[i][:self.accepted[i]] + [self.next_tokens[i]]


@dataclasses.dataclass(frozen=True)
class PendingRound:
    """What :meth:`Speculate.execute` leaves for :meth:`Speculate.kept` (which learns what the loop kept):
    the target's step and every verified request with the number of drafts it accepted."""

    mode: CUDAGraphMode
    key: BatchDescriptor
    tokens: int
    verify_only: bool
    drafter_modes: tuple[CUDAGraphMode, ...]
    verified: tuple[tuple[Request, int], ...]
    catch_up: int = 0


class Speculate:
    """The speculative step (see the module docstring): drafts, one verifying target step, acceptance.

    Sampling is speculative (rejection) sampling, batched on the device with one read-back per round:
    the drafter samples each proposal ``x`` from its distribution ``q`` (after the request's
    temperature, top-k and top-p); the target's ``p`` accepts it with probability
    ``min(1, p(x) / q(x))``; the first rejected position draws from ``norm(max(0, p - q))`` and a
    round that accepts all ``k`` draws its bonus token from ``p``, so the tokens follow the target's
    own distribution. Every draw is keyed by (request seed, position, purpose) (``Request.seed`` is
    :func:`~.sampling.request_seed`): a seeded request's tokens do not depend on the batch around it. Greedy requests are the special case of one-hot ``p`` and
    ``q``: the target's own greedy tokens.

    State layers: a rejected draft must leave the states as if it never ran. A final chunk of more
    than one token first runs all but its last token in a committed catch-up step (:class:`RoundPlan`);
    the verify step then writes its states without committing them; a request whose drafts were all
    accepted commits, one with a rejection keeps the states from before the verify (after its last
    token but one) and recomputes its accepted tokens, at most ``k + 1``, in its next round's catch-up
    (its K/V rolled back to the same point): the target's work stays linear in the tokens. The drafter's states are copied after
    its first step of the round (``ModelRunner.snapshot``: one request's state bytes, for the round)
    and put back when fewer than ``k - 1`` drafts were accepted.
    """

    def __init__(self, target: ModelRunner, drafter: ModelRunner, k: int):
        self.target, self.drafter, self.k = target, drafter, k
        self.stats = SpecStats()
        self.last: RoundInfo | None = None
        self._pending: PendingRound | None = None

    def execute(self, plan: StepPlan) -> Executed:
        """One round: the plan, the drafts, the target's verifying step, its verdict and the rollback of
        what the verdict rejected."""
        round_plan = RoundPlan.of(plan.chunks, self.k, split=self.target.states is not None)
        drafts = self._draft(round_plan)
        if round_plan.catch_up:  # mixed-shaped (the runner's uniform decode is k + 1 tokens a request)
            self.target.run(round_plan.catch_up, round_plan.catch_up_ids, False, commit=True)
        ids = torch.tensor(round_plan.host_ids, dtype=torch.long, device=self.target.cache.device)
        if round_plan.drafting:
            ids[torch.tensor(round_plan.draft_rows, device=ids.device)] = drafts.tokens.flatten().to(ids.device)
        step = self.target.run(round_plan.layout, ids, round_plan.verify_only, commit=False)
        verdict = self._verdict(round_plan, drafts, step.output) if round_plan.drafting else None
        new, verified = self._roll_back(round_plan, verdict, drafts.saved)
        num_tokens = len(round_plan.host_ids)
        self._pending = PendingRound(step.mode, step.descriptor, num_tokens, round_plan.verify_only, drafts.modes,
                                     tuple(verified), len(round_plan.catch_up_ids))
        return Executed(new, num_tokens, round_plan.verify_only, step.mode, step.reason)

    def _draft(self, round_plan: RoundPlan) -> Drafts:
        """The drafter's steps: the first catches up on what it has not cached of each scheduled chunk and
        proposes each drafting request's first draft; ``k - 1`` more propose one token each."""
        k, chunks, drafting = self.k, round_plan.chunks, round_plan.drafting
        feed = [(r, start + count - r.draft_computed) for r, start, count in chunks]
        layout = [(r.slot, r.draft_computed, n) for r, n in feed if n > 0]
        tokens = [t for r, n in feed if n > 0 for t in r.tokens(r.draft_computed, n)]
        if not layout:  # the drafter has every scheduled token already (and nothing drafts): never an empty step
            return Drafts(torch.empty(0, k, dtype=torch.long), None, (), None)
        first = self.drafter.run(layout, tokens, all(n == 1 for _, _, n in layout))
        logits, modes = first.output, [first.mode]
        if not drafting:
            return Drafts(torch.empty(0, k, dtype=torch.long), None, tuple(modes), None)
        ends = {slot: end for (slot, _, _), end in zip(layout, chunk_ends(layout))}
        params = [r.sampling for r in drafting]
        sampled = any(not p.greedy for p in params)
        rows = logits[torch.tensor([ends[r.slot] for r in drafting], device=logits.device)]
        drafts, dists = [], []
        for j in range(k):
            if j:
                layout = [(r.slot, r.length + j - 1, 1) for r in drafting]
                proposal = self.drafter.run(layout, drafts[-1], True)
                rows = proposal.output
                modes.append(proposal.mode)
            if sampled:
                probs = probabilities(rows, params)
                keys = torch.tensor([noise_key(r.seed, r.length + j, DRAFT) for r in drafting], device=rows.device)
                drafts.append(sample_from(probs, keys))
                dists.append(probs)
            else:
                drafts.append(rows.argmax(-1))
            if j == 0:
                saved = self.drafter.snapshot([r.slot for r in drafting])
        return Drafts(torch.stack(drafts, 1), torch.stack(dists, 1) if sampled else None, tuple(modes), saved)

    def _verdict(self, round_plan: RoundPlan, drafts: Drafts, logits: torch.Tensor) -> Verdict:
        """Acceptance over the target's ``logits`` (every token's) at each drafting request's last
        sequence token and its drafts, read back in one transfer."""
        k, n = self.k, len(round_plan.drafting)
        ends = [end for end, f in zip(chunk_ends(round_plan.layout), round_plan.final) if f]
        rows = torch.tensor([e - k + j for e in ends for j in range(k + 1)], device=logits.device)
        tokens, accepted = self._accept(logits[rows].view(n, k + 1, -1), drafts.tokens, drafts.q, round_plan.drafting)
        read = torch.cat([drafts.tokens.flatten(), accepted, tokens]).tolist()  # the round's one read-back
        return Verdict([read[i * k:(i + 1) * k] for i in range(n)], read[n * k:n * k + n], read[n * k + n:])

    def _roll_back(
        self, round_plan: RoundPlan, verdict: Verdict | None, saved: list | None,
    ) -> tuple[list[list[int]], list[tuple[Request, int]]]:
        """Keep what the verdict accepted and drop the rest: each request's valid K/V in both caches
        (``computed``, ``draft_computed``), the target's states committed only for requests without a
        rejected draft, the drafter's put back from ``saved`` where they ran past the last accepted draft.
        Returns the tokens each chunk gains and every verified request with its accepted count."""
        k = self.k
        new: list[list[int]] = []
        verified: list[tuple[Request, int]] = []
        commit = []
        stateful_target = self.target.states is not None
        d = 0  # the verdict's index of the next drafting request
        for (r, start, count), f in zip(round_plan.chunks, round_plan.final):
            if not f:  # a prompt chunk: K/V written, nothing to sample yet
                r.computed = start + count
                r.draft_computed = max(r.draft_computed, start + count)
                commit.append(r.slot)
                new.append([])
                continue
            assert verdict is not None  # a final chunk drafts, so the round has a verdict
            a, length = verdict.accepted[d], r.length
            if a == k or not stateful_target:
                r.computed = length + a  # valid K/V: the sequence and the accepted drafts
                commit.append(r.slot)
            else:  # the states after the step hold rejected drafts: keep those from before it (after the
                r.computed = length - 1  # catch-up: every token but the last), recompute from there
            self.target.cache.truncate(r.slot, r.computed)
            if saved is not None and a < k - 1:  # the drafter's states ran past the last accepted draft
                self.drafter.restore([r.slot], [saved[d]])
                r.draft_computed = length
            else:
                r.draft_computed = length + min(a, k - 1)  # it fed the sequence and drafts[:k - 1]
            self.drafter.cache.truncate(r.slot, r.draft_computed)
            new.append(verdict.tokens(d))
            verified.append((r, a))
            d += 1
        self.target.commit(commit)
        return new, verified

    def _accept(
        self, logits: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor | None, requests: list[Request],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per request, the token after its accepted drafts and how many were accepted (device tensors).
        ``logits`` ``(requests, k + 1, vocab)``: the target's at the last sequence token and each draft.
        A request with a NaN in a row its verdict read (its last token's, or an accepted draft's) keeps the
        drafts accepted before that row and gets :data:`~.sampling.NAN_TOKEN`, as plain decoding would."""
        token, accepted = self._verdict_tokens(logits, drafts, q, requests)
        rows = torch.arange(self.k + 1, device=logits.device)
        first_nan = torch.where(logits.isnan().any(-1), rows, self.k + 1).min(-1).values  # k + 1: none
        return torch.where(first_nan <= accepted, NAN_TOKEN, token), torch.minimum(accepted, first_nan)

    def _verdict_tokens(
        self, logits: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor | None, requests: list[Request],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_accept` before the NaN check."""
        k = self.k
        drafts = drafts.to(logits.device)
        if q is None:  # all greedy: accept while the draft is the target's argmax
            argmax = logits.argmax(-1)
            agree = (drafts == argmax[:, :k]).long()
            accepted = agree.cumprod(-1).sum(-1)
            return argmax.gather(1, accepted[:, None])[:, 0], accepted
        n, vocab = len(requests), logits.shape[-1]
        params = [r.sampling for r in requests for _ in range(k + 1)]
        p = probabilities(logits.reshape(n * (k + 1), vocab), params).view(n, k + 1, vocab)
        q = q.to(p.device)
        p_x = p[:, :k].gather(-1, drafts[..., None])[..., 0]
        q_x = q.gather(-1, drafts[..., None])[..., 0]
        keys = torch.tensor([[noise_key(r.seed, r.length + j, ACCEPT) for j in range(k)] for r in requests],
                            device=p.device)
        accept = (uniform_noise(keys.flatten()).view(n, k) * q_x < p_x).long()  # u < p(x) / q(x)
        accepted = accept.cumprod(-1).sum(-1)
        residual = (p - torch.cat([q, torch.zeros_like(q[:, :1])], 1)).clamp(min=0)  # after all k: p itself
        at = accepted[:, None, None].expand(n, 1, vocab)
        chosen = residual.gather(1, at)[:, 0]
        chosen = torch.where(chosen.sum(-1, keepdim=True) > 0, chosen, p.gather(1, at)[:, 0])  # p == q: no mass left
        draw_keys = torch.tensor(
            [[noise_key(r.seed, r.length + j, RESAMPLE if j < k else TOKEN) for j in range(k + 1)] for r in requests],
            device=p.device,
        ).gather(1, accepted[:, None])[:, 0]
        return sample_from(chosen, draw_keys), accepted

    def kept(self, plan: StepPlan, executed: Executed, kept: list[int]) -> None:
        p = self._pending
        if p is None:
            raise RuntimeError("Speculate.kept: no round was executed")
        by_request = {id(r): n for (r, _, _), n in zip(plan.chunks, kept)}
        s = self.stats
        s.rounds += 1
        s.request_steps += len(p.verified)
        s.proposed += self.k * len(p.verified)
        s.accepted += sum(a for _, a in p.verified)
        emitted = tuple(by_request[id(r)] for r, _ in p.verified)
        s.emitted += sum(emitted)
        s.target_tokens += p.tokens + p.catch_up
        self.last = RoundInfo(
            s.rounds - 1, tuple(r.tag for r, _ in p.verified), p.mode, p.key, p.tokens, p.verify_only,
            p.drafter_modes, tuple(a for _, a in p.verified), emitted, p.catch_up,
        )


class SpeculativeEngine(Engine):
    """:class:`~.engine.Engine` with speculative decoding: ``drafter`` proposes, ``target`` verifies.

    Both models follow the engine's protocol, with their own ``target_layout`` / ``drafter_layout``
    and one vocabulary. ``config`` is the target's; the drafter uses ``drafter_config`` (default:
    ``config``) with ``drafter=True``. The target's capture sizes gain every verify size
    ``r * (k + 1)`` up to ``max_num_reqs`` requests (within ``max_capture_size`` when it was given),
    so each verify step has an exact FULL key. Greedy requests get the target's own greedy tokens,
    sampled ones speculative (rejection) sampling: tokens that follow the target's distribution
    (:class:`Speculate`). ``target_state_specs`` / ``drafter_state_specs``: the states of each model's
    state layers (a target with state layers verifies in PIECEWISE graphs: its FULL graphs hold one
    token per request). ``lazy_capture`` and ``graph_memory_budget`` apply to each runner.
    """

    @takes_engine_args()
    def __init__(
        self,
        target: torch.nn.Module,
        drafter: torch.nn.Module,
        config: CompilationConfig,
        *,
        num_speculative_tokens: int,
        target_layout: KVLayout,
        drafter_layout: KVLayout,
        vocab_size: int,
        target_state_specs: Sequence[StateSpec] | None = None,
        drafter_state_specs: Sequence[StateSpec] | None = None,
        drafter_config: CompilationConfig | None = None,
        target_attention_support: AttentionGraphSupport = AttentionGraphSupport.ALWAYS,
        args: EngineArgs | None = None,
        **engine_kwargs: Any,
    ):
        args = engine_args("SpeculativeEngine", args, engine_kwargs)
        k = check_speculative_args(num_speculative_tokens, config, drafter_config, args.max_num_batched_tokens,
                                   args.token_rules)
        for layout in (target_layout, drafter_layout):
            if not isinstance(layout, KVLayout):
                raise TypeError(f"target_layout and drafter_layout must be serve.KVLayouts, got {type(layout).__name__}")
        vocab_size = check_vocab(vocab_size)
        args.check_model(target, "target")
        args.check_model(drafter, "drafter")
        self._start_speculative(
            args, k, SpecModel(target, config, target_layout, target_state_specs or ()),
            SpecModel(drafter, drafter_config or config, drafter_layout, drafter_state_specs or ()),
            target_attention_support, vocab_size=vocab_size, eos_token_id=args.stop_tokens(vocab_size),
        )

    def _start_speculative(
        self, args: EngineArgs, k: int, target: SpecModel, drafter: SpecModel,
        target_attention_support: AttentionGraphSupport, *, vocab_size: int, eos_token_id: frozenset[int],
    ) -> None:
        """Build both model runners (the caller checked the models and the arguments) and start serving them
        (:meth:`Engine._start`)."""
        self.k = k
        config = target.config
        verify = sorted({r * (k + 1) for r in range(1, args.max_num_reqs + 1)} | set(config.sizes))
        if not config.max_capture_size_derived:
            verify = [s for s in verify if s <= config.max_capture_size]
        target_config = config.replace(capture_sizes=verify) if config.cudagraph_mode != CUDAGraphMode.NONE else config
        #: the target's :class:`~.model_runner.ModelRunner` (verifies) and the drafter's (proposes)
        self.target = ModelRunner(target.model, target_config, kv_layout=target.layout, args=args,
                                  state_specs=target.state_specs, uniform_decode_query_len=k + 1,
                                  attention_support=target_attention_support, downgrades=target.downgrades,
                                  vocab_size=vocab_size)
        self.drafter = ModelRunner(drafter.model, drafter.config, kv_layout=drafter.layout, args=args,
                                   state_specs=drafter.state_specs, drafter=True, downgrades=drafter.downgrades,
                                   vocab_size=vocab_size)
        self._speculate = Speculate(self.target, self.drafter, k)
        budget = args.max_num_batched_tokens or self.target.runner.dispatcher.max_size or args.max_num_reqs * (k + 1)
        if budget < k + 1:
            raise ValueError(f"max_num_batched_tokens={budget} leaves no room for a request's token and its "
                             f"{k} drafts: give at least num_speculative_tokens + 1 = {k + 1}")
        states = StatesInStep([self.target.states, self.drafter.states])
        self._start(args, [self.target, self.drafter], self._speculate,
                    CachesInStep([self.target.cache, self.drafter.cache]), states if states.caches else None,
                    vocab_size=vocab_size, eos_token_id=eos_token_id, lookahead=k, max_num_batched_tokens=budget)
        chosen = self.target.attention_backend, self.drafter.attention_backend
        #: the caches' attention backend(s) in words, as ``Engine.attention_backend`` (both's, when they differ)
        self.attention_backend = chosen[0] if chosen[0] == chosen[1] else f"target: {chosen[0]}; drafter: {chosen[1]}"

    def capture(self, progress: bool = False) -> CaptureReport:
        """Capture both runners before serving (target first; all graphs share one pool): one report
        over both (also ``.capture_report``); each runner's own is ``.target_report``, ``.drafter_report``."""
        with torch.inference_mode():
            self.target_report = t = self.target.runner.capture(progress=progress)
            self.drafter_report = d = self.drafter.runner.capture(progress=progress)
        self.capture_report = CaptureReport(
            t.graphs + d.graphs, t.seconds + d.seconds, f"target: {t.stats}; drafter: {d.stats}",
            t.memory_bytes + d.memory_bytes, t.graph_segments + d.graph_segments, t.per_descriptor + d.per_descriptor,
            {k: t.phases.get(k, 0.0) + d.phases.get(k, 0.0) for k in {**t.phases, **d.phases}},
        )
        return self.capture_report

    @property
    def stats(self) -> SpecStats:
        """Totals of the last :meth:`generate` call (online: since the engine was built)."""
        return self._speculate.stats

    @property
    def last_round(self) -> RoundInfo | None:
        """What the latest step ran (a :class:`RoundInfo`)."""
        return self._speculate.last

    @Engine.max_num_batched_tokens.setter  # type: ignore[attr-defined]
    def max_num_batched_tokens(self, value: int) -> None:
        check_tokens_budget(value)
        if value < self.k + 1:
            raise ValueError(f"max_num_batched_tokens must be at least num_speculative_tokens + 1 = {self.k + 1}, "
                             f"got {value}")
        self._loop.scheduler.max_num_batched_tokens = value

    def cached_tokens(self) -> dict[Hashable, tuple[int, int]]:
        """Per running request: how many of its tokens hold valid K/V in (the target's cache, the
        drafter's cache); ``generate``'s requests by prompt index. Slots past them are free to rewrite."""
        with self._loop.lock:
            return {r.tag: (r.computed, r.draft_computed) for r in self._loop.scheduler.running}

    def generate(  # type: ignore[override]
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int], *,
        eos_token_id: int | Sequence[int] | None = None,
        sampling: SamplingParams | Sequence[SamplingParams | None] | None = None,
        on_token: Callable[[int, int], None] | None = None, on_round: Callable[[RoundInfo], None] | None = None,
        on_step: Callable[[StepInfo], None] | None = None, cache_salt: str | None | Sequence[str | None] = None,
    ) -> list[list[int]]:
        """Completions of ``prompts``: greedy ones equal to the target's own greedy decoding, sampled
        ones following its distribution under their ``SamplingParams``; :attr:`stats` holds this call's totals. ``on_round`` gets a :class:`RoundInfo` per step, ``on_step`` a
        ``StepInfo``; the rest as :meth:`Engine.generate`."""
        if on_round is not None and not callable(on_round):
            raise TypeError(f"on_round must be callable(RoundInfo), got {type(on_round).__name__}")

        def step(info: StepInfo) -> None:
            if on_step is not None:
                on_step(info)
            if on_round is not None and self._speculate.last is not None:
                on_round(self._speculate.last)

        self._speculate.stats = SpecStats()
        return super().generate(prompts, max_new_tokens, eos_token_id=eos_token_id, sampling=sampling,
                                on_token=on_token, on_step=step, cache_salt=cache_salt)


def check_speculative_args(
    num_speculative_tokens: object, config: object, drafter_config: object, max_num_batched_tokens: int | None = None,
    token_rules: object = None,
) -> int:
    """The speculative engines' own arguments, before anything is built (a given ``max_num_batched_tokens`` must
    hold a request's token and its drafts; ``token_rules`` are not applied to verified tokens yet, so none is
    taken); returns k."""
    if token_rules:
        raise ValueError(f"a speculative engine does not apply token_rules yet (given: {', '.join(token_rules.names())}): "  # type: ignore[attr-defined]
                         "its verified tokens would not follow them; use Engine / HFEngine for these rules")
    k = num_speculative_tokens
    if not is_int(k) or k < 1:
        raise ValueError(f"num_speculative_tokens must be a positive int, got {k!r}")
    check_config(config)
    if drafter_config is not None:
        check_config(drafter_config, "drafter_config")
    if max_num_batched_tokens is not None and max_num_batched_tokens < k + 1:  # type: ignore[operator]
        raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens} leaves no room for a request's token and "
                         f"its {k} drafts: give at least num_speculative_tokens + 1 = {k + 1}")
    return int(k)  # type: ignore[arg-type]
