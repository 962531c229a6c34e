"""Micro-batching (dual-batch overlap): two CPU threads hand the CPU over around communication."""

from .handover import NUM_UBATCHES, Handover, UBatchAborted, UBatchTimeoutError
from .streams import CommStreams, StepStreams
from .threads import (
    DEFAULT_TIMEOUT_S,
    UBatchThreads,
    capture_state,
    current_ubatch,
    dbo_comm,
    dbo_maybe_run_recv_hook,
    dbo_register_recv_hook,
    dbo_yield,
    inherited_state,
)
from .wrapper import UBatchSlice, UBatchWrapper, combine_outputs

__all__ = [
    "capture_state",
    "current_ubatch",
    "dbo_comm",
    "dbo_maybe_run_recv_hook",
    "dbo_register_recv_hook",
    "dbo_yield",
    "DEFAULT_TIMEOUT_S",
    "inherited_state",
    "UBatchThreads",
    "Handover",
    "NUM_UBATCHES",
    "UBatchAborted",
    "UBatchTimeoutError",
    "CommStreams",
    "StepStreams",
    "combine_outputs",
    "UBatchSlice",
    "UBatchWrapper",
]
