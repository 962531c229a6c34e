"""The per-request state cache of state-space and linear-attention layers, and their splitting ops
(short/causal convolution, gated and Kimi delta rules, Mamba2 SSD scan, Mamba1 selective scan, lightning
attention, the diagonal linear recurrence of RG-LRU, a causal window of recent inputs)."""

from .cache import SlotAllocator, StateCache, StateSpec
from .conv import causal_conv1d, conv_sequence, conv_step
from .delta import delta_sequence, delta_step, gated_delta_rule
from .kda import kda_rule, kda_sequence, kda_step
from .lightning import lightning_attention, lightning_sequence, lightning_step
from .lru import linear_recurrence, recurrence_sequence, recurrence_step
from .metadata import STATE_INDEX, StateMetadata, current_state_metadata
from .selective import selective_scan, selective_sequence, selective_step
from .ssd import ssd_scan, ssd_sequence, ssd_step
from .window import causal_window, window_sequence, window_step

__all__ = [
    "SlotAllocator", "StateCache", "StateSpec",
    "causal_conv1d", "conv_sequence", "conv_step",
    "delta_sequence", "delta_step", "gated_delta_rule",
    "kda_rule", "kda_sequence", "kda_step",
    "lightning_attention", "lightning_sequence", "lightning_step",
    "linear_recurrence", "recurrence_sequence", "recurrence_step",
    "STATE_INDEX", "StateMetadata", "current_state_metadata",
    "selective_scan", "selective_sequence", "selective_step",
    "ssd_scan", "ssd_sequence", "ssd_step",
    "causal_window", "window_sequence", "window_step",
]
