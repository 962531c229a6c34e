"""The ``pb_paged`` attention: transformers' AttentionInterface entry onto ``pb_kv``'s paged ops, and each
attention module's adapted state.

:func:`register_attention` adds ``pb_paged`` to the interface: HF's q/k/v (after RoPE) go to
``pb_kv::paged_attention`` (or ``pb_kv::indexed_attention`` given an indexer's ``indices``), which
reads the step's metadata from the forward context. What :func:`~piecewise_backend.hf.adapt` learnt
of a module (the cache's head dim, the repeat of its KV heads, its cache layer, ...) is one frozen
:class:`AdaptedAttention` on the module (:data:`ADAPTED_ATTR`), set once by :data:`MECHANISM` after
the probe and read once per call by :func:`paged_attention_forward`: Dynamo guards on it as on any
module attribute.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .adapted_state import ADAPTED_ATTR, SLOPES_BUFFER, AdaptedAttention
from .indexed import indexers
from .patching import Changes, Undo
from .modality import can_set_attention, text_attention
from .probe_result import ProbeResult, layout_refusal
from .transformers_lib import transformers_module

ATTN_IMPLEMENTATION = "pb_paged"


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """AttentionInterface entry: ``query`` (1, heads, tokens, dim) -> ((1, tokens, heads, v_dim), None).

    q/k/v are zero-padded to the cache's head dim (the module's :class:`AdaptedAttention`) when
    narrower, which leaves the scores unchanged (the scale is the unpadded one); the output is sliced
    back. A layer with fewer KV heads than the cache repeats each ``kv_repeat`` times: query head ``h``
    still meets KV head ``h // (heads // kv_heads)``.
    """
    if query.shape[0] != 1:
        raise ValueError(f"{ATTN_IMPLEMENTATION} attention takes the tokens-first layout (batch of 1 row), got batch {query.shape[0]}")
    state: AdaptedAttention | None = getattr(module, ADAPTED_ATTR, None)
    if state is None:  # a module adapt never saw (register_attention used alone): its own layout
        state = AdaptedAttention(query.shape[-1], kv_layer=module.layer_idx)
    sinks = kwargs.get("s_aux")  # gpt-oss style: one logit per query head in each softmax denominator
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    dim, v_dim = state.head_dim, value.shape[-1]
    if state.kv_repeat > 1:
        key, value = key.repeat_interleave(state.kv_repeat, dim=1), value.repeat_interleave(state.kv_repeat, dim=1)
    q, k, v = (F.pad(t[0], (0, dim - t.shape[-1])).transpose(0, 1).contiguous() for t in (query, key, value))
    out = torch.empty_like(q)
    layer = state.call_sites.next(module) if state.call_sites is not None else state.kv_layer
    selected = kwargs.get("indices")  # an indexer's top-k positions (1, tokens, topk): indexed attention
    if selected is not None:
        if sliding_window or softcap:
            raise ValueError(f"{ATTN_IMPLEMENTATION}: indexed attention takes no sliding window or soft-capping")
        torch.ops.pb_kv.indexed_attention(q, k, v, out, selected[0], layer, scale, sinks)
        return out[..., :v_dim].unsqueeze(0), None
    slopes = getattr(module, SLOPES_BUFFER) if state.alibi else None
    torch.ops.pb_kv.paged_attention(
        q, k, v, out, layer, scale, sliding_window or -1, float(softcap or 0.0), sinks, state.chunk_size, slopes,
    )
    return out[..., :v_dim].unsqueeze(0), None


def register_attention() -> str:
    """Register ``pb_paged`` with transformers' AttentionInterface (idempotent); returns the name."""
    transformers_module().AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION


def chunked_layers(model: torch.nn.Module) -> dict[int, int]:
    """``{layer: attention_chunk_size}`` of the layers ``layer_types`` marks ``chunked_attention`` (llama4)."""
    text = model.config.get_text_config()
    chunk = getattr(text, "attention_chunk_size", None) or 0
    kinds = getattr(text, "layer_types", None) or ()
    return {i: chunk for i, kind in enumerate(kinds) if kind == "chunked_attention" and chunk}


class PagedAttention:
    """The mechanism that puts the probed attention layers on ``pb_paged``: each module's
    :class:`AdaptedAttention` (and each indexer's cache layer), then the model's attention implementation.
    Refuses what the probe saw the paged attention would compute wrongly (:func:`.probe_result.layout_refusal`)."""

    name = "paged attention"

    def refusal_of(self, model: torch.nn.Module, probed: ProbeResult | None) -> str | None:
        assert probed is not None, "the paged attention is installed after the probe"
        return layout_refusal(type(model).__name__, probed, host_reads=False)  # host reads: .host_breaks's

    def install(self, model: torch.nn.Module, probed: ProbeResult | None) -> Undo:
        assert probed is not None, "the paged attention is installed after the probe"
        changes = Changes()
        kv_layers, chunked, sites = probed.kv_layers(), chunked_layers(model), probed.call_site_modules()
        cache_kv = probed.kv_shape()[1]
        for layer, layout in probed.layers.items():
            changes.set(layout.module, ADAPTED_ATTR, AdaptedAttention(
                probed.head_dim, cache_kv // layout.kv_heads, kv_layers[layer], chunked.get(layout.layer, 0), sites,
                alibi=getattr(layout.module, SLOPES_BUFFER, None) is not None,
            ))
        for _, indexer in indexers(model):
            changes.set(indexer, ADAPTED_ATTR, AdaptedAttention(probed.head_dim, kv_layer=kv_layers[indexer.layer_idx]))
        register_attention()
        if can_set_attention(model):
            previous = model.config._attn_implementation
            model.set_attn_implementation(text_attention(model, ATTN_IMPLEMENTATION))
            changes.then(lambda: model.set_attn_implementation(previous))
        return changes.undo


MECHANISM = PagedAttention()
