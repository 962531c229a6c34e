"""GraphRunner: the engine-facing object that pads, dispatches, captures and replays.

Its parts, each a module of its own: :class:`~.buffers.StepBuffers` owns one persistent buffer
per input and the views of them a step reads (every step copies its batch there, so graphs always
read the addresses they captured); :class:`~.step.ModelStep` runs the wrapped model once on such
views, plain or micro-batched, for a step as for a warm-up or a capture; capture planning
(:mod:`.orchestration`, :mod:`.lazy`) takes those two, not the runner; :mod:`.ubatch_step` splits a
step in halves. The runner holds the state a step consults (dispatcher, lazy demand, whether
capture is closed) and the one step path of :meth:`GraphRunner.run`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_map

from ..capture.memory import graphs_created
from ..config import CompilationConfig
from ..context import BatchDescriptor
from ..modes import AttentionGraphSupport, CUDAGraphMode
from ..observability import logger
from ..platforms.registry import effective_mode
from . import agreement as _parallel
from . import ubatch_step as _ubatch
from .assembly import clear_graphs, resolve_cudagraph_mode, validate_capture_coverage, wrap_model
from .buffers import StepBuffers
from .dispatcher import CudagraphDispatcher
from .lazy import Key, LazyCapture, capture_within
from .orchestration import CaptureReport, capture_all, estimate_memory
from .static_inputs import (
    StaticInput,
    check_context,
    check_full_context,
    check_request_rows,
    check_tensor,
    fits,
    input_names,
    step_counts,
)
from .step import ContextFn, ModelStep

__all__ = ["CaptureReport", "GraphRunner", "StaticInput", "StepResult"]  # CaptureReport, StaticInput: imported from here too


@dataclasses.dataclass(frozen=True, slots=True)
class StepResult:
    """What :meth:`GraphRunner.run_step` did: the step's unpadded ``output``, the ``mode`` it ran in (NONE:
    eagerly), the ``descriptor`` of the graph it replayed (or of the eager step) and whether it was
    micro-batched (``ubatched``)."""

    output: Any
    mode: CUDAGraphMode
    descriptor: BatchDescriptor
    ubatched: bool = False


class GraphRunner:
    """Run ``model`` step by step under the CUDA graphs ``config`` asks for.

    ``inputs`` describe the model's tensors (per token or per request); ``model_args`` name
    those passed positionally and ``model_kwargs`` those passed as keywords (both None: all
    positionally, in order); ``context_fn`` turns the step's padded views into
    forward-context attributes such as attention metadata, during capture as on every step.
    ``attention_backend`` names the attention the model runs (reported, e.g. in the capture log);
    ``attention_support`` is what that attention lets a FULL graph hold.

    ``lazy_capture=True`` serves before any capture: a step whose descriptor has no graph runs
    eagerly and counts as demand, and :meth:`capture_idle` captures what was asked for in the
    time it is given (:mod:`.lazy`). ``graph_memory_budget`` (bytes this runner's graphs may add
    to the pool) bounds :meth:`capture` and :meth:`capture_idle`; with it, too, no step captures.
    ``eager_model`` (with ``lazy_capture``): ``model`` uncompiled (``model`` being its
    ``torch.compile``): steps run it until :meth:`capture_idle` compiles, so the first steps wait
    for no Dynamo trace (:attr:`needs_compile`, :mod:`.lazy`).
    """

    def __init__(
        self,
        model: Any,
        config: CompilationConfig | None,
        inputs: Sequence[StaticInput],
        *,
        model_args: Sequence[str] | None = None,
        model_kwargs: Sequence[str] | None = None,
        context_fn: Callable[[dict[str, torch.Tensor]], dict[str, Any]] | None = None,
        max_num_reqs: int | None = None,
        attention_support: AttentionGraphSupport = AttentionGraphSupport.ALWAYS,
        attention_split: bool = True,
        uniform_decode_query_len: int = 1,
        drafter: bool = False,
        device: torch.device | str | None = None,
        attention_backend: str | None = None,
        lazy_capture: bool = False,
        graph_memory_budget: int | None = None,
        eager_model: Any = None,
    ):
        if config is None:
            config = CompilationConfig()
        elif not isinstance(config, CompilationConfig):
            raise TypeError(f"GraphRunner config must be a CompilationConfig or None, got {type(config).__name__}")
        inputs = list(inputs)
        bad = [i for i in inputs if not isinstance(i, StaticInput)]
        if bad:
            raise TypeError(f"GraphRunner inputs must be StaticInputs, got {bad[0]!r}")
        names = [i.name for i in inputs]
        if not any(i.per == "token" for i in inputs):
            raise ValueError(
                f"GraphRunner needs at least one per='token' StaticInput (the token count comes from it), got {names}"
            )
        if len(set(names)) != len(names):
            raise ValueError(f"GraphRunner input names must be unique, got {names}")
        positional = model_kwargs is None and model_args is None
        model_args_ = input_names("model_args", model_args, names, names if positional else [])
        model_kwargs_ = input_names("model_kwargs", model_kwargs, names, [])
        both = sorted(set(model_args_) & set(model_kwargs_))
        if both:
            raise ValueError(f"inputs {both} are in both model_args and model_kwargs; pass each one way")
        if eager_model is not None and not callable(eager_model):
            raise TypeError(f"eager_model must be callable (the model uncompiled), got {type(eager_model).__name__}")
        if context_fn is not None and not callable(context_fn):
            raise TypeError(f"context_fn must be callable(views) -> dict, got {type(context_fn).__name__}")
        per_request = [i.name for i in inputs if i.per == "request"]
        if max_num_reqs is not None and (
            not isinstance(max_num_reqs, int) or isinstance(max_num_reqs, bool) or max_num_reqs < 1
        ):
            raise ValueError(f"max_num_reqs must be a positive int, got {max_num_reqs!r}")
        if per_request and max_num_reqs is None:
            raise ValueError(
                f"per='request' inputs {per_request} need GraphRunner(max_num_reqs=...) (their row count)"
            )
        self.max_num_reqs = max_num_reqs
        request_row = sorted(i.name for i in inputs if i.request_row)  # rebased per micro-batch half
        if request_row and not per_request:
            raise ValueError(
                f"request_row inputs {request_row} hold rows of per-request inputs, but this runner "
                "has none: add the per='request' inputs they index"
            )
        downgrades = []  # what this runner does not do of what config asked, in words
        effective = effective_mode(config)
        if effective != config.cudagraph_mode:
            downgrades.append(
                f"platform {config.platform!r} finds no GPU: cudagraph_mode {config.cudagraph_mode.name} -> NONE"
            )
        mode = resolve_cudagraph_mode(
            effective, attention_support, attention_split=attention_split,
            uniform_decode_query_len=uniform_decode_query_len,
        )
        if mode != effective:
            downgrades.append(
                f"attention support {AttentionGraphSupport(attention_support).name}: cudagraph_mode {effective.name} -> "
                f"{mode.name}"
            )
        self._ubatching = config.use_ubatching and not drafter
        if config.use_ubatching and drafter:
            downgrades.append("use_ubatching: a drafter's steps are never micro-batched")
        if self._ubatching and config.use_breakable and mode.has_piecewise_cudagraphs():
            resolved = without_piecewise(mode)
            downgrades.append(
                f"use_ubatching with use_breakable=True: cudagraph_mode {mode.name} -> {resolved.name} (no breakable "
                "wrapper captures PIECEWISE graphs; use_breakable=False keeps per-piece graphs)"
            )
            mode = resolved
        if self._ubatching:
            eager = eager_halves(mode, config)
            if eager:
                logger.warning("use_ubatching: %s", eager)
                downgrades.append(f"use_ubatching: {eager}")
        #: Each way this runner falls short of ``config`` (a mode lowered, a feature dropped), in words;
        #: empty when it does all that was asked. Micro-batching's also log a warning.
        self.downgrades: tuple[str, ...] = tuple(downgrades)
        self.config = config.replace(cudagraph_mode=mode)
        self.drafter = drafter
        self.attention_backend = attention_backend
        wrapped = wrap_model(model, self.config, drafter=drafter)
        self.dispatcher = CudagraphDispatcher(self.config)
        self.dispatcher.initialize_keys(_drafter_mode(mode) if drafter else mode, uniform_decode_query_len)
        validate_capture_coverage(wrapped, self.dispatcher)
        self.device = torch.device(device) if device is not None else _model_device(model)
        #: The persistent input buffers and the views a step reads (``.buffers`` is its dict of tensors).
        self.step_buffers = StepBuffers(
            inputs, tokens=self.dispatcher.max_size, max_num_reqs=max_num_reqs, device=self.device
        )
        #: The step function: the wrapped model run once on laid-out views (steps, warm-ups, captures).
        self.step = ModelStep(
            wrapped, self.step_buffers, model_args=model_args_, model_kwargs=model_kwargs_, context_fn=context_fn,
            uniform_decode_query_len=uniform_decode_query_len,
            ubatch_threshold=self.config.dbo_decode_token_threshold if self._ubatching else None,
            eager_model=eager_model if lazy_capture is True and mode != CUDAGraphMode.NONE else None,
        )
        self._replays = mode != CUDAGraphMode.NONE  # a step may replay a graph
        self.last_mode = CUDAGraphMode.NONE
        self.last_ubatched = False  # the last step was micro-batched (use_ubatching)
        self.steps = 0  # steps run by a micro-batching runner (named in its errors)
        self.capture_closed = False  # after capture(): an unseen descriptor raises instead of capturing
        self.report: CaptureReport | None = None
        self.lazy = LazyCapture()  # captured keys, demand for the others, capture measurements
        self._lazy_capture = self._budget = None
        self.lazy_capture = lazy_capture
        self.graph_memory_budget = graph_memory_budget

    @property
    def model(self) -> Any:
        """The wrapped model (the wrapper stack ``wrap_model`` built for the runner's mode)."""
        return self.step.model

    @property
    def buffers(self) -> dict[str, torch.Tensor]:
        """The persistent input buffers, by input name (one row per token of the largest capture size, or
        ``max_num_reqs`` rows per request)."""
        return self.step_buffers.tensors

    @property
    def inputs(self) -> dict[str, StaticInput]:
        """The runner's inputs, by name."""
        return self.step_buffers.specs

    @property
    def model_args(self) -> list[str]:
        return self.step.model_args

    @property
    def model_kwargs(self) -> list[str]:
        return self.step.model_kwargs

    @property
    def context_fn(self) -> ContextFn | None:
        return self.step.context_fn

    @property
    def lazy_capture(self) -> bool:
        """Steps never capture: one without a graph runs eagerly and counts as demand (``capture_idle``)."""
        return self._lazy_capture

    @lazy_capture.setter
    def lazy_capture(self, value: bool) -> None:
        if value is not True and value is not False:
            raise ValueError(f"lazy_capture must be a bool, got {value!r}")
        self._lazy_capture = value
        self._route_lazily = value or self._budget is not None

    @property
    def graph_memory_budget(self) -> int | None:
        """Bytes this runner's graphs may add to the graph pool (None: no limit)."""
        return self._budget

    @graph_memory_budget.setter
    def graph_memory_budget(self, value: int | None) -> None:
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ValueError(f"graph_memory_budget must be None or a number of bytes >= 0, got {value!r}")
        self._budget = value
        self._route_lazily = bool(self._lazy_capture) or value is not None

    @property
    def needs_compile(self) -> bool:
        """Steps still run ``eager_model``: :meth:`capture_idle` (or :meth:`capture`) compiles first."""
        return self.step.needs_compile

    @property
    def pending_capture_seconds(self) -> float:
        """Predicted seconds of the longest single start :meth:`capture_idle` waits for to serve the demand
        (the compile while :attr:`needs_compile`, else the costliest demanded capture; 0: no demand)."""
        return self.lazy.costliest_start(self.config.compile_pieces, self.step.needs_compile)

    @property
    def demand(self) -> dict[Key, int]:
        """Steps that ran without the graph they dispatched to, per ``(mode, descriptor)`` not captured."""
        return {k: d.steps for k, d in self.lazy.demand.items()}

    @property
    def mode(self) -> CUDAGraphMode:
        return self.config.cudagraph_mode

    def run(
        self, *, uniform_decode: bool = False, num_reqs: int | None = None, context: dict | None = None,
        query_lens: Sequence[int] | None = None, **batch: torch.Tensor,
    ) -> Any:
        """Run one step; returns outputs sliced to the real token count (:meth:`run_step` without the
        record: :attr:`last_mode` and :attr:`last_ubatched` say what the latest step ran)."""
        return self.run_step(
            uniform_decode=uniform_decode, num_reqs=num_reqs, context=context, query_lens=query_lens, **batch
        ).output

    def run_step(
        self, *, uniform_decode: bool = False, num_reqs: int | None = None, context: dict | None = None,
        query_lens: Sequence[int] | None = None, **batch: torch.Tensor,
    ) -> StepResult:
        """Run one step; returns its :class:`StepResult`: outputs sliced to the real token count, the mode
        and descriptor it ran under, whether it was micro-batched.

        ``query_lens`` (tokens per request, in order) lets a micro-batching runner split a
        mixed step at a request boundary; uniform decode steps and steps of one token per
        request split without it.

        Replayed outputs live in graph memory: valid until the next step. ``context`` adds
        forward-context attributes for this step only, on top of ``context_fn``'s; graphs
        never saw it at capture, so only eager code reads it (breaks of PIECEWISE steps,
        NONE steps): on a FULL step its tensors must be views of this runner's buffers.
        """
        specs = self.step_buffers.specs
        if batch.keys() != specs.keys():
            missing, extra = sorted(set(specs) - set(batch)), sorted(set(batch) - set(specs))
            raise ValueError(
                f"GraphRunner.run: missing inputs {missing}, unknown inputs {extra}; expected {sorted(specs)}"
            )
        fit = True  # every non-leading dim fits the buffers (else: an eager step)
        n = reqs = None
        for name, t in batch.items():  # check_tensor, fits and step_counts in one pass: this is every step's cost
            spec = specs[name]
            if type(t) is not torch.Tensor or t.dim() != spec.ndim or t.is_floating_point() != spec.floating:
                check_tensor(spec, t)
            shape = t.shape
            if spec.ndim > 1 and fit and shape[1:] != spec.shape:  # 1-d: dim() checked it all
                fit = fits(spec, t)
            if spec.per_token:
                if n is None:
                    n = shape[0]
                elif shape[0] != n:
                    step_counts(batch, specs)  # raises, naming the counts
            elif reqs is None:
                reqs = shape[0]
            elif shape[0] != reqs:
                step_counts(batch, specs)
        if reqs is not None:
            if reqs > self.max_num_reqs:  # type: ignore[operator]
                raise ValueError(
                    f"GraphRunner.run: per-request inputs have {reqs} rows, above max_num_reqs={self.max_num_reqs}"
                )
            if num_reqs is None:
                num_reqs = reqs
            elif num_reqs != reqs:
                raise ValueError(f"GraphRunner.run: num_reqs={num_reqs} but the per-request inputs have {reqs} rows")
        context = {} if context is None else check_context(context, replays=self._replays)
        if self.config.debug_checks:
            for name in self.step_buffers.request_row:
                check_request_rows(specs[name], batch[name], 0, reqs, where=f" (the step has {reqs} requests)")
        agreed = None  # micro-batching: what every rank runs this step
        total, dispatch_reqs = n, num_reqs
        if self._ubatching:
            lens = _ubatch.check_query_lens(query_lens, n, reqs)
            self.steps += 1
            q = self.dispatcher.uniform_decode_query_len
            split = _ubatch.split_point(n, lens, uniform_decode, q, num_reqs)
            agreed = _ubatch.agree(self.config, n, uniform_decode, split, fit, self.steps)
            total, uniform_decode, fit = agreed.num_tokens, agreed.uniform, agreed.fit  # the largest rank's step
            dispatch_reqs = num_reqs if total == n else None
        mode, desc = self.dispatcher.dispatch(
            total, uniform_decode=uniform_decode, num_reqs=dispatch_reqs, disable_full=self.drafter
        )
        if mode != CUDAGraphMode.NONE and not fit:  # one rank's inputs are too wide for the buffers: all eagerly
            logger.debug("step of %d tokens does not fit the static buffers: running eagerly", total)
            mode, desc = CUDAGraphMode.NONE, BatchDescriptor(total)
        wanted = None  # lazy capture: the key this step wanted and has no graph of
        if self._route_lazily and mode != CUDAGraphMode.NONE:
            mode, desc, wanted = self.lazy.route(self.dispatcher, mode, desc, total)
        if mode == CUDAGraphMode.FULL and context:
            check_full_context(context, self.step_buffers.storages)
        may_capture = False if self.capture_closed or self._route_lazily else None
        if agreed is not None:
            self.last_ubatched = agreed.ubatch
            if agreed.ubatch:
                return self._run_halves(batch, agreed, mode, desc, n, num_reqs, context, may_capture)
        ubatched = agreed is not None and agreed.ubatch
        self.last_mode = mode
        if self.config.debug_checks and agreed is None:
            _parallel.check_same_step(mode, desc)  # ranks running different graphs would pair collectives wrongly
        buffers = self.step_buffers
        if mode == CUDAGraphMode.NONE:
            padded = total  # above n only when another rank's step is larger (micro-batching)
            if wanted is None:
                out = self.step(buffers.eager_views(batch, total), mode, desc, context=context, may_capture=may_capture)
            else:
                # A step a graph will serve later runs on the buffers' first rows, marked as the capture's
                # warm-ups mark them: Dynamo traces the one graph those use, not one per size (nor another
                # for inference tensors), so neither later steps nor capture_idle compile again.
                buffers.fill(batch, total)
                views = buffers.views(total)
                if not self.step.needs_compile:  # the uncompiled model needs no marks (nor Dynamo's import)
                    buffers.mark_token_views(views)
                began = time.perf_counter()
                out = self.step(views, mode, desc, context=context, may_capture=may_capture)
                self.lazy.note_eager(wanted, time.perf_counter() - began)
            if padded == n:
                return StepResult(out, mode, desc, ubatched)  # what the model returned, as an eager call returns it
        else:
            padded = desc.num_tokens
            buffers.fill(batch, padded)
            out = self.step(buffers.step_views(padded), mode, desc, context=context, may_capture=may_capture)
        if isinstance(out, torch.Tensor):  # the common case, without tree_map's flatten and unflatten
            return StepResult(_unpad(out, n, padded), mode, desc, ubatched)
        return StepResult(tree_map(lambda o: _unpad(o, n, padded) if isinstance(o, torch.Tensor) else o, out), mode,
                          desc, ubatched)

    def _run_halves(
        self, batch: dict[str, torch.Tensor], agreed: _ubatch.Agreement, mode: CUDAGraphMode, desc: BatchDescriptor,
        n: int, num_reqs: int | None, context: dict, may_capture: bool | None,
    ) -> StepResult:
        """The rest of a micro-batched step: lay its halves out and run them (one call of the wrapped model)."""
        buffers = self.step_buffers
        mode, agreed, halves = _ubatch.plan(agreed, mode, desc, n, self.dispatcher.uniform_decode_query_len, buffers)
        self.last_mode = mode
        if self.config.debug_checks:
            _ubatch.check_half_rows(buffers, batch, agreed.split, n, num_reqs)
        views = _ubatch.layout(buffers, batch, agreed.split, halves, graph=mode == CUDAGraphMode.FULL)
        desc = desc if mode == CUDAGraphMode.FULL else BatchDescriptor(sum(halves.rows))
        out = self.step(views, mode, desc, context=context, may_capture=may_capture, halves=halves)
        cut = agreed.split[0]
        return StepResult(tree_map(lambda o: _ubatch.unsplit(o, cut, n, halves), out), mode, desc, True)

    def clear_graphs(self) -> None:
        """Drop every graph of this runner's model; :meth:`capture` can capture them again."""
        clear_graphs(self.model)
        self.lazy.forget()
        self.step.forget()

    def capture(self, *, disable_after: bool = True, progress: bool | None = None) -> CaptureReport:
        """Warm up and capture every descriptor the dispatcher can emit, largest first.

        Every buffer is reset to its ``pad`` first, so warm-ups and captures never run on a
        previous step's data, and ``context_fn`` gets the same padded views as on a step.
        With ``disable_after`` (default) later steps of this runner never capture: an
        unseen descriptor raises :class:`CaptureDisabledError` instead of capturing mid-serving.
        With a ``graph_memory_budget`` the descriptors are captured by the lazy policy (no
        time limit): none predicted past the budget, and those left out run eagerly.
        """
        plan = self.dispatcher.capture_descriptors()
        if self._budget is None:
            # growth: only the total, not per capture
            self.report = capture_all(
                self.step_buffers, self.step, self.config, plan, progress=progress,
                on_capture=lambda mode, desc, seconds: self.lazy.note_capture(mode, desc, seconds, None),
            )
            logger.info(
                "captured %d graphs in %.2f s (%s); attention: %s", self.report.graphs, self.report.seconds,
                self.report.stats, self.attention_backend or "the model's own",
            )
        else:
            keys = [(mode, d) for mode, descs in plan for d in descs]
            began, segments = time.perf_counter(), graphs_created()
            before = self.lazy.grown
            captured = capture_within(
                self.step_buffers, self.step, self.config, self.lazy, keys, math.inf, self._budget
            )
            self.report = CaptureReport(
                len(captured), time.perf_counter() - began,
                f"{len(captured)} of {len(keys)} descriptors within graph_memory_budget={self._budget}",
                self.lazy.grown - before, graphs_created() - segments,
            )
        self.capture_closed = disable_after
        return self.report

    def capture_idle(
        self, max_seconds: float, *, clock: Callable[[], float] = time.perf_counter
    ) -> list[tuple[CUDAGraphMode, BatchDescriptor]]:
        """Capture descriptors that steps asked for (largest first) within ``max_seconds`` and ``graph_memory_budget``; returns the ``(mode, descriptor)`` pairs
        captured. Starts no capture predicted to overrun either (:mod:`.lazy`). Call it between
        steps, on the thread that runs them."""
        if not isinstance(max_seconds, (int, float)) or isinstance(max_seconds, bool) or not max_seconds >= 0:
            raise ValueError(f"capture_idle: max_seconds must be a number of seconds >= 0, got {max_seconds!r}")
        return capture_within(
            self.step_buffers, self.step, self.config, self.lazy, list(self.lazy.demand), float(max_seconds),
            self._budget, clock,
        )

    def estimate_capture_memory(self) -> int:
        """Bytes :meth:`capture` will add to the graph pool, measured before capturing: the
        largest descriptor of each mode is captured into a scratch pool, which is then released."""
        return estimate_memory(self.step_buffers, self.step, self.config, self.dispatcher.capture_descriptors())


def _unpad(out: torch.Tensor, n: int, padded: int) -> torch.Tensor:
    """A step output without its padding rows (one of ``padded`` rows per token)."""
    return out[:n] if n != padded and out.dim() and out.shape[0] == padded else out


def without_piecewise(mode: CUDAGraphMode) -> CUDAGraphMode:
    """Micro-batching replaces the breakable wrapper: PIECEWISE graphs have no capturer then."""
    if mode.has_piecewise_cudagraphs():
        resolved = CUDAGraphMode.FULL_DECODE_ONLY if mode.has_full_cudagraphs() else CUDAGraphMode.NONE
        logger.warning(
            "use_ubatching: cudagraph_mode %s -> %s (no breakable wrapper captures PIECEWISE graphs; "
            "use_breakable=False keeps per-piece graphs)", mode.name, resolved.name,
        )
        return resolved
    return mode


def eager_halves(mode: CUDAGraphMode, config: CompilationConfig) -> str:
    """Which graph steps micro-batching runs eagerly instead (in two threads), in words; "" for none.

    Only a uniform decode step dispatched FULL has a micro-batched graph; any other step that
    reaches its threshold within the capture sizes loses its graph.
    """
    largest = config.sizes[-1] if config.sizes else 0
    lost = []
    if mode.decode_mode() == CUDAGraphMode.PIECEWISE and config.dbo_decode_token_threshold <= largest:
        lost.append(f"decode steps of {config.dbo_decode_token_threshold}+ tokens (PIECEWISE)")
    if mode.mixed_mode() != CUDAGraphMode.NONE and config.dbo_prefill_token_threshold <= largest:
        lost.append(f"steps with a prompt of {config.dbo_prefill_token_threshold}+ tokens ({mode.mixed_mode().name})")
    if not lost:
        return ""
    return (
        f"micro-batched {' and '.join(lost)} run eagerly in two threads, without a graph (only uniform decode "
        "steps dispatched FULL replay micro-batched graphs)"
    )


def _drafter_mode(mode: CUDAGraphMode) -> CUDAGraphMode:
    # A drafter has only the breakable wrapper, even when the target runs plain FULL.
    return CUDAGraphMode.NONE if mode == CUDAGraphMode.NONE else CUDAGraphMode.PIECEWISE


def _model_device(model: Any) -> torch.device:
    try:
        return next(model.parameters()).device
    except (AttributeError, StopIteration, TypeError):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
