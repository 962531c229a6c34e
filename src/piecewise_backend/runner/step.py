"""The step function: run the wrapped model once on laid-out views, plain or micro-batched.

Everything that runs the model goes through one :class:`Step`: a GraphRunner step, a warm-up,
a capture, and each of those micro-batched (``halves``: both halves in one call of the wrapped
model, each with its own forward context). Capture planning (:mod:`.orchestration`,
:mod:`.lazy`) takes a ``Step`` and the :class:`~.buffers.StepBuffers` it reads, never the runner.
:class:`ModelStep` is the GraphRunner's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch

from ..capture.wrappers import CUDAGraphWrapper
from ..context import BatchDescriptor, set_forward_context
from ..modes import CUDAGraphMode
from ..ubatch.wrapper import UBatchSlice, UBatchWrapper
from .assembly import drop_graph
from .buffers import StepBuffers
from .full_context import ContextPrint, check_captured_context, context_tensors
from .ubatch_step import HalfLayout, capture_layout, half_views

_NONE, _FULL = CUDAGraphMode.NONE, CUDAGraphMode.FULL

ContextFn = Callable[[dict[str, torch.Tensor]], Mapping[str, Any]]


class Step(Protocol):
    """Runs the wrapped model once under ``(mode, desc)`` on ``views`` (of a :class:`StepBuffers`, or
    eager copies laid out the same way).

    ``context``: extra forward-context attributes for this call. ``may_capture``: True for a capture
    (captures even when steps may not), False for a step that must not capture (a closed or lazy
    runner: a missing graph raises or is routed around), None to let the wrappers capture on first
    sight. ``halves``: run micro-batched, the views laid out as :func:`~.ubatch_step.layout` does.
    """

    def __call__(
        self,
        views: Mapping[str, torch.Tensor],
        mode: CUDAGraphMode,
        desc: BatchDescriptor,
        *,
        context: Mapping[str, Any] | None = None,
        may_capture: bool | None = None,
        halves: HalfLayout | None = None,
    ) -> Any: ...

    def capture_halves(self, desc: BatchDescriptor) -> HalfLayout | None:
        """The layout of the micro-batched graph a FULL capture of ``desc`` also makes (None: none)."""
        ...

    def drop(self, mode: CUDAGraphMode, desc: BatchDescriptor) -> bool:
        """Drop the graphs of ``(mode, desc)`` (a capture that overran a memory budget)."""
        ...

    @property
    def needs_compile(self) -> bool:
        """Plain steps still run the uncompiled model: the first warm-up or capture compiles (Dynamo's
        trace and the pieces), and steps run the compiled model from then on."""
        ...


class ModelStep:
    """A GraphRunner's :class:`Step`: ``model`` (the wrapped model) called with ``model_args`` positionally
    and ``model_kwargs`` by keyword, under the forward-context attributes ``context_fn`` builds from the
    call's views (per half when micro-batched).

    On a FULL call it checks that ``context_fn`` returned the tensors the graph captured: a FULL replay
    reads those and would silently ignore new ones (:func:`~.full_context.check_captured_context`).

    ``eager_model`` (the same model, uncompiled): plain steps (mode NONE, not a warm-up or a capture,
    not micro-batched) call it instead of ``model`` until a call of ``model`` has run once, so a lazy
    runner serves before Dynamo traces (:attr:`needs_compile`).
    """

    def __init__(
        self,
        model: Any,
        buffers: StepBuffers,
        *,
        model_args: Sequence[str],
        model_kwargs: Sequence[str],
        context_fn: ContextFn | None = None,
        uniform_decode_query_len: int = 1,
        ubatch_threshold: int | None = None,
        eager_model: Any = None,
    ) -> None:
        self.model = model
        self._eager = eager_model  # None once the compiled model ran (or when there is none)
        self.model_args = list(model_args)
        self.model_kwargs = list(model_kwargs)
        self.context_fn = context_fn
        self.per_request = buffers.per_request
        self._buffers = buffers
        self._q = uniform_decode_query_len
        self._ubatch_threshold = ubatch_threshold  # None: not micro-batching
        # context_fn's tensors at each FULL capture: of a plain step (a ContextPrint per descriptor), of a
        # micro-batched one (context_tensors' dict per ("ubatch", descriptor))
        self._prints: dict[BatchDescriptor, ContextPrint] = {}
        self._captured_context: dict[tuple, Any] = {}
        self._kind_of: Any = None  # the model _full_kind was computed for
        self._full_kind = False  # the model is a wrapper holding plain FULL entries

    def __call__(
        self,
        views: Mapping[str, torch.Tensor],
        mode: CUDAGraphMode,
        desc: BatchDescriptor,
        *,
        context: Mapping[str, Any] | None = None,
        may_capture: bool | None = None,
        halves: HalfLayout | None = None,
    ) -> Any:
        guard = None
        checks = mode is _FULL and self.context_fn is not None  # what a FULL graph bakes in: checked
        if halves is None:
            attrs = self.context_fn(dict(views)) if self.context_fn is not None else {}
            if checks:
                guard = self._guard_step(desc, attrs)
            if context or may_capture is not None or type(attrs) is not dict:
                attrs = dict(attrs, **context) if context else dict(attrs)  # never context_fn's own dict
        else:
            slices, tensors = self._slices(views, mode, halves, context)
            if checks:
                guard = self._guard(("ubatch", desc), desc, tensors, self.model.ubatch_entries)
            attrs = {"ubatch_slices": slices}
        if may_capture:
            attrs["allow_capture"] = True  # a capture captures even when steps may not
        elif may_capture is False:
            attrs.setdefault("allow_capture", False)
        model = self.model
        eager = self._eager
        if eager is not None and mode == _NONE and not may_capture and halves is None:
            model = eager  # serve before compiling: no Dynamo trace on this step
        with set_forward_context(mode, desc, **attrs):
            out = model(*[views[a] for a in self.model_args], **{k: views[k] for k in self.model_kwargs})
        if eager is not None and model is not eager:
            self._eager = None  # the compiled model has run (traced and compiled): steps use it from now on
        if guard is not None:
            guard()
        return out

    def _slices(
        self, views: Mapping[str, torch.Tensor], mode: CUDAGraphMode, halves: HalfLayout,
        context: Mapping[str, Any] | None,
    ) -> tuple[list[UBatchSlice], dict[str, tuple]]:
        """Each half's :class:`UBatchSlice` (its views and forward context), and ``context_fn``'s tensors
        of both halves (what a FULL graph of the step bakes in)."""
        q, slices, tensors = self._q, [], {}
        for i, (part, size) in enumerate(zip(half_views(views, halves, self.per_request), halves.rows)):
            own = dict(self.context_fn(dict(part))) if self.context_fn else {}
            if mode == _FULL and self.context_fn:
                tensors.update(context_tensors(own, prefix=f"micro-batch {i}: "))
            attrs = dict(own, **context) if context else own
            half_desc = BatchDescriptor(size, size // q, True) if mode == _FULL else BatchDescriptor(size)
            args = tuple(part[a] for a in self.model_args)
            slices.append(UBatchSlice(args, {k: part[k] for k in self.model_kwargs}, half_desc, attrs, size))
        return slices, tensors

    def _full_entries(self) -> dict | None:
        """The FULL entries of plain (not micro-batched) steps, by descriptor (the live dict: a wrapper may
        replace it, so only the kind of the model is remembered)."""
        m = self.model
        if m is not self._kind_of:
            self._kind_of = m
            full = isinstance(m, CUDAGraphWrapper) and m.runtime_mode == _FULL
            self._full_kind = isinstance(m, UBatchWrapper) or full
        return m.entries if self._full_kind else None

    def _guard_step(self, desc: BatchDescriptor, attrs: Mapping[str, Any]) -> Callable[[], Any] | None:
        """:meth:`_guard` of a plain step: its context is checked by a :class:`~.full_context.ContextPrint`
        made when the graph was captured (the hot path: every FULL replay)."""
        entries = self._full_entries()
        if entries is None:
            return None
        if desc in entries:
            known = self._prints.get(desc)
            if known is not None:
                known.check(attrs, desc)
            return None
        now = ContextPrint(attrs)
        return lambda: desc in entries and self._prints.__setitem__(desc, now)

    def _guard(
        self, key: tuple, desc: BatchDescriptor, now: dict[str, tuple], entries: dict | None
    ) -> Callable[[], Any] | None:
        """Before a FULL call: refuse ``context_fn`` tensors (``now``: :func:`context_tensors`) other than
        those the graph of ``desc`` captured. When this call may capture ``desc``, returns what records
        them once it did (a failed capture records nothing)."""
        if entries is None:
            return None
        if desc in entries:
            known = self._captured_context.get(key)
            if known is not None:
                check_captured_context(known, now, desc)
            return None
        return lambda: desc in entries and self._captured_context.__setitem__(key, now)

    def capture_halves(self, desc: BatchDescriptor) -> HalfLayout | None:
        if self._ubatch_threshold is None:
            return None
        return capture_layout(desc, self._q, self._ubatch_threshold, self._buffers)

    def drop(self, mode: CUDAGraphMode, desc: BatchDescriptor) -> bool:
        return drop_graph(self.model, mode, desc)

    @property
    def needs_compile(self) -> bool:
        return self._eager is not None

    def forget(self) -> None:
        """The model's graphs were all dropped: forget the context tensors they captured."""
        self._prints.clear()
        self._captured_context.clear()
