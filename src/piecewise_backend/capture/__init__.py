"""The capture layer: sessions and break points, entries, graph memory, and the two wrappers."""

from .entry import GraphEntry
from .memory import (
    captured_wrappers,
    fresh_pool,
    graphs_created,
    owner_test,
    poison,
    poison_stale_outputs,
    release_cached,
    release_capture_memory,
    scratch_pool,
)
from .session import (
    BreakPoint,
    CaptureDisabledError,
    CaptureSession,
    EagerSegment,
    bulk_capture,
    call_break,
    capture_active,
    capture_allowed,
    capture_enabled,
    eager_break,
    gc_managed,
    run_session,
    set_capture_enabled,
)
from .wrappers import BreakableCUDAGraphWrapper, CUDAGraphWrapper, unwrap_model

__all__ = [
    "BreakPoint",
    "bulk_capture",
    "call_break",
    "capture_active",
    "capture_allowed",
    "capture_enabled",
    "CaptureDisabledError",
    "CaptureSession",
    "eager_break",
    "EagerSegment",
    "gc_managed",
    "run_session",
    "set_capture_enabled",
    "GraphEntry",
    "captured_wrappers",
    "fresh_pool",
    "graphs_created",
    "owner_test",
    "poison",
    "poison_stale_outputs",
    "release_cached",
    "release_capture_memory",
    "scratch_pool",
    "BreakableCUDAGraphWrapper",
    "CUDAGraphWrapper",
    "unwrap_model",
]
