"""Which tokens run in the next step: chunked prefill under a token budget, and preemption.

A :class:`Request` is a prompt, the tokens generated so far, and how many of them have K/V in the
cache (``computed``). To produce its next token a request needs K/V for every token but its last
and the logits at its last one; a step gives it a *chunk* of its uncomputed tokens.
:meth:`Scheduler.schedule` plans one step:

1. running requests in decode (one token left to compute) first, then running requests still
   prefilling, each up to the step's token budget (``max_num_batched_tokens``): a prompt longer
   than the budget is prefilled in chunks over several steps, and decode tokens never wait for it;
2. when a running request's chunk needs KV blocks and none are free, the newest running request is
   preempted: its blocks are freed, it forgets its K/V (``computed = 0``) and goes back to the front
   of the queue, keeping its tokens; when blocks free up it prefills its prompt and tokens again
   (recompute) and continues where it was. The oldest request always makes progress, so every
   request completes;
3. waiting requests (preempted ones first, then new ones in arrival order) join while a request
   row, the budget and free blocks allow, unless this step preempted (they would take the blocks
   the running requests need).

Blocks are reserved while planning, so each check sees what the chunks before it took. A request
that needs more blocks than the whole cache is refused when it is added (:meth:`Scheduler.check_fits`).

With prefix caching (``prefix=True``, :mod:`..kv.prefix_cache`) a joining request first takes the
longest chain of cached full blocks of its prompt (never the block of its last token, whose logits
are needed: a prompt cached whole recomputes its last block into a fresh one) and starts its prefill
after them (``computed``); after each step (:meth:`Scheduler.register`) the prompt blocks the step
filled are cached for later requests. Its keys are hashed once, when it is added.

``lookahead`` (speculative decoding's k) makes room after every *final* chunk (one that reaches its
request's last token, so the step produces a token): the step appends ``lookahead`` drafted tokens
to it, so it costs ``count + lookahead`` of the budget and reserves K/V for them. A final chunk the
budget cannot extend that way is cut one token short (a plain prefill chunk), or, with one token
left, waits for the next step.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable, Hashable

from typing import Any, Protocol

from ..kv.cache import PagedKVCache
from ..kv.prefix_cache import block_keys, salt_bytes
from ..observability import counters
from ..state.cache import StateCache
from .sampling import SamplingParams


class KVBlocks(Protocol):
    """The block bookkeeping the scheduler plans with: a :class:`~piecewise_backend.kv.PagedKVCache`,
    or several caches kept in step (speculative decoding's target and drafter)."""

    block_size: int
    max_model_len: int
    tables: dict

    @property
    def num_free_blocks(self) -> int: ...

    @property
    def total_blocks(self) -> int: ...

    def blocks_for(self, num_tokens: int) -> int: ...

    def blocks_needed(self, request: Hashable, num_tokens: int) -> int: ...

    def reserve(self, request: Hashable, num_tokens: int) -> None: ...

    def free(self, request: Hashable) -> None: ...


@dataclasses.dataclass(eq=False)
class Request:
    """One request's state. ``slot`` keys its block table; ``order`` is its arrival (newest: largest)."""

    request_id: Hashable
    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    seed: int  # its sampling noise's seed (sampling.request_seed, then noise_key)
    stop_token_ids: frozenset[int]
    order: int
    on_token: Callable[[Hashable, int], None] | None = None
    output: list[int] = dataclasses.field(default_factory=list)
    computed: int = 0  # tokens whose K/V the cache holds
    finish_reason: str | None = None  # "length", "stop", "cancelled" or "error" once finished
    error: str = ""  # what ended it with "error"
    preemptions: int = 0
    report: bool = True  # its output goes to the online API's results (generate reads its own)
    tag: Hashable = None  # what its callbacks and reports call it: the request id, or generate's prompt index
    draft_computed: int = 0  # tokens whose K/V a drafter's cache holds (speculative decoding)
    keys: list[bytes] = dataclasses.field(default_factory=list)  # its prompt's full blocks' keys (prefix caching)
    registered: int = 0  # blocks of its table that are cached (found cached, or registered after their step)
    num_cached_tokens: int = 0  # prompt tokens it found cached when first scheduled
    scheduled: bool = False  # it ran in a step once
    cache_salt: str | None = None  # prefix caching: it shares cached blocks only with requests of an equal salt
    mm: Any = None  # its multimodal inputs as the engine admitted them (hf.multimodal.Images; None: text only)

    #: its sampling is argmax (``sampling.greedy``), kept as a field: a step reads it per request
    greedy: bool = dataclasses.field(init=False, default=True)

    def __post_init__(self) -> None:
        if self.tag is None:
            self.tag = self.request_id
        self.greedy = self.sampling.greedy

    @property
    def slot(self) -> int:
        return self.order

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.output)

    def tokens(self, start: int, count: int) -> list[int]:
        """Tokens ``start .. start + count`` of the prompt followed by the output."""
        p = len(self.prompt)
        if start + count <= p:
            return self.prompt[start:start + count]
        if start >= p:
            return self.output[start - p:start - p + count]
        return self.prompt[start:] + self.output[:start + count - p]

    def token(self, position: int) -> int:
        """The token at ``position`` of the prompt followed by the output."""
        p = len(self.prompt)
        return self.prompt[position] if position < p else self.output[position - p]


@dataclasses.dataclass
class StepPlan:
    """One step: ``(request, first position, token count)`` per scheduled request, in layout order,
    and the requests preempted while planning it."""

    chunks: list[tuple[Request, int, int]]
    preempted: list[Request]

    @property
    def num_tokens(self) -> int:
        return sum(n for _, _, n in self.chunks)


class Scheduler:
    """Plans steps over ``cache``: at most ``max_num_reqs`` requests and ``max_num_batched_tokens`` tokens each."""

    def __init__(
        self, cache: PagedKVCache | KVBlocks, max_num_reqs: int, max_num_batched_tokens: int, states: StateCache | None = None,
        lookahead: int = 0, prefix: bool = False,
    ):
        self.cache = cache
        #: prefix caching: joining requests reuse cached prompt blocks, filled prompt blocks are cached
        self.prefix = prefix
        self._filling: list[Request] = []  # running requests with prompt blocks still to register
        self.lookahead = lookahead
        self.states = states  # the engine's StateCache (None without state layers): slots freed with the blocks
        self.max_num_reqs = max_num_reqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # holding blocks, in admission order
        self.preemptions = 0  # over this scheduler's life

    def check_fits(self, prompt_len: int, max_new_tokens: int, where: str = "a request") -> None:
        """Refuse up front a request that could not run even alone: its K/V would not fit the cache."""
        tokens = prompt_len + max_new_tokens - 1 + self.lookahead  # the last token produced is never fed back
        need = self.cache.blocks_for(tokens)
        total = self.cache.total_blocks
        if need > total:
            raise ValueError(
                f"{where}: {prompt_len} prompt tokens + {max_new_tokens} new need {need} KV blocks of "
                f"{self.cache.block_size} tokens ({tokens} tokens of K/V), but the cache has {total} blocks in all: "
                f"raise num_blocks (or block_size), or ask for fewer tokens"
            )

    def add(self, request: Request) -> None:
        self.check_fits(len(request.prompt), request.max_new_tokens)
        if self.prefix:  # hashed once, here: no step hashes
            salt = salt_bytes(request.cache_salt)
            if request.mm is not None:  # its images' content too: the placeholder ids are the same for any image
                salt += request.mm.digest
            request.keys = block_keys(request.prompt, self.cache.block_size, salt)
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, request: Request) -> None:
        """Drop ``request`` (finished or cancelled), freeing its blocks at once."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release(request)

    def _release(self, request: Request) -> None:
        """Free ``request``'s blocks and state slot (a preempted one restarts from a zeroed slot)."""
        if request.slot in self.cache.tables:
            self.cache.free(request.slot)
        if self.states is not None and request.slot in self.states.slots:
            self.states.free(request.slot)
        if request in self._filling:
            self._filling.remove(request)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release(request)
        request.computed = request.draft_computed = request.registered = 0
        request.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(request)

    def schedule(self) -> StepPlan:
        """Plan the next step (reserving its blocks); an empty plan when nothing can run."""
        budget = self.max_num_batched_tokens
        cache = self.cache
        chunks: list[tuple[Request, int, int]] = []
        preempted: list[Request] = []
        decoding: list[Request] = []
        prefilling: list[Request] = []
        for r in self.running:
            (decoding if r.length - r.computed == 1 else prefilling).append(r)
        for request in decoding + prefilling if prefilling else decoding:
            if budget == 0:
                break
            if preempted and request not in self.running:  # preempted while planning this step
                continue
            count, extra = self._chunk(request, budget)
            if count == 0:
                continue
            needed = cache.blocks_needed(request.slot, request.computed + count + extra)
            if needed:  # else it holds its blocks already (most decode steps): nothing to reserve
                while needed > cache.num_free_blocks:
                    victim = max(self.running, key=lambda r: r.order)
                    planned = next((c for c in chunks if c[0] is victim), None)
                    if planned is not None:  # give its chunk's tokens back to the budget
                        chunks.remove(planned)
                        budget += planned[2] + self._extra(planned[0], planned[1], planned[2])
                        count, extra = self._chunk(request, budget)
                    self._preempt(victim)
                    preempted.append(victim)
                    if victim is request:
                        break
                    needed = cache.blocks_needed(request.slot, request.computed + count + extra)
                if request in preempted:
                    continue
                cache.reserve(request.slot, request.computed + count + extra)
            chunks.append((request, request.computed, count))
            budget -= count + extra
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_reqs:
            request = self.waiting[0]
            hit = self._lookup(request)
            count, extra = self._chunk(request, budget)
            need = cache.blocks_needed(request.slot, request.computed + count + extra)
            if hit:
                need += cache.blocks_to_attach(hit) - len(hit)
            if count == 0 or need > cache.num_free_blocks:
                request.computed = request.registered = request.draft_computed = 0
                break
            if hit:
                cache.attach(request.slot, hit)
            if request.registered < len(request.keys):
                self._filling.append(request)
            if not request.scheduled:
                request.scheduled = True
                if self.prefix:
                    request.num_cached_tokens = request.computed
                    counters["prefix_cache_hits"] += request.computed
                    counters["prefix_cache_misses"] += len(request.prompt) - request.computed
            cache.reserve(request.slot, request.computed + count + extra)
            self.running.append(self.waiting.popleft())
            chunks.append((request, request.computed, count))
            budget -= count + extra
        return StepPlan(chunks, preempted)

    def _lookup(self, request: Request) -> list[int]:
        """The cached blocks ``request`` (joining, holding none) starts with; its ``computed`` moves past them."""
        if not self.prefix or not request.keys:
            return []
        bs = self.cache.block_size
        hit = self.cache.match(request.keys, request.prompt, (request.length - 1) // bs)  # type: ignore[attr-defined]
        request.computed, request.registered = len(hit) * bs, len(hit)
        request.draft_computed = request.computed  # a drafter's cache holds the same blocks (CachesInStep.match)
        return hit

    def register(self) -> int:
        """Cache the prompt blocks the last step filled (their K/V now written); returns how many were cached.
        Only requests with prompt blocks left to fill are looked at: a decode step past the prompts costs nothing.
        With ``lookahead`` (speculative decoding) a block is cached once both caches hold it (``computed`` and
        ``draft_computed``): prompt blocks only, so never a drafted token."""
        if not self._filling:
            return 0
        bs, done = self.cache.block_size, 0
        for r in list(self._filling):
            written = min(r.computed, r.draft_computed) if self.lookahead else r.computed  # in every cache
            end = min(written // bs, len(r.keys))
            if end > r.registered:
                done += self.cache.register(r.slot, r.keys, r.registered, end, r.prompt)  # type: ignore[attr-defined]
                r.registered = end
            if r.registered == len(r.keys):
                self._filling.remove(r)
        return done

    def _extra(self, request: Request, start: int, count: int) -> int:
        """Drafted tokens a chunk carries after its own: ``lookahead`` for a final chunk, else 0."""
        return self.lookahead if start + count == request.length else 0

    def _chunk(self, request: Request, budget: int) -> tuple[int, int]:
        """``(tokens, drafted tokens after them)`` of ``request``'s next chunk within ``budget``
        (``(0, 0)``: it cannot run in this step)."""
        left = request.length - request.computed
        if left + self.lookahead <= budget:
            return left, self.lookahead
        count = min(left - 1, budget) if self.lookahead else min(left, budget)
        return max(count, 0), 0
