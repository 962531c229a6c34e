"""Serve stock Hugging Face decoder models: adapter probe, engine, and tiny random models for tests."""

from .adapter import (
    PROBE_IMPLEMENTATION,
    SERVED_LAYER_TYPES,
    UNDERSTOOD_KWARGS,
    LayerLayout,
    ProbeResult,
    graph_safe_experts,
    layout_refusal,
    probe,
    probe_attention_forward,
    refusal,
)
from .engine import (
    ATTN_IMPLEMENTATION,
    HFEngine,
    StepInfo,
    TokensFirst,
    adapt,
    kv_shape,
    paged_attention_forward,
    register_attention,
)
from .host_breaks import ModuleBreak, install_host_breaks, module_break, no_full_graphs
from .tiny import MAX_PARAMS, TINY, TINY_IF_SET, tiny_random_model

__all__ = [
    "adapt",
    "ATTN_IMPLEMENTATION",
    "HFEngine",
    "kv_shape",
    "paged_attention_forward",
    "register_attention",
    "StepInfo",
    "TokensFirst",
    "graph_safe_experts",
    "LayerLayout",
    "layout_refusal",
    "probe",
    "probe_attention_forward",
    "PROBE_IMPLEMENTATION",
    "ProbeResult",
    "refusal",
    "SERVED_LAYER_TYPES",
    "UNDERSTOOD_KWARGS",
    "ModuleBreak",
    "install_host_breaks",
    "module_break",
    "no_full_graphs",
    "MAX_PARAMS",
    "TINY",
    "TINY_IF_SET",
    "tiny_random_model",
]
