"""Serve stock Hugging Face decoder models on :mod:`piecewise_backend.serve`: adapter probe, HFEngine, SpecEngine, tiny random models."""

import functools
import inspect
from typing import Any

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
from .host_breaks import ModuleBreak, install_host_breaks, module_break, no_full_graphs
from . import mixers

#: Test fixtures of :mod:`piecewise_backend.testing.hf_models`, importable from here as documented: aliases
#: loaded on first use (testing imports nothing of hf: ``tiny_random_model`` is given what hf serves).
_FIXTURES = frozenset({"MAX_PARAMS", "TINY", "TINY_IF_SET", "tiny_random_model"})


def __getattr__(name: str) -> Any:
    if name not in _FIXTURES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from ..testing import hf_models

    value = getattr(hf_models, name)
    if name == "tiny_random_model":  # the fixture, given what hf serves; its signature the documented one
        given = {"served_layer_types": SERVED_LAYER_TYPES, "state_layers": mixers.candidates}
        fixture = functools.update_wrapper(functools.partial(value, **given), value)
        del fixture.__wrapped__
        signature = inspect.signature(value)
        fixture.__signature__ = signature.replace(parameters=[p for p in signature.parameters.values() if p.name not in given])
        value = fixture
    globals()[name] = value  # loaded once
    return value


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
    "MAX_PARAMS",
    "TINY",
    "TINY_IF_SET",
    "tiny_random_model",
]
