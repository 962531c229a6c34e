"""The serving loop behind :class:`~piecewise_backend.hf.HFEngine`: requests in, steps, tokens out.

:class:`ServingLoop` owns the :class:`~.scheduler.Scheduler` and runs its plans on the engine's
runner: one step lays the scheduled chunks out request after request, runs the model (graph or
eager, as the runner decides), samples the next token of every request whose chunk ends its
sequence (one batched :func:`~.sampling.sample`, one read-back of the step's ids), streams each
token to its request's callback in step order, and finishes requests at their budget or a stop
token, freeing their blocks at once. ``HFEngine.generate`` and the online API (``add_request``,
``cancel_request``, ``step``, ``results``) are both this loop.

Threads: one thread steps (the serving thread); ``add_request`` and ``cancel_request`` may come
from any thread and wait for the step in flight to end (one lock), so they never change a step
while it runs. Captures (``capture_idle``) run on the serving thread between steps too: a CUDA
graph capture in the default (global) capture mode is invalidated by another thread's allocation,
and a step allocates.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import deque
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import torch

from ..modes import CUDAGraphMode
from .arguments import prompt_ids
from .sampling import GREEDY, SamplingParams, noise_key, request_key, resolve_seed, sample
from .scheduler import Request, Scheduler


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """What one engine step ran: token and request counts, whether it was pure decode, the mode,
    and the requests preempted to make room for it (their ids)."""

    step: int
    num_tokens: int
    num_reqs: int
    uniform_decode: bool
    mode: CUDAGraphMode
    preempted: tuple = ()


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """A finished request: its id, prompt, generated ids, and why it ended ("length", "stop", "cancelled")."""

    request_id: Hashable
    prompt: list[int]
    token_ids: list[int]
    finish_reason: str
    preemptions: int = 0  # times it was preempted and recomputed


def _output(request: Request) -> RequestOutput:
    return RequestOutput(
        request.request_id, list(request.prompt), list(request.output), request.finish_reason or "", request.preemptions
    )


def chunk_ends(chunks: Sequence[tuple[Any, int, int]]) -> list[int]:
    """Row of each chunk's last token in the step's token layout."""
    ends, total = [], 0
    for _, _, n in chunks:
        total += n
        ends.append(total - 1)
    return ends


class ServingLoop:
    """Requests, scheduling and steps over one engine's runner and cache (see the module docstring)."""

    def __init__(
        self, runner: Any, cache: Any, vocab_size: int, max_num_reqs: int, max_num_batched_tokens: int, states: Any = None,
    ):
        self.runner = runner
        self.cache = cache
        self.states = states  # the engine's StateCache, None without state layers
        self.vocab_size = vocab_size
        self.scheduler = Scheduler(cache, max_num_reqs, max_num_batched_tokens, states)
        self.lock = threading.RLock()
        self.steps = 0
        self._arrivals = 0
        self._live: dict[Hashable, Request] = {}  # unfinished requests by id
        self._done: deque[RequestOutput] = deque()  # finished or cancelled, not yet returned by step()
        self._next_id = 0

    # ------------------------------------------------------------------ requests

    def check_prompt(self, prompt: Sequence[int], max_new_tokens: int, where: str) -> list[int]:
        """``prompt`` as a list of ids after the engine's up-front checks, or ValueError naming ``where``."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"{where}: max_new_tokens must be a positive int, got {max_new_tokens!r}")
        ids = prompt_ids(prompt, where)  # ints only: a float id is refused, not truncated
        if not ids or len(ids) + max_new_tokens > self.cache.max_model_len:
            raise ValueError(
                f"{where}: {len(ids)} tokens + {max_new_tokens} new must be in 1..max_model_len={self.cache.max_model_len}"
            )
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:  # out of range: IndexError here, a device-side assert inside a CUDA graph
            raise ValueError(f"{where}: token id {bad[0]!r} is outside the vocabulary (ids 0..{self.vocab_size - 1})")
        self.scheduler.check_fits(len(ids), max_new_tokens, where)
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
    ) -> Hashable:
        """Queue a request; returns its id (the next free int when ``request_id`` is None)."""
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams or None, got {type(sampling).__name__}")
        if on_token is not None and not callable(on_token):
            raise TypeError(f"on_token must be callable(request_id, token_id), got {type(on_token).__name__}")
        with self.lock:
            if request_id is None:
                while self._next_id in self._live:
                    self._next_id += 1
                request_id = self._next_id
                self._next_id += 1
            return self.add_internal(prompt, max_new_tokens, sampling, stop_token_ids, request_id, on_token, True).request_id

    def add_internal(
        self, prompt: Sequence[int], max_new_tokens: int, sampling: SamplingParams | None,
        stop_token_ids: Sequence[int] | None, request_id: Hashable, on_token: Callable[[Hashable, int], None] | None,
        report: bool = False,
    ) -> Request:
        """Queue a request under ``request_id``; ``report``: its output goes to :meth:`step`'s results
        (``generate`` reads its requests' outputs itself)."""
        stops = frozenset(stop_token_ids or ())
        if any(isinstance(t, bool) or not isinstance(t, int) for t in stops):
            raise ValueError(f"stop_token_ids must be ints, got {sorted(stops, key=repr)!r}")
        with self.lock:
            if request_id in self._live:
                raise ValueError(f"request id {request_id!r} is already running or waiting; ids must be unique")
            ids = self.check_prompt(prompt, max_new_tokens, f"request {request_id!r}")
            params = sampling or GREEDY
            request = Request(
                request_id, ids, max_new_tokens, params, resolve_seed(params) if not params.greedy else 0,
                request_key(request_id), stops, self._arrivals, on_token, report=report,
            )
            self._arrivals += 1
            self.scheduler.add(request)
            self._live[request_id] = request
            return request

    def cancel(self, request_id: Hashable) -> bool:
        """Stop a request and free its blocks now; False when no such request is unfinished."""
        with self.lock:
            request = self._live.pop(request_id, None)
            if request is None:
                return False
            self.scheduler.remove(request)
            request.finish_reason = "cancelled"
            if request.report:
                self._done.append(_output(request))
            return True

    def has_unfinished(self) -> bool:
        with self.lock:
            return self.scheduler.has_unfinished()

    def cancel_all(self) -> None:
        """Drop every unfinished request (their blocks freed); nothing is reported for them."""
        with self.lock:
            self.scheduler.release_all()
            self._live.clear()

    # ------------------------------------------------------------------ steps

    def step(self) -> list[RequestOutput]:
        """Run one step (when anything is unfinished); returns the requests that finished (or were
        cancelled) since the last call."""
        with self.lock:
            if self.scheduler.has_unfinished():
                self.advance()
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

    def advance(self) -> StepInfo:
        """Plan and run one step; finished requests go to the results queue. Holds the lock."""
        with self.lock:
            plan = self.scheduler.schedule()
            if not plan.chunks:
                raise RuntimeError(  # cannot happen while every request fits the cache alone
                    f"the scheduler found nothing to run with {len(self.scheduler.waiting)} waiting and "
                    f"{len(self.scheduler.running)} running requests, {self.cache.num_free_blocks} free KV blocks"
                )
            chunks = plan.chunks
            layout = [(r.slot, start, count) for r, start, count in chunks]
            tokens = [t for r, start, count in chunks for t in r.tokens(start, count)]
            decode = all(count == 1 for _, _, count in chunks)  # one query token per request: FULL-graph shaped
            meta = self.cache.step_inputs(layout)
            if self.states is not None:  # a new (or preempted) request gets a zeroed slot
                meta.update(self.states.step_inputs(layout))
            ids = torch.tensor(tokens, dtype=torch.long, device=self.cache.device)
            logits = self.runner.run(uniform_decode=decode, num_reqs=len(chunks) if decode else None, input_ids=ids, **meta)
            if self.states is not None:  # the step succeeded: the states it wrote become current
                self.states.commit(slot for slot, _, _ in layout)
            ends = chunk_ends(chunks)
            emit = [(r, end) for (r, start, count), end in zip(chunks, ends) if start + count == r.length]
            for r, start, count in chunks:
                r.computed = start + count
            if emit:
                rows = logits[torch.tensor([end for _, end in emit], device=logits.device)]
                keys = [noise_key(r.seed, r.key, r.length) for r, _ in emit]  # the new token's position
                new = sample(rows, [r.sampling for r, _ in emit], keys).tolist()  # read before any other replay
                for (r, _), token in zip(emit, new):
                    if r.finish_reason is not None:  # cancelled by an earlier callback of this step
                        continue
                    r.output.append(token)
                    if r.on_token is not None:
                        r.on_token(r.request_id, token)
                    if r.finish_reason is None and (len(r.output) >= r.max_new_tokens or token in r.stop_token_ids):
                        self._finish(r, "stop" if token in r.stop_token_ids else "length")
            info = StepInfo(
                self.steps, len(tokens), len(chunks), decode, self.runner.last_mode,
                tuple(r.request_id for r in plan.preempted),
            )
            self.steps += 1
            return info

    def _finish(self, request: Request, reason: str) -> None:
        request.finish_reason = reason
        self.scheduler.remove(request)
        self._live.pop(request.request_id, None)
        if request.report:
            self._done.append(_output(request))
