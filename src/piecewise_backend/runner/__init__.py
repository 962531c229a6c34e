"""The engine-facing layer: assembly (wrap_model, mode resolution), dispatcher, GraphRunner, capture orchestration."""

from .agreement import PeerCaptureError, check_same_step, init_tensor_parallel
from .assembly import clear_graphs, drop_full_graphs, resolve_cudagraph_mode, validate_capture_coverage, wrap_model
from .dispatcher import CudagraphDispatcher
from .graph_runner import GraphRunner
from .orchestration import CaptureReport
from .static_inputs import StaticInput

__all__ = [
    "clear_graphs",
    "drop_full_graphs",
    "resolve_cudagraph_mode",
    "validate_capture_coverage",
    "wrap_model",
    "CudagraphDispatcher",
    "GraphRunner",
    "CaptureReport",
    "StaticInput",
    "check_same_step",
    "init_tensor_parallel",
    "PeerCaptureError",
]
