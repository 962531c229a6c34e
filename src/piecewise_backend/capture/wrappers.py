"""CUDAGraphWrapper (one graph per descriptor) and BreakableCUDAGraphWrapper (segments with breaks).

Outputs returned by a replay live in graph memory shared by every graph of the pool:
they stay valid only until the next replay of any graph. Copy what you keep.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from ..config import CompilationConfig
from ..context import BatchDescriptor, ForwardContext, current_forward_context
from ..inputs import InputSpec
from ..modes import CUDAGraphMode
from ..observability import counters, eager_counts, logger
from ..ops import registered_splitting_ops
from ..platforms.base import Platform
from ..platforms.registry import config_platform_name, get_platform, warm_up
from .entry import GraphEntry
from .memory import poison_stale_outputs, release_cached, release_capture_memory
from .op_breaks import OpBreaks, op_breaks
from .session import CaptureDisabledError, CaptureSession, capture_active, capture_allowed, run_session

__all__ = ["BreakableCUDAGraphWrapper", "CUDAGraphWrapper", "GraphEntry", "GraphWrapper", "unwrap_model"]

_NONE = CUDAGraphMode.NONE
_CAPTURING = (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL)
# nn.Module methods that return the module itself: through a wrapper they return the wrapper.
_CHAINED = frozenset({"eval", "train", "to", "float", "half", "double", "bfloat16", "cuda", "cpu", "type",
                      "to_empty", "requires_grad_", "share_memory", "apply", "xpu", "ipu"})


def _weights(module: Any) -> list[tuple[int, torch.dtype]]:
    """Addresses and dtypes of a module's parameters and buffers (graphs read them in place)."""
    tensors = [*module.parameters(), *module.buffers()] if isinstance(module, torch.nn.Module) else []
    return [(t.data_ptr(), t.dtype) for t in tensors]


class GraphWrapper:
    """What every capture wrapper shares (CUDAGraphWrapper, BreakableCUDAGraphWrapper, UBatchWrapper): entries
    per runtime mode and descriptor, the passthrough gate, capture on first sight, ``drop`` and ``clear_graphs``."""

    breakable = False

    def __init__(self, runnable: Callable[..., Any], runtime_mode: CUDAGraphMode | None, config: CompilationConfig | None):
        if not callable(runnable):
            raise TypeError(f"{type(self).__name__} needs a callable runnable, got {type(runnable).__name__}")
        if config is not None and not isinstance(config, CompilationConfig):
            raise TypeError(f"config must be a CompilationConfig or None, got {type(config).__name__}")
        self.runnable = runnable
        # Entries per runtime mode (index = mode value): a wrapper matching several modes keeps them apart.
        self._by_mode: tuple[dict[BatchDescriptor, GraphEntry], ...] = ({}, {}, {})
        self.runtime_mode = runtime_mode
        self.config = config or CompilationConfig()
        self._platform: Platform | None = None
        self._busy = threading.Lock()  # one replay or capture of this wrapper at a time

    @property
    def runtime_mode(self) -> CUDAGraphMode | None:
        return self._runtime_mode

    @runtime_mode.setter
    def runtime_mode(self, mode: CUDAGraphMode | str | None) -> None:
        if mode is not None:
            mode = CUDAGraphMode.parse(mode)
            if mode not in _CAPTURING:
                raise ValueError(f"{type(self).__name__} runtime_mode must be PIECEWISE or FULL, got {mode.name}")
        self._runtime_mode = mode
        # bit m.value set for every runtime mode this wrapper captures (see __call__)
        self._mode_mask = sum(1 << m.value for m in _CAPTURING if self.matches(m))

    @property
    def entries(self) -> dict[BatchDescriptor, GraphEntry]:
        """Captured entries keyed by BatchDescriptor.

        For a wrapper of one runtime mode this is the live dict. A wrapper matching
        several modes (``BreakableCUDAGraphWrapper(runtime_mode=None)``) keeps each mode
        apart (:attr:`entries_by_mode`); here it shows a merged copy in which a descriptor
        captured under both modes maps to its FULL entry.
        """
        if self._runtime_mode is not None:
            return self._by_mode[self._runtime_mode.value]
        return {**self._by_mode[CUDAGraphMode.PIECEWISE.value], **self._by_mode[CUDAGraphMode.FULL.value]}

    @property
    def entries_by_mode(self) -> dict[CUDAGraphMode, dict[BatchDescriptor, GraphEntry]]:
        """The live entry dicts of every runtime mode this wrapper captures."""
        return {m: self._by_mode[m.value] for m in _CAPTURING if self.matches(m)}

    def __getattr__(self, name: str) -> Any:
        # Only called for missing attributes: forward them to the wrapped model.
        if name in ("runnable", "_runtime_mode", "_by_mode"):
            raise AttributeError(name)
        attr = getattr(self.runnable, name)
        if name in _CHAINED and callable(attr):
            return functools.partial(self._chained, name, attr)
        return attr

    def _chained(self, name: str, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``model.eval()``, ``.to()``... through the wrapper: return the wrapper, drop graphs they invalidate."""
        before = (getattr(self.runnable, "training", None), _weights(self.runnable))
        result = method(*args, **kwargs)
        if (getattr(self.runnable, "training", None), _weights(self.runnable)) != before and self._count():
            logger.info("%s: %s() changed the model's weights or mode; dropping its captured graphs",
                        type(self).__name__, name)
            self.clear_graphs()
        return self if result is self.runnable else result

    def matches(self, mode: CUDAGraphMode) -> bool:
        """Does this wrapper capture (and replay) steps of runtime ``mode``?"""
        return mode == self.runtime_mode

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Hot path: a step this wrapper does not capture must cost next to nothing (goal 500 ns).
        # The mode test is one bit-and of ints, the count a list slot: hashing or comparing Enum
        # members runs Python code and made each passthrough cost microseconds.
        ctx = current_forward_context()
        if ctx is None:
            eager_counts[0] += 1
            return self.runnable(*args, **kwargs)
        if not ctx.mode_bit & self._mode_mask:  # == not self.matches(ctx.runtime_mode)
            eager_counts[ctx.mode_index] += 1
            return self.runnable(*args, **kwargs)
        desc = ctx.batch_descriptor
        if desc is None:
            raise ValueError(
                f"{type(self).__name__}: runtime mode {ctx.runtime_mode.name} needs a batch_descriptor in the "
                "forward context (it keys the graph); pass pb.BatchDescriptor(num_tokens) to set_forward_context"
            )
        if capture_active():  # inside another wrapper's capture: become part of its graph
            return self.runnable(*args, **kwargs)
        if not self._busy.acquire(blocking=False):
            raise RuntimeError(
                f"{type(self).__name__}: a replay or capture of this wrapper is already running (another thread, "
                "or a re-entrant call); its graphs share static buffers and outputs, so one wrapper runs one step "
                "at a time: serialize the steps or give each thread its own wrapper"
            )
        try:
            entry = self._by_mode[ctx.mode_index].get(desc)
            if entry is None:
                return self._capture(ctx, args, kwargs)
            if self.config.debug_checks:
                poison_stale_outputs(self, ctx.mode_index, desc, entry)
            out = entry.replay(args, kwargs)
        finally:
            self._busy.release()
        counters["replays"] += 1
        return out

    @property
    def platform(self) -> Platform:
        if self._platform is None:
            name = config_platform_name(self.config)
            if name is None:
                raise RuntimeError(
                    f"{type(self).__name__} was asked to capture but no CUDA device is present and "
                    "platform='auto'; use CompilationConfig(platform='simulated', compile_pieces='eager') "
                    "to simulate graphs on the CPU, or run with runtime_mode NONE"
                )
            self._platform = get_platform(name)
        return self._platform

    def _capture(self, ctx: ForwardContext, args: tuple, kwargs: dict) -> Any:
        desc, mode = ctx.batch_descriptor, ctx.runtime_mode
        entries = self._by_mode[mode.value]
        if not capture_allowed(ctx):
            raise CaptureDisabledError(
                f"{type(self).__name__}: no graph for {desc} in mode {mode.name} and capture is disabled "
                f"(captured: {sorted(entries, key=lambda d: d.num_tokens) or 'none'}); capture this "
                "descriptor at startup or dispatch it to a captured size"
            )
        warm_up(self.platform, self.runnable, args, kwargs, self.config.num_warmups)  # CUDA only; see CudaPlatform.warm_up
        spec = InputSpec(args, kwargs)  # stages non-persistent inputs: the capture reads static buffers
        bound_args, bound_kwargs = spec.bind(args, kwargs)
        # Under FULL nothing breaks: attention is part of the one graph.
        session = CaptureSession(self.platform, breakable=self.breakable and mode != CUDAGraphMode.FULL,
                                 watch_escapes=self.config.debug_checks or self.platform.name == "simulated")
        runnable = self.runnable if not session.breakable else self._breaking(self.runnable)
        try:
            output = run_session(session, runnable, bound_args, bound_kwargs)
        except RuntimeError as e:
            if HOST_READ not in str(e):
                raise
            explained = _host_read_error(e, session, type(self).__name__, mode, desc)
            if explained is None:
                e.add_note(f"{type(self).__name__}: while capturing {desc} in mode {mode.name}")
                raise
            raise explained from e
        entry = GraphEntry(session.segments, spec, output, grad_touched=session.grad_touched)
        del output
        if self.config.debug_checks:
            poison_stale_outputs(self, mode.value, desc, entry)
        entry.run()  # a capture does not execute: replay once so this call returns real values
        spec.copy_back(spec.note_writes(spec.leaves(args, kwargs)))
        if self.config.debug_checks:
            _check_finite(entry, type(self).__name__, desc)
        entries[desc] = entry
        counters["captures"] += 1
        counters["replays"] += 1
        logger.debug("%s captured %s (%s): %d segments", type(self).__name__, desc, mode.name, len(entry.segments))
        result = entry.result()  # the caller gets the capture-time tensors: alive while it uses them,
        release_capture_memory(self, entry)  # while the entry keeps them only weakly
        return result

    def _breaking(self, runnable: Callable[..., Any]) -> Callable[..., Any]:
        """What a breakable capture of this wrapper runs: ``runnable`` (a breakable wrapper of an uncompiled
        model wraps it so that its splitting ops break, :mod:`.op_breaks`)."""
        return runnable

    def unwrap(self) -> Any:
        """The innermost runnable below this library's wrappers."""
        inner = self.runnable
        return inner.unwrap() if isinstance(inner, GraphWrapper) else inner

    def _count(self) -> int:
        return sum(len(d) for d in self._by_mode)

    def clear_graphs(self) -> None:
        """Drop every captured entry (and its graph memory), in every mode."""
        for d in self._by_mode:
            d.clear()
        release_cached(self._platform)  # give back the pool memory no graph uses any more

    def drop(self, mode: CUDAGraphMode | str, descriptor: BatchDescriptor) -> bool:
        """Drop the entry captured for ``descriptor`` in runtime ``mode``; True when there was one. The
        next call of that key captures again; its pool memory is given back by the next ``release_cached``
        (``clear_graphs`` drops every entry and releases at once)."""
        mode = CUDAGraphMode.parse(mode)
        if mode not in _CAPTURING:
            raise ValueError(
                f"{type(self).__name__}.drop: mode must be PIECEWISE or FULL (a runtime mode with graphs), got {mode.name}"
            )
        return self._by_mode[mode.value].pop(descriptor, None) is not None

    @property
    def captured_on(self) -> Platform | None:
        """The platform this wrapper captures on (None before its first capture)."""
        return self._platform

    def captured(self) -> list[tuple[CUDAGraphMode, BatchDescriptor, GraphEntry]]:
        """Every entry of this wrapper, in every runtime mode, as ``(mode, descriptor, entry)``."""
        return [(CUDAGraphMode(i), d, e) for i, entries in enumerate(self._by_mode) for d, e in entries.items()]

    def set_aside_entries(self) -> tuple[dict[BatchDescriptor, GraphEntry], ...]:
        """Empty this wrapper (as if nothing was captured) and return its entries for
        :meth:`restore_entries`: captures meanwhile capture anew (the memory estimate's scratch pool)."""
        saved, self._by_mode = self._by_mode, tuple({} for _ in self._by_mode)
        return saved

    def restore_entries(self, saved: tuple[dict[BatchDescriptor, GraphEntry], ...] | None) -> None:
        """Put back what :meth:`set_aside_entries` returned, dropping what was captured since (None:
        drop every entry and keep none)."""
        self._by_mode = saved if saved is not None else tuple({} for _ in self._by_mode)

    def __repr__(self) -> str:
        mode = "any" if self.runtime_mode is None else self.runtime_mode.name
        return f"{type(self).__name__}({mode}, entries={self._count()}, runnable={self.runnable!r})"


#: What CUDA (and the simulator) say when a capture reads device data on the host.
HOST_READ = "operation not permitted when stream is capturing"


def _host_read_error(e: RuntimeError, session: CaptureSession, owner: str, mode: CUDAGraphMode,
                     desc: BatchDescriptor) -> RuntimeError | None:
    """The error to raise for a host read in a FULL capture inside a break point, or None (not that case).

    There "move it out of the captured region" points the wrong way: the break point (a splitting
    op, e.g. attention) runs eagerly between PIECEWISE segments, and only FULL graphs hold it. The
    fix is to say the op does not support FULL graphs.
    """
    if mode != CUDAGraphMode.FULL or session.failed_in is None:
        return None
    what = str(e).split("; move it out", 1)[0]
    return RuntimeError(
        f"{owner}: capturing {desc} in mode FULL failed inside the break point {session.failed_in} (a splitting "
        f"op, which a FULL graph holds inline with the rest of the model): {what}. A splitting op that reads "
        "the host runs only eagerly, between PIECEWISE segments: declare its graph support so no FULL graph "
        "holds it, GraphRunner(..., attention_support=AttentionGraphSupport.NEVER) (or register its attention "
        "backend with NEVER; see docs/engine.md), or use cudagraph_mode PIECEWISE. Nothing was captured"
    )


def _check_finite(entry: GraphEntry, owner: str, desc: BatchDescriptor) -> None:
    """debug_checks: a capturing step whose output is not finite most likely ran a break on garbage."""
    for t in tree_leaves(entry.output):
        if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise RuntimeError(
                f"{owner}: the capturing step of {desc} returned NaN/inf (debug_checks). During a capture a break "
                "runs on memory the unexecuted graph before it never wrote, then once more on real data: a break "
                "that accumulates (cache += h) keeps the garbage. Breaks must be idempotent writes (out.copy_(...), "
                "a KV-cache write at fixed slots); the entry was not kept"
            )


class CUDAGraphWrapper(GraphWrapper):
    """Captures the whole call as one graph per descriptor when the context's mode is ``runtime_mode``.

    Break points inside run inline, so they are captured too.
    """

    def __init__(
        self,
        runnable: Callable[..., Any],
        runtime_mode: CUDAGraphMode = CUDAGraphMode.FULL,
        *,
        config: CompilationConfig | None = None,
    ):
        if runtime_mode is None:
            raise ValueError("CUDAGraphWrapper runtime_mode must be PIECEWISE or FULL, got None")
        super().__init__(runnable, runtime_mode, config)


class BreakableCUDAGraphWrapper(GraphWrapper):
    """Captures the call as graph segments split at break points, which run eagerly on replay.

    ``runtime_mode=None`` matches any non-NONE mode; a set mode matches only itself and
    lets every other mode through eagerly without creating an entry. With ``compile_pieces="none"``
    the runnable is the model uncompiled: its captures break at every splitting op of the config (or
    of the registry, read here) through :class:`~.op_breaks.OpBreaks`; a splitting op no mode can see
    (a plain Python callable) is refused here, naming it.
    """

    breakable = True

    def __init__(
        self,
        runnable: Callable[..., Any],
        runtime_mode: CUDAGraphMode | None = None,
        *,
        config: CompilationConfig | None = None,
    ):
        super().__init__(runnable, runtime_mode, config)
        self._op_breaks: OpBreaks | None = None
        if self.config.compile_pieces == "none":
            ops = self.config.splitting_ops if self.config.splitting_ops is not None else registered_splitting_ops()
            self._op_breaks = op_breaks(ops)

    def _breaking(self, runnable: Callable[..., Any]) -> Callable[..., Any]:
        mode = self._op_breaks
        if mode is None:
            return runnable

        def run(*args: Any, **kwargs: Any) -> Any:
            with mode:  # inside the session: captures are serialized, so one thread enters the mode at a time
                return runnable(*args, **kwargs)

        return run

    def matches(self, mode: CUDAGraphMode) -> bool:
        """Any non-NONE mode when ``runtime_mode`` is None, else that mode only."""
        return mode != _NONE and (self.runtime_mode is None or mode == self.runtime_mode)


def unwrap_model(obj: Any) -> Any:
    """The innermost runnable through any stack of this library's wrappers."""
    return obj.unwrap() if isinstance(obj, GraphWrapper) else obj
