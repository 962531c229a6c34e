"""piecewise_backend: piecewise and breakable CUDA graph capture for any PyTorch inference engine."""

from . import testing
from .assembly import effective_mode, resolve_cudagraph_mode, validate_capture_coverage, wrap_model
from .backend import PiecewiseBackend, make_backend, piecewise_breakable, register
from .capture import BreakPoint, CaptureDisabledError, capture_enabled, eager_break, set_capture_enabled
from .config import CompilationConfig, default_capture_sizes
from .context import BatchDescriptor, ForwardContext, get_forward_context, is_forward_context_available, set_forward_context
from .dispatch import CudagraphDispatcher
from .modes import AttentionGraphSupport, CUDAGraphMode
from .observability import COUNTER_KEYS, counters, expect, reset_counters
from .ops import register_splitting_op, registered_splitting_ops, unregister_splitting_op
from .runner import CaptureReport, GraphRunner, StaticInput
from .split import Piece, SplitGraph, split_graph
from .wrappers import BreakableCUDAGraphWrapper, CUDAGraphWrapper, GraphEntry, unwrap_model

__version__ = "0.1.0"
from .assembly import clear_graphs
from .inputs import mark_persistent
from .platforms.cuda import CaptureInvalidatedError
from .weak import is_weak, weak_ref_tensor, weak_ref_tensors
from .aot import CompiledModel, aot_compile, load_compiled
from .shapes import mark_token_dim
from .ubatch import dbo_comm, dbo_maybe_run_recv_hook, dbo_register_recv_hook, dbo_yield
from .ubatch_wrapper import UBatchSlice, UBatchWrapper
