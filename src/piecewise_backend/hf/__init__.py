"""Serve stock Hugging Face decoder models on :mod:`piecewise_backend.serve`: adapter probe, HFEngine, SpecEngine, tiny random models."""

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
from .adaptation import Mechanism, TokensFirst, adapt, kv_shape
from .engine import HFEngine
from .paged_attention import (
    ATTN_IMPLEMENTATION,
    AdaptedAttention,
    chunked_layers,
    paged_attention_forward,
    register_attention,
)
from ..serve.loop import RequestOutput, StepInfo
from ..serve.sampling import SamplingParams
from .speculative import SpecEngine, truncated_drafter
from .host_breaks import ModuleBreak, host_read_downgrades, install_host_breaks, module_break, no_full_graphs
from .fixture_aliases import __getattr__  # noqa: F401  (hf.tiny_random_model, hf.TINY, ...: loaded on first use)

__all__ = [
    "adapt",
    "AdaptedAttention",
    "Mechanism",
    "chunked_layers",
    "ATTN_IMPLEMENTATION",
    "HFEngine",
    "SpecEngine",
    "truncated_drafter",
    "kv_shape",
    "paged_attention_forward",
    "register_attention",
    "TokensFirst",
    "SamplingParams",
    "RequestOutput",
    "StepInfo",
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
    "ModuleBreak",
    "install_host_breaks",
    "module_break",
    "no_full_graphs",
    "host_read_downgrades",
    "MAX_PARAMS",
    "TINY",
    "TINY_IF_SET",
    "tiny_random_model",
    "tiny_random_vlm",
    "random_mm_inputs",
]
