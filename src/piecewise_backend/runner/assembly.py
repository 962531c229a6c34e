"""Assembly: stack the wrappers a mode needs, prove coverage, drop graphs (mode resolution: :mod:`.mode_policy`,
re-exported here)."""

from __future__ import annotations

from typing import Any

from ..backend.compiler import PiecewiseBackend
from ..capture.wrappers import BreakableCUDAGraphWrapper, CUDAGraphWrapper, GraphWrapper
from ..config import CompilationConfig
from ..context import BatchDescriptor
from ..modes import CUDAGraphMode
from ..platforms.registry import effective_mode
from ..ubatch.wrapper import UBatchWrapper
from .dispatcher import CudagraphDispatcher
from .mode_policy import drop_full_graphs, resolve_cudagraph_mode

__all__ = [
    "clear_graphs", "drop_full_graphs", "drop_graph", "find_backend", "resolve_cudagraph_mode",
    "validate_capture_coverage", "wrap_model",
]

_NONE, _PIECEWISE, _FULL = CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL


def wrap_model(model: Any, config: CompilationConfig, *, drafter: bool = False) -> Any:
    """Stack the wrappers ``config`` asks for around ``model``.

    Two independent conditions: any mode but NONE installs the breakable PIECEWISE
    wrapper (so a later FULL -> FULL_AND_PIECEWISE upgrade still has a capturer); a mode
    with full graphs also installs the FULL wrapper around it, except for a drafter,
    which only ever dispatches PIECEWISE or NONE. With ``use_ubatching`` (not for a
    drafter) a :class:`UBatchWrapper` replaces both: FULL when the mode has full graphs,
    else NONE (micro-batched steps then run eagerly in their two threads).
    """
    if not isinstance(config, CompilationConfig):
        raise TypeError(f"wrap_model takes a CompilationConfig, got {type(config).__name__}")
    mode = config.cudagraph_mode  # structural: GraphRunner applies effective_mode() first
    if config.use_ubatching and not drafter:
        return UBatchWrapper(model, config, _FULL if mode.has_full_cudagraphs() else _NONE)
    if mode == _NONE:
        return model
    wrapped = model
    if config.use_breakable:
        wrapped = BreakableCUDAGraphWrapper(wrapped, _PIECEWISE, config=config)
    if mode.has_full_cudagraphs() and not drafter:
        wrapped = CUDAGraphWrapper(wrapped, _FULL, config=config)
    return wrapped


def _wrappers(model: Any) -> list[GraphWrapper]:
    stack = []
    while isinstance(model, GraphWrapper):
        stack.append(model)
        model = model.runnable
    return stack


def find_backend(model: Any) -> PiecewiseBackend | None:
    """Best effort: the PiecewiseBackend a ``torch.compile``d model (below any wrappers) was compiled with."""
    model = model.unwrap() if isinstance(model, GraphWrapper) else model
    obj: Any = getattr(getattr(model, "dynamo_ctx", None), "callback", None)
    for _ in range(8):  # torch nests its own wrappers around the user's backend
        if obj is None or isinstance(obj, PiecewiseBackend):
            return obj
        obj = (
            getattr(obj, "_torchdynamo_orig_backend", None)
            or getattr(obj, "_inner_convert", None)
            or getattr(obj, "compiler_fn", None)  # torch._TorchCompileWrapper holds the user's backend here
        )
    return None


def _per_piece_backend(model: Any) -> bool:
    """Is the innermost model compiled by a backend with per-piece PIECEWISE wrappers?"""
    backend = find_backend(model)
    return backend is not None and not backend.config.use_breakable and effective_mode(backend.config) != _NONE


def clear_graphs(model: Any) -> None:
    """Drop every graph ``model`` captured: its wrapper stack's and its backend's per-piece wrappers'.

    The model-level counterpart of ``wrapper.clear_graphs()``; per-piece wrappers
    (``use_breakable=False``) live inside the compiled model, where only this reaches them.
    """
    for wrapper in _wrappers(model):
        wrapper.clear_graphs()
    backend = find_backend(model)
    if backend is not None:
        backend.clear_graphs()


def drop_graph(model: Any, mode: CUDAGraphMode, desc: BatchDescriptor) -> bool:
    """Drop the graphs of one ``(mode, desc)`` of ``model`` (wrapper stack, micro-batched and per-piece
    entries: each one's ``drop``); the pool memory they used is given back by the next ``release_cached``.
    True when any was dropped."""
    dropped = [wrapper.drop(mode, desc) for wrapper in _wrappers(model)]
    backend = find_backend(model)
    if backend is not None:
        dropped.append(backend.drop(mode, desc))
    return any(dropped)


def validate_capture_coverage(model: Any, dispatcher: CudagraphDispatcher) -> None:
    """Raise ValueError if some (mode, descriptor) the dispatcher can emit reaches no capturer."""
    stack = _wrappers(model)
    per_piece = _per_piece_backend(model)
    for mode in (_PIECEWISE, _FULL):
        if not dispatcher.keys[mode]:
            continue
        if any(w.matches(mode) for w in stack) or (mode == _PIECEWISE and per_piece):
            continue
        desc: BatchDescriptor = max(dispatcher.keys[mode], key=lambda d: d.num_tokens)
        installed = ", ".join(
            f"{type(w).__name__}({'any' if w.runtime_mode is None else w.runtime_mode.name})" for w in stack
        )
        if mode == _PIECEWISE and any(isinstance(w, UBatchWrapper) for w in stack):
            raise ValueError(
                f"no capturer for mode PIECEWISE (e.g. {desc}): with use_ubatching the model has "
                f"[{installed}] and no breakable wrapper; use a mode without PIECEWISE graphs (FULL_DECODE_ONLY, "
                "FULL, NONE) or use_breakable=False (per-piece graphs inside the compiled model)"
            )
        raise ValueError(
            f"no capturer for mode {mode.name} (e.g. {desc}): the dispatcher ({dispatcher.mode.name}) can emit it "
            f"but the model has [{installed or 'no wrappers'}]; build the model with "
            f"pb.wrap_model(model, config) for the same cudagraph_mode"
        )
