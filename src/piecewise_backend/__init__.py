"""piecewise_backend: piecewise and breakable CUDA graph capture for any PyTorch inference engine.

The public names of docs/api.md (design: docs/design.md), grouped by layer from the bottom up; each lives in
the module named on its line (see docs/architecture.md).
"""

# ruff: noqa: I001  (imports grouped by layer, bottom up, not alphabetically)

# core: modes, context, config, ops, observability, weak references, shapes, inputs, testing
from . import testing
from .config import CompilationConfig, default_capture_sizes
from .context import (
    BatchDescriptor,
    ForwardContext,
    current_forward_context,
    get_forward_context,
    is_forward_context_available,
    set_forward_context,
)
from .inputs import mark_persistent
from .modes import AttentionGraphSupport, CUDAGraphMode
from .observability import COUNTER_KEYS, counters, expect, reset_counters
from .ops import register_splitting_op, registered_splitting_ops, unregister_splitting_op
from .shapes import mark_token_dim
from .version import __version__
from .weak import is_weak, weak_ref_tensor, weak_ref_tensors

# platforms
from .platforms.cuda.recovery import CaptureInvalidatedError
from .platforms.registry import effective_mode

# capture: sessions, break points, entries, wrappers
from .capture.entry import GraphEntry
from .capture.graph import (
    BreakableCUDAGraph,
    BreakableGraph,
    CUDAGraphSequence,
    GraphPool,
    breakable_graph,
    piecewise_graph,
)
from .capture.session import (
    BreakPoint,
    CaptureDisabledError,
    capture_enabled,
    eager_break,
    force_break,
    force_no_graph,
    is_in_breakable_graph,
    is_in_piecewise_graph,
    no_graph,
    set_capture_enabled,
)
from .capture.wrappers import BreakableCUDAGraphWrapper, CUDAGraphWrapper, unwrap_model

# backend: split, compile, AOT
from .backend.aot import CompiledModel, aot_compile, load_compiled
from .backend.compiler import PiecewiseBackend, make_backend, piecewise_breakable, register
from .backend.split import Piece, SplitGraph, split_graph

# ubatch: micro-batching
from .ubatch.threads import dbo_comm, dbo_maybe_run_recv_hook, dbo_register_recv_hook, dbo_yield
from .ubatch.wrapper import UBatchSlice, UBatchWrapper

# runner: assembly, dispatch, GraphRunner
from .runner.assembly import clear_graphs, resolve_cudagraph_mode, validate_capture_coverage, wrap_model
from .runner.dispatcher import CudagraphDispatcher
from .runner.graph_runner import GraphRunner
from .runner.orchestration import CaptureReport
from .runner.static_inputs import StaticInput

__all__ = [
    # core
    "testing", "CompilationConfig", "default_capture_sizes", "BatchDescriptor", "ForwardContext",
    "current_forward_context", "get_forward_context", "is_forward_context_available", "set_forward_context",
    "mark_persistent",
    "AttentionGraphSupport", "CUDAGraphMode", "COUNTER_KEYS", "counters", "expect", "reset_counters",
    "register_splitting_op", "registered_splitting_ops", "unregister_splitting_op", "mark_token_dim",
    "__version__", "is_weak", "weak_ref_tensor", "weak_ref_tensors",
    # platforms
    "CaptureInvalidatedError", "effective_mode",
    # capture
    "GraphEntry", "BreakableCUDAGraph", "BreakableGraph", "GraphPool", "breakable_graph", "BreakPoint",
    "CaptureDisabledError", "capture_enabled", "eager_break", "force_break", "is_in_breakable_graph",
    "set_capture_enabled",
    # the same objects under the names of piecewise-cuda-graphs and PyTorch's proposed torch.cuda API
    "CUDAGraphSequence", "piecewise_graph", "no_graph", "force_no_graph", "is_in_piecewise_graph",
    "BreakableCUDAGraphWrapper", "CUDAGraphWrapper", "unwrap_model",
    # backend
    "CompiledModel", "aot_compile", "load_compiled", "PiecewiseBackend", "make_backend", "piecewise_breakable",
    "register", "Piece", "SplitGraph", "split_graph",
    # ubatch
    "dbo_comm", "dbo_maybe_run_recv_hook", "dbo_register_recv_hook", "dbo_yield", "UBatchSlice", "UBatchWrapper",
    # runner
    "clear_graphs", "resolve_cudagraph_mode", "validate_capture_coverage", "wrap_model", "CudagraphDispatcher",
    "GraphRunner", "CaptureReport", "StaticInput",
]
