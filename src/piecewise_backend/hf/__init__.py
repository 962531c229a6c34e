"""Serve stock Hugging Face decoder models: adapter probe, engine, and tiny random models for tests."""

from .adapter import (
    PROBE_IMPLEMENTATION,
    SERVED_LAYER_TYPES,
    UNDERSTOOD_KWARGS,
    LayerLayout,
    ProbeResult,
    graph_safe_experts,
    layout_refusal,
    length_refusal,
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
    chunked_layers,
    kv_shape,
    paged_attention_forward,
    register_attention,
)
from .tiny import MAX_PARAMS, TINY, TINY_IF_SET, tiny_random_model

__all__ = [
    "adapt",
    "chunked_layers",
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
    "length_refusal",
    "probe",
    "probe_attention_forward",
    "PROBE_IMPLEMENTATION",
    "ProbeResult",
    "refusal",
    "SERVED_LAYER_TYPES",
    "UNDERSTOOD_KWARGS",
    "MAX_PARAMS",
    "TINY",
    "TINY_IF_SET",
    "tiny_random_model",
]
