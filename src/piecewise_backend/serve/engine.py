"""The engine for any model that follows the protocol: continuous batching on CUDA graphs.

The protocol (docs/engine.md has a complete example): ``model(input_ids=(T,) long,
position_ids=(T,) long) -> logits (T, vocab)`` for one flat step, every request's tokens one after
the other; attention through ``torch.ops.pb_kv.paged_attention`` (or an op of the model's own,
registered as a splitting op, that reads ``kv.current_metadata()``), state layers through the state
ops. :class:`Engine` compiles the model with ``make_backend(config)`` (with ``compile_pieces="none"`` it serves
it uncompiled), builds its paged KV cache
from ``kv_layout`` (and a state cache from ``state_specs``) in the dtype and device of its first
parameter, and serves requests: steps with prompt tokens replay PIECEWISE graphs, pure decode steps
one FULL graph; chunked prefill, preemption, sampling, streaming, the online API and lazy capture
are the :mod:`.loop`'s and the GraphRunner's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import torch

from ..config import CompilationConfig
from ..context import BatchDescriptor
from ..modes import CUDAGraphMode
from ..runner import CaptureReport
from ..runner.agreement import distributed, gather_ints
from ..state.cache import StateSpec
from .arguments import (
    EngineArgs,
    cache_salts,
    check_config,
    check_generate,
    check_tokens_budget,
    check_vocab,
    engine_args,
    eos_ids,
    takes_engine_args,
)
from .loop import RequestOutput, ServingLoop, StepExecutor, StepInfo
from .model_runner import Decode, KVLayout, ModelRunner
from .sampling import SamplingParams, per_request
from .token_rules import TokenRules
from .scheduler import KVBlocks


logger = logging.getLogger(__name__)
_said: set[str] = set()  # why prefix caching was turned off, said once per process each

#: A lazy engine's default ``step_capture_budget_s``: what a step may add to its latency to catch up.
STEP_CAPTURE_BUDGET_S = 0.05


class Engine:
    """Continuous batching of ``model`` (the protocol of the module docstring) on a GraphRunner with a
    paged KV cache.

    ``lazy_capture=True`` serves from the first call (a step without a graph runs eagerly) and
    :meth:`capture_idle` captures what traffic asked for; ``max_num_batched_tokens`` bounds every
    step's tokens (default: the largest capture size), longer prompts are prefilled in chunks;
    ``graph_memory_budget`` bounds the bytes the engine's graphs add to the graph pool;
    ``eos_token_id`` (an int or a list of ints) is the stop token ``generate`` and ``add_request``
    use when they are given none. ``step_capture_budget_s``: seconds a step of a lazy engine may
    spend on average, before it runs, compiling and capturing graphs traffic asked for (None: 0.05
    with ``lazy_capture``, else 0; 0: only ``capture_idle`` compiles and captures); a start costlier
    than one step's budget waits for the credit of the steps before it (:meth:`_catch_up`). A lazy
    engine serves uncompiled until the first compile.
    """

    @takes_engine_args()
    def __init__(
        self,
        model: torch.nn.Module,
        config: CompilationConfig,
        *,
        kv_layout: KVLayout,
        vocab_size: int,
        state_specs: Sequence[StateSpec] | None = None,
        args: EngineArgs | None = None,
        **engine_kwargs: Any,
    ):
        """The engine arguments (``max_num_reqs`` ... ``step_capture_budget_s``: :class:`.arguments.EngineArgs`'
        fields) come as keywords, or as ``args=EngineArgs(...)`` (keywords given beside it replace its fields)."""
        args = engine_args("Engine", args, engine_kwargs)
        check_config(config)
        no_images(args)
        if not isinstance(kv_layout, KVLayout):
            raise TypeError(f"kv_layout must be a serve.KVLayout(num_layers, num_kv_heads, head_dim), got "
                            f"{type(kv_layout).__name__}")
        vocab_size = check_vocab(vocab_size)
        specs = list(state_specs or ())
        if any(not isinstance(s, StateSpec) for s in specs):
            raise TypeError("state_specs must be StateSpecs (piecewise_backend.state.StateSpec), one per state the "
                            "model's state layers keep")
        args.check_model(model)
        eos = args.stop_tokens(vocab_size)  # refused before anything is built
        if args.token_rules:
            args.token_rules.check(vocab_size)
        main = ModelRunner(model, config, kv_layout=kv_layout, args=args, state_specs=specs, vocab_size=vocab_size)
        self.model = model
        self._start(args, [main], Decode(main, args.token_rules), main.cache, main.states, vocab_size=vocab_size,
                    eos_token_id=eos)

    def _start(
        self, args: EngineArgs, model_runners: Sequence[ModelRunner], executor: StepExecutor, blocks: KVBlocks,
        states: Any, *, vocab_size: int, eos_token_id: frozenset[int], lookahead: int = 0,
        max_num_batched_tokens: int | None = None, token_rules: TokenRules | None = None, images: bool = False,
    ) -> None:
        """Every engine's constructor ends here, with its arguments checked and its model runners built:
        the serving loop over ``executor``, which plans ``blocks`` (and frees ``states``) for its requests.
        ``max_num_batched_tokens``: the step's token budget when the engine chose one (default:
        ``args``', else the largest capture size, else ``max_model_len``: a whole prompt); ``token_rules``:
        the rules ``executor`` applies (``args``' unless the engine chose others); ``images``: the engine serves
        an image-text-to-text model (``encoder_token_budgets`` are its)."""
        if not images:
            no_images(args)
        #: the engine's arguments, checked (a :class:`~.arguments.EngineArgs`)
        self.args = args
        #: the per-token rules every step's logits get (a :class:`~.token_rules.TokenRules`; None: none)
        self.token_rules = (token_rules if token_rules is not None else args.token_rules) or None
        #: the :class:`~.model_runner.ModelRunner` of each model (a speculative engine: the target's, then the drafter's)
        self.model_runners = list(model_runners)
        main = self.model_runners[0]
        self.runner, self.cache, self.states, self.backend = main.runner, main.cache, main.states, main.backend
        self.attention_backend = main.attention_backend
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        lazy = any(m.runner.lazy_capture for m in self.model_runners)
        budget_s = args.step_capture_budget_s
        #: Seconds a step of a lazy engine may spend capturing graphs traffic asked for, before it runs
        #: (``capture_idle`` within that slice; 0: never). Default: :data:`STEP_CAPTURE_BUDGET_S` with
        #: ``lazy_capture=True``, else 0.
        self.step_capture_budget_s = float((STEP_CAPTURE_BUDGET_S if lazy else 0.0) if budget_s is None else budget_s)
        self.max_num_reqs, self.max_model_len = args.max_num_reqs, args.max_model_len
        self.max_step_tokens = main.runner.dispatcher.max_size
        budget = max_num_batched_tokens or args.max_num_batched_tokens or self.max_step_tokens or args.max_model_len
        off = prefix_caching_off(args, states, lookahead)
        if off and args.enable_prefix_caching and off not in _said:
            _said.add(off)
            logger.warning("prefix caching is off for this engine: %s (tokens are exact, prompts are computed whole)", off)
        #: whether requests reuse cached prompt blocks (``enable_prefix_caching``, unless the model cannot)
        self.prefix_caching = not off
        check_prefix_agreement(args.enable_prefix_caching, self.prefix_caching)
        self._loop = ServingLoop(executor, blocks, vocab_size, args.max_num_reqs, budget, states, lookahead,
                                 self.prefix_caching)
        self._loop.before_step = self._catch_up
        self._capture_credit = 0.0  # catch-up seconds accrued and not spent (see _catch_up)

    def _catch_up(self) -> None:
        """Before a step: capture demanded graphs within ``step_capture_budget_s`` (a lazy engine under
        continuous traffic converges to captured speed without the caller finding idle time).

        The budget is an average: every step with demand adds ``step_capture_budget_s`` to a credit, the
        step's slice is the credit, and what the captures took is taken off it. A start that costs more
        than one step's budget (the compile before the first capture: Dynamo's trace and the pieces, which
        cannot be cut short; a capture slower than the budget, as on the simulator) waits until the credit
        accrued covers its predicted cost, and that one step pays it: with a ~1.5 s compile predicted at
        2 s and 0.05 s a step, 40 steps run eagerly, then one compiles. The credit never exceeds the
        costliest start the demand waits for plus one step's budget, so it cannot pile up into a long burst of captures."""
        budget = self.step_capture_budget_s
        if budget <= 0 or distributed():  # ranks would capture different graphs (capture_idle refuses it)
            return
        wanting = [m for m in self.model_runners if m.runner.demand]
        if not wanting:
            self._capture_credit = 0.0
            return
        cap = budget + max(m.runner.pending_capture_seconds for m in wanting)  # never a burst beyond that
        self._capture_credit = min(self._capture_credit + budget, cap)
        began = time.perf_counter()
        deadline = began + self._capture_credit
        for m in wanting:
            with torch.inference_mode():
                m.runner.capture_idle(max(0.0, deadline - time.perf_counter()))
        self._capture_credit = max(0.0, self._capture_credit - (time.perf_counter() - began))

    def reset_prefix_cache(self) -> int:
        """Drop every cached prompt block (after a weight update the cached K/V is stale): returns how many
        blocks no request held were freed; blocks in use are no longer found and are freed when released."""
        with self._loop.lock:
            return sum(m.cache.reset_prefix_cache() for m in self.model_runners)

    def default_eos(self) -> Any:
        """The stop token(s) used when ``generate`` or ``add_request`` is given none."""
        return sorted(self.eos_token_id)

    @property
    def max_num_batched_tokens(self) -> int:
        """The most tokens a step runs; a longer prompt is prefilled in chunks over several steps."""
        return self._loop.scheduler.max_num_batched_tokens

    @max_num_batched_tokens.setter
    def max_num_batched_tokens(self, value: int) -> None:
        check_tokens_budget(value)
        self._loop.scheduler.max_num_batched_tokens = value

    # ------------------------------------------------------------------ graphs

    def capture(self, progress: bool = False) -> CaptureReport:
        """Capture every descriptor (within ``graph_memory_budget`` when set), under inference mode."""
        with torch.inference_mode():
            return self.runner.capture(progress=progress)

    def capture_idle(self, max_seconds: float, *, retry_failed: bool = False) -> list[tuple[CUDAGraphMode, BatchDescriptor]]:
        """Capture, within ``max_seconds`` and ``graph_memory_budget``, the graphs steps ran without;
        returns the ``(mode, descriptor)`` pairs captured. Call it between steps (when idle), on the
        thread that steps: a capture must never overlap a step (see :mod:`.loop`). A failed compile or
        capture is not tried again (``runner.capture_failures``) unless ``retry_failed=True``."""
        if not isinstance(max_seconds, (int, float)) or isinstance(max_seconds, bool) or not max_seconds >= 0:
            raise ValueError(f"capture_idle: max_seconds must be a number of seconds >= 0, got {max_seconds!r}")
        if retry_failed is not True and retry_failed is not False:
            raise ValueError(f"capture_idle: retry_failed must be a bool, got {retry_failed!r}")
        captured: list[tuple[CUDAGraphMode, BatchDescriptor]] = []
        deadline = time.perf_counter() + max_seconds
        with self._loop.lock, torch.inference_mode():
            for m in self.model_runners:
                captured += m.runner.capture_idle(max(0.0, deadline - time.perf_counter()), retry_failed=retry_failed)
        return captured

    def estimate_capture_memory(self) -> int:
        """Bytes :meth:`capture` will add to the graph pool, measured before capturing (with several
        models, their estimates summed: an upper bound, the later ones may reuse the pool)."""
        with torch.inference_mode():
            return sum(m.runner.estimate_capture_memory() for m in self.model_runners)

    # ------------------------------------------------------------------ the online API

    def add_request(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        *,
        sampling: SamplingParams | None = None,
        stop_token_ids: int | Sequence[int] | None = None,
        request_id: Hashable | None = None,
        on_token: Callable[[Hashable, int], None] | None = None,
        cache_salt: str | None = None,
        mm_inputs: dict[str, Any] | None = None,
    ) -> Hashable:
        """Queue a request while others run (any thread); returns its id (default: the next free int).

        It joins the next step that has room. ``stop_token_ids`` end it (the stop token is kept), as
        :meth:`generate`'s ``eos_token_id``: an int or a list of ints (``[]``: none); None: the
        engine's default. ``on_token(request_id, token_id)`` is called as each of its tokens is produced.
        ``cache_salt`` (a str or None): with prefix caching, it shares cached prompt blocks only with
        requests of an equal salt (None with None), e.g. one salt per tenant.
        ``mm_inputs``: the images of its prompt, as the model's own keyword inputs (``pixel_values``,
        ``image_grid_thw``, ...: what its processor returns for this prompt); copied here, checked
        against the prompt's image tokens (an image-text-to-text model on :class:`~piecewise_backend.hf.HFEngine`).
        """
        stops = eos_ids(stop_token_ids, self.default_eos(), vocab_size=self.vocab_size, name="stop_token_ids")
        return self._loop.add(
            prompt, max_new_tokens, sampling=sampling, stop_token_ids=sorted(stops), request_id=request_id,
            on_token=on_token, cache_salt=cache_salt, mm_inputs=mm_inputs,
        )

    def cancel_request(self, request_id: Hashable) -> bool:
        """Stop a request and free its KV blocks at once; False when no such request is unfinished.
        The next :meth:`step` (or :meth:`results`) reports it with ``finish_reason="cancelled"``."""
        return self._loop.cancel(request_id)

    def step(self) -> list[RequestOutput]:
        """Run one step of the added requests; returns those that finished since the last call."""
        with torch.inference_mode():
            return self._loop.step()

    def results(self) -> Iterator[RequestOutput]:
        """Step until every added request has finished, yielding each one as it finishes."""
        yield from _inference(self._loop.results())

    def has_unfinished_requests(self) -> bool:
        return self._loop.has_unfinished()

    has_unfinished = has_unfinished_requests

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int | Sequence[int],
        *,
        eos_token_id: int | Sequence[int] | None = None,
        sampling: SamplingParams | Sequence[SamplingParams | None] | None = None,
        on_token: Callable[[int, int], None] | None = None,
        on_step: Callable[[StepInfo], None] | None = None,
        cache_salt: str | None | Sequence[str | None] = None,
        mm_inputs: Sequence[dict[str, Any] | None] | None = None,
    ) -> list[list[int]]:
        """Completions of ``prompts`` (token ids, without the prompt), in order; greedy unless ``sampling``.

        ``sampling``: one :class:`SamplingParams` for all, or one per prompt (None: greedy).
        ``on_token(request_index, token_id)`` is called as each token is produced, in order;
        ``on_step`` gets a :class:`StepInfo` per step. Every step schedules the running requests'
        decode tokens first, then prompt chunks, within ``max_num_batched_tokens`` and
        ``max_num_reqs``; when KV blocks run out the newest requests are preempted and recomputed.
        A request stops at its budget or at a token of ``eos_token_id`` (an int or a list of ints;
        ``[]``: none; None: the engine's default). ``cache_salt``: one for all or one per prompt, and
        ``mm_inputs``: one dict (or None) per prompt, as
        :meth:`add_request`'s.
        """
        reserve = self._loop.lookahead - 1 if self._loop.lookahead else 0
        args = check_generate(prompts, max_new_tokens, vocab_size=self.vocab_size,
                              max_model_len=self._loop.cache.max_model_len, eos_token_id=eos_token_id,
                              default_eos=self.default_eos(), reserve=reserve,
                              reserve_reason="speculative tokens - 1" if reserve else "")
        params = per_request(sampling, len(args.prompts))
        salts = cache_salts(cache_salt, len(args.prompts))
        if mm_inputs is not None and (not isinstance(mm_inputs, (list, tuple)) or len(mm_inputs) != len(args.prompts)):
            raise ValueError(f"generate: mm_inputs must be a list of one dict (or None) per prompt ({len(args.prompts)}), "
                             f"got {type(mm_inputs).__name__}"
                             + (f" of {len(mm_inputs)}" if isinstance(mm_inputs, (list, tuple)) else ""))
        with torch.inference_mode():
            return self._loop.generate(args.prompts, args.budgets, params, sorted(args.eos), on_token, on_step, salts,
                                       mm_inputs)


def no_images(args: EngineArgs) -> None:
    """Refuse ``encoder_token_budgets`` for an engine of a text-only model."""
    if args.encoder_token_budgets is not None:
        raise ValueError(f"encoder_token_budgets={list(args.encoder_token_budgets)} is for an image-text-to-text "
                         "model's encoder graphs; this engine serves a text-only model")


def prefix_caching_off(args: EngineArgs, states: Any, lookahead: int = 0) -> str:
    """Why an engine serves with prefix caching off ("" when it is on); speculative decoding (``lookahead``) composes."""
    if not args.enable_prefix_caching:
        return "enable_prefix_caching=False"
    if states is not None:
        return "the model has state layers, whose states are not cached at block boundaries"
    return ""


def check_prefix_agreement(enabled: bool, on: bool) -> None:
    """In a process group, raise on every rank when the ranks differ on ``enable_prefix_caching`` or on whether
    caching is on: a rank reusing blocks another recomputes would run other steps (wrong tokens, or a hang)."""
    if not distributed():
        return
    seen = gather_ints((int(enabled), int(on)))
    if len(set(seen)) > 1:
        per_rank = ", ".join(f"rank {r}: enable_prefix_caching={bool(e)} (on: {bool(o)})" for r, (e, o) in enumerate(seen))
        raise ValueError(f"tensor parallel: the ranks were given different prefix caching settings ({per_rank}); every "
                         "rank must build its engine with the same enable_prefix_caching and model")


def _inference(results: Iterator[RequestOutput]) -> Iterator[RequestOutput]:
    """``results`` with every step (each ``next``) under inference mode, but not the caller's loop body."""
    while True:
        with torch.inference_mode():
            out = next(results, None)
        if out is None:
            return
        yield out
