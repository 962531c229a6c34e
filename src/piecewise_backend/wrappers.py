"""CUDAGraphWrapper (one graph per descriptor) and BreakableCUDAGraphWrapper (segments with breaks).

Outputs returned by a replay live in graph memory shared by every graph of the pool:
they stay valid only until the next replay of any graph. Copy what you keep.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import keystr, tree_flatten_with_path

from .capture import CaptureDisabledError, CaptureSession, EagerSegment, capture_active, capture_enabled, run_session
from .config import CompilationConfig
from .context import _CONTEXT, BatchDescriptor, ForwardContext
from .memory import poison_stale_outputs, release_cached, release_capture_memory
from .modes import CUDAGraphMode
from .observability import counters, eager_counts, logger
from .platforms import Graph, Platform, get_platform, resolve_platform_name

_NONE = CUDAGraphMode.NONE


class GraphEntry:
    """What one descriptor captured: segments to replay, static inputs, the output."""

    __slots__ = ("segments", "inputs", "scalars", "flat_args", "num_leaves", "output")

    def __init__(self, segments: list[Graph | EagerSegment], args: tuple, kwargs: dict, output: Any):
        self.segments, self.output = segments, output
        # Plain positional tensors/scalars (the common case) skip pytree on every replay.
        self.flat_args = not kwargs and all(isinstance(a, (torch.Tensor, int, float, bool, type(None))) for a in args)
        if self.flat_args:
            named = [(f"args[{i}]", a) for i, a in enumerate(args)]
        else:
            named = [(_arg_name(path), a) for path, a in tree_flatten_with_path((args, kwargs))[0]]
        self.num_leaves = len(named)
        self.inputs = [(name, i, a, a.data_ptr()) for i, (name, a) in enumerate(named) if isinstance(a, torch.Tensor)]
        # A graph bakes Python scalars in: replaying it for another value would be silently wrong.
        self.scalars = [(name, i, a) for i, (name, a) in enumerate(named) if isinstance(a, (int, float, bool))]

    @property
    def num_graphs(self) -> int:
        return sum(not isinstance(s, EagerSegment) for s in self.segments)

    def check_inputs(self, args: tuple, kwargs: dict) -> None:
        if self.flat_args and not kwargs:
            leaves: Any = args
        else:
            leaves = [leaf for _, leaf in tree_flatten_with_path((args, kwargs))[0]]
        if len(leaves) != self.num_leaves:
            raise ValueError(f"replay got {len(leaves)} input leaves, the capture had {self.num_leaves}")
        for name, i, captured, ptr in self.inputs:
            new = leaves[i]
            if new.data_ptr() == ptr and new.shape == captured.shape:  # buf[:n] keeps the address
                continue
            if new.shape != captured.shape or new.dtype != captured.dtype or new.device != captured.device:
                raise ValueError(
                    f"input {name} moved and no longer fits the captured buffer: captured "
                    f"{tuple(captured.shape)} {captured.dtype} on {captured.device}, got {tuple(new.shape)} "
                    f"{new.dtype} on {new.device}; pass a static buffer of the captured shape or clear_graphs()"
                )
            captured.copy_(new)  # graphs read fixed addresses: bring the new data to the captured one
        for name, i, value in self.scalars:
            if leaves[i] != value:
                raise ValueError(
                    f"input {name} was {value!r} at capture and is {leaves[i]!r} now; a graph replays the "
                    "captured value, so pass it as a tensor or key it into the BatchDescriptor"
                )

    def replay(self) -> Any:
        for seg in self.segments:
            seg.replay()
        return self.output


class _GraphWrapper:
    breakable = False

    def __init__(self, runnable: Callable[..., Any], runtime_mode: CUDAGraphMode | None, config: CompilationConfig | None):
        if not callable(runnable):
            raise TypeError(f"{type(self).__name__} needs a callable runnable, got {type(runnable).__name__}")
        if config is not None and not isinstance(config, CompilationConfig):
            raise TypeError(f"config must be a CompilationConfig or None, got {type(config).__name__}")
        self.runnable = runnable
        self.runtime_mode = runtime_mode
        self.config = config or CompilationConfig()
        self.entries: dict[BatchDescriptor, GraphEntry] = {}
        self._platform: Platform | None = None

    @property
    def runtime_mode(self) -> CUDAGraphMode | None:
        return self._runtime_mode

    @runtime_mode.setter
    def runtime_mode(self, mode: CUDAGraphMode | str | None) -> None:
        if mode is not None:
            mode = CUDAGraphMode.parse(mode)
            if mode not in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL):
                raise ValueError(f"{type(self).__name__} runtime_mode must be PIECEWISE or FULL, got {mode.name}")
        self._runtime_mode = mode
        # bit m.value set for every runtime mode this wrapper captures (see __call__)
        self._mode_mask = sum(1 << m.value for m in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL) if self._matches(m))

    def __getattr__(self, name: str) -> Any:
        # Only called for missing attributes: forward them to the wrapped model.
        if name in ("runnable", "_runtime_mode"):
            raise AttributeError(name)
        return getattr(self.runnable, name)

    def _matches(self, mode: CUDAGraphMode) -> bool:
        return mode == self.runtime_mode

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Hot path: a step this wrapper does not capture must cost next to nothing (goal 500 ns).
        # The mode test is one bit-and of ints, the count a list slot: hashing or comparing Enum
        # members runs Python code and made each passthrough cost microseconds.
        ctx = _CONTEXT.get()
        if ctx is None:
            eager_counts[0] += 1
            return self.runnable(*args, **kwargs)
        if not ctx._mode_bit & self._mode_mask:  # == not self._matches(ctx.runtime_mode)
            eager_counts[ctx._mode_index] += 1
            return self.runnable(*args, **kwargs)
        mode = ctx.runtime_mode
        if ctx.batch_descriptor is None:
            raise ValueError(
                f"{type(self).__name__}: runtime mode {mode.name} needs a batch_descriptor in the forward "
                "context (it keys the graph); pass pb.BatchDescriptor(num_tokens) to set_forward_context"
            )
        if capture_active():  # inside another wrapper's capture: become part of its graph
            return self.runnable(*args, **kwargs)
        entry = self.entries.get(ctx.batch_descriptor)
        captured = entry is None
        if captured:
            entry = self._capture(ctx, mode, args, kwargs)
        else:
            entry.check_inputs(args, kwargs)
        if self.config.debug_checks:
            poison_stale_outputs(self, ctx.batch_descriptor, entry, (args, kwargs))
        counters["replays"] += 1
        out = entry.replay()
        if captured:  # the caller gets the capture-time tensors (alive while it uses them);
            release_capture_memory(self, entry)  # the entry keeps them only weakly
        return out

    @property
    def platform(self) -> Platform:
        if self._platform is None:
            name = resolve_platform_name(self.config.platform)
            if name is None:
                raise RuntimeError(
                    f"{type(self).__name__} was asked to capture but no CUDA device is present and "
                    "platform='auto'; use CompilationConfig(platform='simulated', compile_pieces='eager') "
                    "to simulate graphs on the CPU, or run with runtime_mode NONE"
                )
            self._platform = get_platform(name)
        return self._platform

    def _capture(self, ctx: ForwardContext, mode: CUDAGraphMode, args: tuple, kwargs: dict) -> GraphEntry:
        desc = ctx.batch_descriptor
        if not capture_enabled() or not getattr(ctx, "allow_capture", True):
            raise CaptureDisabledError(
                f"{type(self).__name__}: no graph for {desc} in mode {mode.name} and capture is disabled "
                f"(captured: {sorted(self.entries, key=lambda d: d.num_tokens) or 'none'}); capture this "
                "descriptor at startup or dispatch it to a captured size"
            )
        # Under FULL nothing breaks: attention is part of the one graph.
        session = CaptureSession(self.platform, breakable=self.breakable and mode != CUDAGraphMode.FULL)
        output = run_session(session, self.runnable, args, kwargs)
        entry = GraphEntry(session.segments, args, kwargs, output)
        self.entries[desc] = entry
        counters["captures"] += 1
        logger.debug("%s captured %s (%s): %d segments", type(self).__name__, desc, mode.name, len(entry.segments))
        return entry

    def unwrap(self) -> Any:
        """The innermost runnable below this library's wrappers."""
        inner = self.runnable
        return inner.unwrap() if isinstance(inner, _GraphWrapper) else inner

    def clear_graphs(self) -> None:
        """Drop every captured entry and give the pool memory no graph uses back."""
        self.entries.clear()
        release_cached(self._platform)

    def __repr__(self) -> str:
        mode = "any" if self.runtime_mode is None else self.runtime_mode.name
        return f"{type(self).__name__}({mode}, entries={len(self.entries)}, runnable={self.runnable!r})"




class CUDAGraphWrapper(_GraphWrapper):
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


class BreakableCUDAGraphWrapper(_GraphWrapper):
    """Captures the call as graph segments split at break points, which run eagerly on replay.

    ``runtime_mode=None`` matches any non-NONE mode; a set mode matches only itself and
    lets every other mode through eagerly without creating an entry.
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

    def _matches(self, mode: CUDAGraphMode) -> bool:
        return self.runtime_mode is None or mode == self.runtime_mode


def _arg_name(path: tuple) -> str:
    head, rest = path[0], keystr(path[1:])
    return ("args" if getattr(head, "idx", 0) == 0 else "kwargs") + rest


def unwrap_model(obj: Any) -> Any:
    """The innermost runnable through any stack of this library's wrappers."""
    return obj.unwrap() if isinstance(obj, _GraphWrapper) else obj
