"""The CUDA platform: one graph pool per generation, a capture stream, recovery after a failed capture."""

from .graphs import CudaGraphSegment, CudaRecorder, EmptyGraph, graph_of
from .platform import CudaPlatform, platform_for
from .pools import Generation, Generations
from .recovery import RULES, CaptureInvalidatedError
from .streams import (
    capture_open,
    captures_open,
    exclusive,
    lt_gemm,
    new_capture_stream,
    new_comm_stream,
    note_workspaces_cleared,
    on_stream,
    warm_blas,
    workspaces_cleared,
)

__all__ = [
    "CudaPlatform",
    "platform_for",
    "CudaGraphSegment",
    "CudaRecorder",
    "EmptyGraph",
    "graph_of",
    "Generation",
    "Generations",
    "CaptureInvalidatedError",
    "RULES",
    "capture_open",
    "captures_open",
    "exclusive",
    "lt_gemm",
    "new_capture_stream",
    "new_comm_stream",
    "note_workspaces_cleared",
    "on_stream",
    "warm_blas",
    "workspaces_cleared",
]
