"""The per-request state cache of state-space and linear-attention layers, and their splitting ops
(short/causal convolution, gated delta rule, Mamba2 SSD scan, Mamba1 selective scan)."""

from .cache import SlotAllocator, StateCache, StateSpec
from .conv import causal_conv1d, conv_sequence, conv_step
from .delta import delta_sequence, delta_step, gated_delta_rule
from .metadata import STATE_INDEX, StateMetadata, current_state_metadata
from .selective import selective_scan, selective_sequence, selective_step
from .ssd import ssd_scan, ssd_sequence, ssd_step

__all__ = [
    "SlotAllocator", "StateCache", "StateSpec",
    "causal_conv1d", "conv_sequence", "conv_step",
    "delta_sequence", "delta_step", "gated_delta_rule",
    "STATE_INDEX", "StateMetadata", "current_state_metadata",
    "selective_scan", "selective_sequence", "selective_step",
    "ssd_scan", "ssd_sequence", "ssd_step",
]
