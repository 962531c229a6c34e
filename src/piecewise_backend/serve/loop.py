"""The serving loop every engine runs: requests in, steps, tokens out.

:class:`ServingLoop` owns the :class:`~.scheduler.Scheduler` and hands each plan to a
:class:`StepExecutor`, which runs the model(s) and says which tokens each scheduled request gained
(:class:`~.model_runner.Decode` samples one per request whose chunk ends its sequence;
speculative decoding keeps the accepted drafts plus one). The loop then appends them, streams each
to its request's callback in step order, and finishes requests at their budget or a stop token,
freeing their blocks at once. ``generate`` and the online API (``add_request``, ``cancel_request``,
``step``, ``results``) are both this loop.

Threads: one thread steps (the serving thread); ``add_request`` and ``cancel_request`` may come
from any thread and wait for the step in flight to end (one lock), so they never change a step
while it runs. Captures (``capture_idle``) run on the serving thread between steps too: a CUDA
graph capture in the default (global) capture mode is invalidated by another thread's allocation,
and a step allocates.

A callback that raises ends its own request (``finish_reason="error"``) after the step's state is
consistent: the step's other requests keep their tokens, and the exception reaches the caller of
``step`` (or ``generate``) once every callback of the step has run. A request whose logits hold a
NaN (the executor reports :data:`~.sampling.NAN_TOKEN` for it) ends the same way, without a token
and without an exception: ``RequestOutput.error`` and a warning name the NaN, and the step's other
requests are served on.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
from collections import deque
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any, Protocol

from ..modes import CUDAGraphMode
from ..runner.agreement import distributed
from .admission import Admission, AdmissionMismatch
from .arguments import check_salt, is_int, prompt_ids
from .sampling import GREEDY, NAN_TOKEN, SamplingParams, request_seed, resolve_seed
from .scheduler import KVBlocks, Request, Scheduler, StepPlan

logger = logging.getLogger(__name__)

@dataclasses.dataclass(frozen=True)
class StepInfo:
    """What one engine step ran: token and request counts, whether it was pure decode, the mode,
    the requests preempted to make room for it (their ids), the tokens each scheduled request
    kept (in step order), and why it ran eagerly when the engine's mode asked for a graph
    (``reason``: one of ``runner.EAGER_REASONS``; "" otherwise)."""

    step: int
    num_tokens: int
    num_reqs: int
    uniform_decode: bool
    mode: CUDAGraphMode
    preempted: tuple = ()
    emitted: tuple[int, ...] = ()
    reason: str = ""


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """A finished request: its id, prompt, generated ids, and why it ended ("length", "stop",
    "cancelled", or "error" when its callback raised or its logits held a NaN; ``error`` says which)."""

    request_id: Hashable
    prompt: list[int]
    token_ids: list[int]
    finish_reason: str
    preemptions: int = 0  # times it was preempted and recomputed
    error: str = ""  # what ended it with finish_reason "error"
    num_cached_tokens: int = 0  # prompt tokens it reused from the prefix cache when first scheduled


@dataclasses.dataclass
class Executed:
    """What a step produced: the new tokens of each chunk of the plan (in its order; empty for a
    chunk that ends no sequence), the tokens the step ran, whether it was uniform decode, the
    target model's runtime mode, and why it ran eagerly (``StepResult.reason``)."""

    tokens: list[list[int]]
    num_tokens: int
    uniform_decode: bool
    mode: CUDAGraphMode
    reason: str = ""
    #: chunks (indices in the plan) whose request cannot be served, and why: each ends with "error"
    failed: dict[int, str] = dataclasses.field(default_factory=dict)


class StepExecutor(Protocol):
    """Runs a planned step on the model(s): updates each request's ``computed`` (and the caches) and
    returns the tokens it produced. ``kept`` is told how many of them each request kept (cut at a
    stop token or its budget), after the loop appended them."""

    def execute(self, plan: StepPlan) -> Executed: ...

    def kept(self, plan: StepPlan, executed: Executed, kept: list[int]) -> None: ...


def text_only(prompt: list[int], mm_inputs: Any, where: str) -> None:
    """:attr:`ServingLoop.multimodal` of a text-only model: any ``mm_inputs`` refused."""
    if mm_inputs is not None:
        raise ValueError(f"{where}: mm_inputs given, but this engine serves a text-only model (mm_inputs are for "
                         "hf.HFEngine over an image-text-to-text model)")


def _output(request: Request) -> RequestOutput:
    return RequestOutput(
        request.request_id, list(request.prompt), list(request.output), request.finish_reason or "", request.preemptions,
        request.error, request.num_cached_tokens,
    )


def chunk_ends(chunks: Sequence[tuple[Any, int, int]]) -> list[int]:
    """Row of each chunk's last token in the step's token layout."""
    ends, total = [], 0
    for _, _, n in chunks:
        total += n
        ends.append(total - 1)
    return ends


@dataclasses.dataclass(frozen=True)
class _Own:
    """The request id of a ``generate`` prompt: never equal to an id the online API hands out or takes."""

    call: int
    index: int


class ServingLoop:
    """Requests, scheduling and steps over one engine's executor and cache (see the module docstring)."""

    def __init__(
        self, executor: StepExecutor, cache: KVBlocks, vocab_size: int, max_num_reqs: int, max_num_batched_tokens: int,
        states: Any = None, lookahead: int = 0, prefix: bool = False,
    ):
        self.executor = executor
        self.cache = cache
        self.vocab_size = vocab_size
        self.scheduler = Scheduler(cache, max_num_reqs, max_num_batched_tokens, states, lookahead, prefix)
        self.lookahead = lookahead
        self.lock = threading.RLock()
        self._serving: str | None = None  # the call whose steps run now ("generate()", "step()"): no re-entry
        self.steps = 0
        self._arrivals = 0
        self._live: dict[Hashable, Request] = {}  # unfinished requests by id
        self._done: deque[RequestOutput] = deque()  # finished or cancelled, not yet returned by step()
        self._next_id = 0
        self._calls = itertools.count()  # generate() calls: their requests' ids
        #: called at the start of every step, before it is planned (the engine's lazy catch-up)
        self.before_step: Callable[[], None] | None = None
        #: ``(prompt ids, mm_inputs, where) -> what a request keeps of them``: admits a request's multimodal
        #: inputs (an engine over an image-text-to-text model sets it); the default serves text only
        self.multimodal: Callable[[list[int], Any, str], Any] = text_only
        #: under tensor parallelism: the requests added since the last step, checked across ranks before the next
        self._admission = Admission() if distributed() else None

    # ------------------------------------------------------------------ requests

    def check_prompt(self, prompt: Sequence[int], max_new_tokens: int, where: str) -> list[int]:
        """``prompt`` as a list of ids after the engine's up-front checks, or ValueError naming ``where``."""
        if not is_int(max_new_tokens) or max_new_tokens < 1:
            raise ValueError(f"{where}: max_new_tokens must be a positive int, got {max_new_tokens!r}")
        ids = prompt_ids(prompt, where)  # ints only: a float id is refused, not truncated
        reserve = self.lookahead - 1 if self.lookahead else 0
        extra = f" + {reserve} (speculative tokens - 1)" if reserve else ""
        if not ids or len(ids) + max_new_tokens + reserve > self.cache.max_model_len:
            raise ValueError(
                f"{where}: {len(ids)} tokens + {max_new_tokens} new{extra} must be in "
                f"1..max_model_len={self.cache.max_model_len}"
            )
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:  # out of range: IndexError here, a device-side assert inside a CUDA graph
            raise ValueError(f"{where}: token id {bad[0]!r} is outside the vocabulary (ids 0..{self.vocab_size - 1})")
        self.scheduler.check_fits(len(ids), int(max_new_tokens), where)
        return ids

    def add(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        *,
        sampling: SamplingParams | None = None,
        stop_token_ids: Sequence[int] | None = None,
        request_id: Hashable | None = None,
        on_token: Callable[[Hashable, int], None] | None = None,
        cache_salt: str | None = None,
        mm_inputs: Any = None,
    ) -> Hashable:
        """Queue a request; returns its id (the next free int when ``request_id`` is None; a refused
        request uses none up). ``mm_inputs``: its multimodal inputs (:attr:`multimodal` admits them)."""
        check_salt(cache_salt)
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams or None, got {type(sampling).__name__}")
        if on_token is not None and not callable(on_token):
            raise TypeError(f"on_token must be callable(request_id, token_id), got {type(on_token).__name__}")
        if isinstance(request_id, bool) or isinstance(request_id, _Own):
            raise ValueError(f"request_id must be None, an int or another hashable that is not a bool, got {request_id!r}"
                             " (True would be the id 1)")
        with self.lock:
            given = request_id is not None
            if not given:
                while self._next_id in self._live:
                    self._next_id += 1
                request_id = self._next_id
            request = self.add_internal(prompt, max_new_tokens, sampling, stop_token_ids, request_id, on_token, True,
                                        cache_salt=cache_salt, mm_inputs=mm_inputs)
            if not given:
                self._next_id += 1
            return request.request_id

    def add_internal(
        self, prompt: Sequence[int], max_new_tokens: int, sampling: SamplingParams | None,
        stop_token_ids: Sequence[int] | None, request_id: Hashable, on_token: Callable[[Hashable, int], None] | None,
        report: bool = False, tag: Hashable = None, seen: dict[tuple[int, ...], int] | None = None,
        cache_salt: str | None = None, mm_inputs: Any = None,
    ) -> Request:
        """Queue a request under ``request_id``; ``report``: its output goes to :meth:`step`'s results
        (``generate`` reads its requests' outputs itself); ``tag``: what its callbacks call it; ``seen``:
        how often each (seed, prompt) came before in this ``generate`` call (updated here): the request's
        occurrence in :func:`~.sampling.request_seed` (an online request is occurrence 0); ``cache_salt``: its
        prefix-cache salt (checked by the caller)."""
        stops = frozenset(stop_token_ids or ())
        if any(not is_int(t) for t in stops):
            raise ValueError(f"stop_token_ids must be ints, got {sorted(stops, key=repr)!r}")
        with self.lock:
            if request_id in self._live:
                raise ValueError(f"request id {request_id!r} is already running or waiting; ids must be unique")
            where = f"request {request_id if tag is None else tag!r}"
            ids = self.check_prompt(prompt, max_new_tokens, where)
            mm = self.multimodal(ids, mm_inputs, where)
            params = sampling or GREEDY
            seed = 0
            if not params.greedy:
                seed, occurrence = resolve_seed(params), 0
                if seen is not None:  # only the same prompt with the same seed would share noise
                    occurrence = seen.get((seed, *ids), 0)
                    seen[(seed, *ids)] = occurrence + 1
                seed = request_seed(seed, ids, occurrence)
            request = Request(
                request_id, ids, int(max_new_tokens), params, seed,
                frozenset(int(t) for t in stops), self._arrivals, on_token, report=report, tag=tag, cache_salt=cache_salt,
                mm=mm,
            )
            self._arrivals += 1
            self.scheduler.add(request)
            self._live[request_id] = request
            if self._admission is not None:
                self._admission.note(request)
            return request

    def cancel(self, request_id: Hashable) -> bool:
        """Stop a request and free its blocks now; False when no such request is unfinished."""
        with self.lock:
            request = self._live.get(request_id)
            if request is None or not request.report:  # generate()'s own requests are not the online API's
                return False
            self._finish(request, "cancelled")
            return True

    def has_unfinished(self) -> bool:
        with self.lock:
            return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ generate

    def generate(
        self,
        prompts: Sequence[list[int]],
        budgets: Sequence[int],
        params: Sequence[SamplingParams],
        stops: Sequence[int],
        on_token: Callable[[int, int], None] | None = None,
        on_step: Callable[[StepInfo], None] | None = None,
        salts: Sequence[str | None] | None = None,
        mm_inputs: Sequence[Any] | None = None,
    ) -> list[list[int]]:
        """Serve ``prompts`` as one batch and return their outputs in order; ``on_token``, ``on_step`` and
        ``salts`` (one cache salt per prompt, checked; None: none) as in ``Engine.generate``. Requests of the online API are left alone (served
        along when added meanwhile); only this call's own are dropped after an error."""
        if on_token is not None and not callable(on_token):
            raise TypeError(f"on_token must be callable(request_index, token_id), got {type(on_token).__name__}")
        with self.lock:
            self._refuse_reentry("generate()")
            if self.has_unfinished():
                raise RuntimeError(
                    "generate() serves a batch of its own, but requests added with add_request() are unfinished: "
                    "iterate results() or cancel_request() them first"
                )
            call = next(self._calls)
            requests: list[Request] = []
            self.steps = 0
            self._serving = "generate()"
            try:
                seen: dict[tuple[int, ...], int] = {}  # identical (seed, prompt)s: occurrence 0, 1, ...
                for i, p in enumerate(prompts):
                    requests.append(
                        self.add_internal(p, budgets[i], params[i], stops, _Own(call, i), on_token, tag=i, seen=seen,
                                          cache_salt=salts[i] if salts is not None else None,
                                          mm_inputs=None if mm_inputs is None else mm_inputs[i])
                    )
                while any(r.finish_reason is None for r in requests):
                    info = self.advance(report=on_step is not None)
                    if on_step is not None:
                        on_step(info)  # type: ignore[arg-type]
            finally:  # an error mid-way must not leak the blocks of this call's requests
                self._serving = None
                for r in requests:
                    if r.finish_reason is None:
                        self._finish(r, "cancelled")
            return [r.output for r in requests]

    def _refuse_reentry(self, name: str) -> None:
        """Refuse ``name`` called from a callback of a call serving steps now (the lock is held, so the
        caller is the stepping thread)."""
        if self._serving is not None:
            raise RuntimeError(
                f"{name} called from inside {self._serving} (from an on_token or on_step callback): a re-entrant "
                "call is refused; add_request() or cancel_request() from a callback instead"
            )

    # ------------------------------------------------------------------ steps

    def step(self) -> list[RequestOutput]:
        """Run one step (when anything is unfinished); returns the requests that finished (or were
        cancelled) since the last call."""
        with self.lock:
            if self.scheduler.has_unfinished():
                self._refuse_reentry("step()")
                self._serving = "step()"
                try:
                    self.advance(report=False)
                finally:
                    self._serving = None
            if not self._done:
                return []
            done = list(self._done)
            self._done.clear()
            return done

    def results(self) -> Iterator[RequestOutput]:
        """Step until no request is unfinished, yielding each request as it finishes (requests added
        meanwhile, from callbacks or other threads, are served too)."""
        while True:
            yield from self.step()
            with self.lock:
                if not self.scheduler.has_unfinished() and not self._done:
                    return

    def advance(self, report: bool = True) -> StepInfo | None:
        """Plan and run one step; finished requests go to the results queue. Holds the lock.
        Returns what it ran (None with ``report=False``: :meth:`step` has no one to tell)."""
        with self.lock:
            if self.before_step is not None:
                self.before_step()
            if self._admission is not None:
                self._check_admission()
            plan = self.scheduler.schedule()
            if not plan.chunks:
                raise RuntimeError(  # cannot happen while every request fits the cache alone
                    f"the scheduler found nothing to run with {len(self.scheduler.waiting)} waiting and "
                    f"{len(self.scheduler.running)} running requests, {self.cache.num_free_blocks} free KV blocks"
                )
            executed = self.executor.execute(plan)
            self.scheduler.register()  # before _emit frees finished requests' blocks
            kept, error = self._emit(plan, executed)
            self.executor.kept(plan, executed, kept)
            info = StepInfo(
                self.steps, executed.num_tokens, len(plan.chunks), executed.uniform_decode, executed.mode,
                tuple([r.request_id for r in plan.preempted]), tuple(kept), executed.reason,
            ) if report else None
            self.steps += 1
            if error is not None:
                raise error
            return info

    def _emit(self, plan: StepPlan, executed: Executed) -> tuple[list[int], BaseException | None]:
        """Append each request's new tokens (cut at a stop token or its budget), stream them, and
        finish requests; returns the tokens each chunk kept and the first callback error."""
        kept: list[int] = []
        error: BaseException | None = None
        if executed.failed:
            for i, why in executed.failed.items():
                r = plan.chunks[i][0]
                if r.finish_reason is None:
                    r.error = why
                    logger.warning("request %r ends with finish_reason='error': %s", r.tag, why)
                    self._finish(r, "error")
        for (r, _, _), tokens in zip(plan.chunks, executed.tokens):
            n = 0
            for token in tokens:
                if r.finish_reason is not None:  # cancelled (or failed) by a callback of this step
                    break
                if token == NAN_TOKEN:
                    self._fail_nan(r)
                    break
                r.output.append(token)
                n += 1
                stop = token in r.stop_token_ids
                if stop or len(r.output) >= r.max_new_tokens:
                    self._finish(r, "stop" if stop else "length")
                if r.on_token is not None:
                    try:
                        r.on_token(r.tag, token)
                    except Exception as e:  # noqa: BLE001 (re-raised once the step's state is consistent)
                        if r.finish_reason is None:
                            r.error = f"its on_token callback raised {type(e).__name__}: {e}"
                            self._finish(r, "error")
                        error = error or e
            kept.append(n)
        return kept, error

    def _fail_nan(self, request: Request) -> None:
        """End ``request`` with ``finish_reason="error"``: the model's logits for its next token held a NaN."""
        drafts = f", or for one of its {self.lookahead} drafts after it," if self.lookahead else ""
        request.error = (
            f"the model's logits for its token at position {request.length}{drafts} hold NaN (after "
            f"{len(request.output)} generated tokens): no token can be sampled from them"
        )
        logger.warning("request %r ends with finish_reason='error': %s", request.tag, request.error)
        self._finish(request, "error")

    def _check_admission(self) -> None:
        """Every rank added the same requests since the last step; else each is ended with ``"error"`` on every
        rank and the step raises (:mod:`.admission`)."""
        try:
            self._admission.check()  # type: ignore[union-attr]
        except AdmissionMismatch as e:
            for r in e.requests:
                if r.finish_reason is None:
                    r.error = str(e)
                    self._finish(r, "error")
            raise

    def _finish(self, request: Request, reason: str) -> None:
        request.finish_reason = reason
        self.scheduler.remove(request)
        self._live.pop(request.request_id, None)
        if request.report:
            self._done.append(_output(request))
