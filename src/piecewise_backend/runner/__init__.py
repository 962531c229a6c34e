"""The engine-facing layer: assembly (wrap_model, mode resolution), dispatcher, GraphRunner (its step buffers and
step function), capture orchestration."""

from .agreement import PeerCaptureError, check_same_step, init_tensor_parallel
from .assembly import clear_graphs, drop_full_graphs, resolve_cudagraph_mode, validate_capture_coverage, wrap_model
from .buffers import StepBuffers
from .dispatcher import CudagraphDispatcher
from .graph_runner import EAGER_REASONS, GraphRunner, StepResult
from .lazy import CaptureFailure
from .orchestration import CaptureReport
from .static_inputs import StaticInput
from .step import ModelStep, Step

__all__ = [
    "clear_graphs",
    "drop_full_graphs",
    "resolve_cudagraph_mode",
    "validate_capture_coverage",
    "wrap_model",
    "CudagraphDispatcher",
    "GraphRunner",
    "StepResult",
    "EAGER_REASONS",
    "CaptureFailure",
    "CaptureReport",
    "StaticInput",
    "StepBuffers",
    "ModelStep",
    "Step",
    "check_same_step",
    "init_tensor_parallel",
    "PeerCaptureError",
]
