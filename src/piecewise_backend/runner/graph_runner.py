"""GraphRunner: the engine-facing object that pads, dispatches, captures and replays.

Its parts, each a module of its own: :mod:`.mode_policy` resolves the mode it runs and says each
downgrade; :class:`~.batch_checks.BatchChecks` checks every step's arguments in one pass (the runner
trusts them after it); :class:`~.buffers.StepBuffers` owns one persistent buffer per input and the
views of them a step reads (every step copies its batch there, so graphs always read the addresses
they captured); :class:`~.step.ModelStep` runs the wrapped model once on such views, plain or
micro-batched, for a step as for a warm-up or a capture, checking a FULL step's context
(:mod:`.full_context`); the one capture loop (:func:`~.orchestration.capture_keys`, with
:class:`~.lazy.LazyCapture` as its policy) takes those two, not the runner; :mod:`.ubatch_step` splits a
step in halves. The runner holds the state a step consults (dispatcher, lazy demand, whether
capture is closed) and the one step path of :meth:`GraphRunner.run_step` (:meth:`GraphRunner.run`
returns its output).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_map

from ..config import CompilationConfig
from ..context import BatchDescriptor
from ..modes import AttentionGraphSupport, CUDAGraphMode
from ..observability import counters, logger
from . import agreement as _parallel
from . import ubatch_step as _ubatch
from .assembly import clear_graphs, validate_capture_coverage, wrap_model
from .batch_checks import BatchChecks, check_runner_args
from .buffers import StepBuffers
from .dispatcher import CudagraphDispatcher
from .full_context import check_full_context
from .lazy import CaptureFailure, Key, LazyCapture
from .mode_policy import runner_modes
from .orchestration import CaptureBudget, CaptureReport, capture_keys, estimate_memory
from .static_inputs import StaticInput
from .step import ContextFn, ModelStep

_NONE, _FULL = CUDAGraphMode.NONE, CUDAGraphMode.FULL

__all__ = ["EAGER_REASONS", "CaptureReport", "GraphRunner", "StaticInput", "StepResult"]  # CaptureReport, StaticInput: imported from here too


@dataclasses.dataclass(frozen=True, slots=True)
class StepResult:
    """What :meth:`GraphRunner.run_step` did: the step's unpadded ``output``, the ``mode`` it ran in (NONE:
    eagerly), the ``descriptor`` of the graph it replayed (or of the eager step), whether it was
    micro-batched (``ubatched``), and why it ran eagerly when the config's mode asked for a graph
    (``reason``, one of :data:`EAGER_REASONS`; "" otherwise)."""

    output: Any
    mode: CUDAGraphMode
    descriptor: BatchDescriptor
    ubatched: bool = False
    reason: str = ""


#: Why a step the config's mode would serve with a graph ran eagerly (``StepResult.reason``); each is
#: counted in ``pb.counters["eager_steps_<reason>"]``.
EAGER_REASONS = {
    "above_ladder": "more tokens than the largest capture size",
    "inputs_too_wide": "an input wider than the static buffers",
    "not_captured": "its graph is not captured yet (lazy capture, a graph_memory_budget)",
    "capture_failed": "its graph's idle-time capture, or the compile before it, failed (GraphRunner.capture_failures)",
}


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
    for no Dynamo trace (:attr:`needs_compile`, :mod:`.lazy`). ``downgrades``: ways the caller
    already knows its steps fall short of ``config`` (an engine's ladder not covering a limit),
    listed first in :attr:`downgrades`.

    With ``compile_pieces="none"`` ``model`` is the model uncompiled (a ``torch.compile``d one is refused):
    no Dynamo at all, PIECEWISE captures break at its splitting ops at run time
    (:mod:`piecewise_backend.capture.op_breaks`), token views are never marked dynamic and ``eager_model``
    is not used (there is nothing to compile).
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
        downgrades: Sequence[str] = (),
    ):
        if config is None:
            config = CompilationConfig()
        elif not isinstance(config, CompilationConfig):
            raise TypeError(f"GraphRunner config must be a CompilationConfig or None, got {type(config).__name__}")
        inputs, args, kwargs = check_runner_args(
            inputs, model_args, model_kwargs, max_num_reqs, context_fn, eager_model
        )
        modes = runner_modes(config, attention_support=attention_support, attention_split=attention_split,
                             uniform_decode_query_len=uniform_decode_query_len, drafter=drafter)
        #: Each way this runner falls short of ``config`` (a mode lowered, a feature dropped), in words;
        #: empty when it does all that was asked. Micro-batching's also log a warning.
        self.downgrades: tuple[str, ...] = (*downgrades, *modes.downgrades)
        self.config = config.replace(cudagraph_mode=modes.mode)
        no_dynamo = config.compile_pieces == "none"
        if no_dynamo:
            _refuse_compiled(model)
        self._ubatching = modes.ubatching
        self.max_num_reqs, self.drafter, self.attention_backend = max_num_reqs, drafter, attention_backend
        wrapped = wrap_model(model, self.config, drafter=drafter)
        self.dispatcher = CudagraphDispatcher(self.config)
        self.dispatcher.initialize_keys(modes.dispatch_mode, uniform_decode_query_len)
        validate_capture_coverage(wrapped, self.dispatcher)
        self.device = torch.device(device) if device is not None else _model_device(model)
        #: The persistent input buffers and the views a step reads (``.buffers`` is its dict of tensors).
        self.step_buffers: StepBuffers = StepBuffers(
            inputs, tokens=self.dispatcher.max_size, max_num_reqs=max_num_reqs, device=self.device,
            mark_tokens=not no_dynamo,
        )
        #: The step function: the wrapped model run once on laid-out views (steps, warm-ups, captures).
        self.step = ModelStep(
            wrapped, self.step_buffers, model_args=args, model_kwargs=kwargs, context_fn=context_fn,
            uniform_decode_query_len=uniform_decode_query_len,
            ubatch_threshold=self.config.dbo_decode_token_threshold if self._ubatching else None,
            eager_model=eager_model if lazy_capture is True and modes.mode != _NONE and not no_dynamo else None,
        )
        #: Every check of a step's arguments (:mod:`.batch_checks`).
        self.checks: BatchChecks = BatchChecks(
            self.step_buffers.specs, max_num_reqs=max_num_reqs, replays=modes.mode != _NONE,
            ubatching=self._ubatching, debug_checks=self.config.debug_checks,
        )
        self.last_mode = _NONE  # the mode the latest step ran in (run_step's StepResult says it too)
        self.last_ubatched = False  # the latest step was micro-batched (use_ubatching)
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
    def capture_failures(self) -> tuple[CaptureFailure, ...]:
        """Idle-time compiles and captures that raised, in order (:class:`~.lazy.CaptureFailure`); their steps run
        eagerly until ``capture_idle(retry_failed=True)``."""
        return tuple(self.lazy.failures.values())

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
        return self._run(batch, uniform_decode, num_reqs, context, query_lens).output

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
        return self._run(batch, uniform_decode, num_reqs, context, query_lens)

    def _run(
        self, batch: dict[str, Any], uniform_decode: bool, num_reqs: int | None, context: dict | None,
        query_lens: Sequence[int] | None,
    ) -> StepResult:
        """:meth:`run_step` with its inputs in a dict (``run`` passes them on without re-packing keywords)."""
        n, reqs, num_reqs, fit, exact, context, lens = self.checks.check_step(batch, num_reqs, context, query_lens)
        agreed = None  # micro-batching: what every rank runs this step
        total, dispatch_reqs = n, num_reqs
        if self._ubatching:
            self.steps += 1
            agreed = _ubatch.agree_step(self.config, n, lens, uniform_decode, self.dispatcher.uniform_decode_query_len,
                                        num_reqs, fit, self.steps)
            total, uniform_decode, fit = agreed.num_tokens, agreed.uniform, agreed.fit  # the largest rank's step
            dispatch_reqs = num_reqs if total == n else None
        mode, desc, wanted = self._route(total, uniform_decode, dispatch_reqs, fit)
        if mode is _FULL and context:
            check_full_context(context, self.step_buffers.storages)
        may_capture = False if self.capture_closed or self._route_lazily else None
        if agreed is not None and agreed.ubatch:
            mode, desc, out = _ubatch.run_halves(
                self.step, self.step_buffers, self.checks, batch, agreed, mode, desc, n, num_reqs,
                self.dispatcher.uniform_decode_query_len, context, may_capture,
            )
            self.last_mode, self.last_ubatched = mode, True
            return StepResult(out, mode, desc, True)
        self.last_mode, self.last_ubatched = mode, False
        if self.config.debug_checks and agreed is None:
            _parallel.check_same_step(mode, desc)  # ranks running different graphs would pair collectives wrongly
        if mode is not _NONE:
            padded = desc.num_tokens
            self.step_buffers.fill(batch, padded, (n, reqs) if exact else None)
            out = self.step(self.step_buffers.step_views(padded), mode, desc, context=context, may_capture=may_capture)
        elif wanted is None:
            padded = total  # above n only when another rank's step is larger (micro-batching)
            views = self.step_buffers.eager_views(batch, total)
            out = self.step(views, mode, desc, context=context, may_capture=may_capture)
        else:
            # A step a graph will serve later runs on the buffers' first rows, marked as the capture's warm-ups
            # mark them: Dynamo traces the one graph those use, not one per size (nor another for inference
            # tensors), so neither later steps nor capture_idle compile again.
            padded = total
            views = self.step_buffers.lazy_views(batch, total, mark=not self.step.needs_compile)  # uncompiled: no marks
            began = time.perf_counter()
            out = self.step(views, mode, desc, context=context, may_capture=may_capture)
            self.lazy.note_eager(wanted, time.perf_counter() - began)
        reason = self._eager_reason(total, fit, wanted) if mode is _NONE else ""
        if padded == n:
            return StepResult(out, mode, desc, False, reason)  # what the model returned (an eager step: as an eager call)
        if isinstance(out, torch.Tensor):  # the common case, without tree_map's flatten and unflatten
            return StepResult(_unpad(out, n, padded), mode, desc, False, reason)
        return StepResult(tree_map(lambda o: _unpad(o, n, padded) if isinstance(o, torch.Tensor) else o, out), mode,
                          desc, False, reason)

    def _eager_reason(self, total: int, fit: bool, wanted: Key | None) -> str:
        """Why a step of ``total`` tokens runs eagerly although the config's mode has graphs ("": the mode
        itself runs such steps eagerly, e.g. mixed steps under FULL_DECODE_ONLY); counted."""
        if self.dispatcher.mode is _NONE:
            return ""
        if total > self.dispatcher.max_size:
            reason = "above_ladder"
        elif not fit:
            reason = "inputs_too_wide"
        elif wanted is not None:
            reason = "capture_failed" if self.lazy.failed(wanted) else "not_captured"
        else:
            return ""
        counters["eager_steps_" + reason] += 1
        return reason

    def _route(
        self, total: int, uniform_decode: bool, num_reqs: int | None, fit: bool
    ) -> tuple[CUDAGraphMode, BatchDescriptor, Key | None]:
        """The mode and descriptor a step of ``total`` tokens runs under, and (lazy capture) the key it wanted
        and has no graph of: the dispatcher's answer, eager when the inputs do not fit the buffers."""
        mode, desc = self.dispatcher.dispatch(
            total, uniform_decode=uniform_decode, num_reqs=num_reqs, disable_full=self.drafter
        )
        if mode is not _NONE and not fit:  # one rank's inputs are too wide for the buffers: all eagerly
            logger.debug("step of %d tokens does not fit the static buffers: running eagerly", total)
            return _NONE, BatchDescriptor(total), None
        if self._route_lazily and mode is not _NONE:
            return self.lazy.route(mode, desc, total)
        return mode, desc, None

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
        keys = [(mode, d) for mode, descs in self.dispatcher.capture_descriptors() for d in descs]
        budget = CaptureBudget(memory=self._budget, startup=self._budget is None)
        _, self.report = capture_keys(self.step_buffers, self.step, self.config, self.lazy, keys, budget,
                                      progress=progress if budget.startup else False)
        logger.info(
            "captured %d graphs in %.2f s (%s); attention: %s", self.report.graphs, self.report.seconds,
            self.report.stats, self.attention_backend or "the model's own",
        )
        self.capture_closed = disable_after
        return self.report

    def capture_idle(
        self, max_seconds: float, *, retry_failed: bool = False, clock: Callable[[], float] = time.perf_counter
    ) -> list[tuple[CUDAGraphMode, BatchDescriptor]]:
        """Capture descriptors that steps asked for (largest first) within ``max_seconds`` and ``graph_memory_budget``; returns the ``(mode, descriptor)`` pairs
        captured. Starts no capture predicted to overrun either (:mod:`.lazy`). Call it between
        steps, on the thread that runs them.

        A compile or capture that raises is recorded in :attr:`capture_failures` (warned once per reason) and
        not tried again: its steps run eagerly. ``retry_failed=True`` forgets the failures first."""
        if not isinstance(max_seconds, (int, float)) or isinstance(max_seconds, bool) or not max_seconds >= 0:
            raise ValueError(f"capture_idle: max_seconds must be a number of seconds >= 0, got {max_seconds!r}")
        if retry_failed is not True and retry_failed is not False:
            raise ValueError(f"capture_idle: retry_failed must be a bool, got {retry_failed!r}")
        if retry_failed:
            self.lazy.retry_failed()
        budget = CaptureBudget(seconds=float(max_seconds), memory=self._budget)
        captured, _ = capture_keys(self.step_buffers, self.step, self.config, self.lazy, list(self.lazy.demand),
                                   budget, clock=clock)
        return captured

    def estimate_capture_memory(self) -> int:
        """Bytes :meth:`capture` will add to the graph pool, measured before capturing: the
        largest descriptor of each mode is captured into a scratch pool, which is then released."""
        return estimate_memory(self.step_buffers, self.step, self.config, self.dispatcher.capture_descriptors())


def _unpad(out: torch.Tensor, n: int, padded: int) -> torch.Tensor:
    """A step output without its padding rows (one of ``padded`` rows per token)."""
    return out[:n] if n != padded and out.dim() and out.shape[0] == padded else out


def _refuse_compiled(model: Any) -> None:
    """``compile_pieces="none"`` takes the model uncompiled: refuse a ``torch.compile``d one, naming what to pass."""
    dynamo = sys.modules.get("torch._dynamo.eval_frame")  # never imported for it: a compiled model has loaded it
    compiled = dynamo is not None and isinstance(model, getattr(dynamo, "OptimizedModule", ()))
    if compiled or callable(getattr(model, "_torchdynamo_orig_callable", None)):
        raise ValueError(
            "GraphRunner with CompilationConfig(compile_pieces='none') takes the model uncompiled (no Dynamo at "
            f"all), got a torch.compile'd {type(model).__name__}: pass the model itself (for an OptimizedModule, "
            "its ._orig_mod), or use compile_pieces='eager' or 'inductor' with the compiled model"
        )


def _model_device(model: Any) -> torch.device:
    try:
        return next(model.parameters()).device
    except (AttributeError, StopIteration, TypeError):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
