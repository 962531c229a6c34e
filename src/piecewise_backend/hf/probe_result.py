"""What the adapter's probe forward saw of a model: frozen values that the mechanisms read and never change.

:func:`~piecewise_backend.hf.adapter.probe` records every attention call (:class:`LayerLayout`), every
host read, every state layer's kernel calls and every buffer assigned to itself, and returns them as
one :class:`ProbeResult`; :func:`layout_refusal` says why what it saw rules the model out.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from .call_sites import CallSites


@dataclasses.dataclass(frozen=True)
class LayerLayout:
    """What one attention layer passed to the attention interface in the probe."""

    module: torch.nn.Module
    q_heads: int
    kv_heads: int
    k_dim: int
    v_dim: int
    calls: int = 1
    causal: bool = True  # neither the module nor the call says is_causal=False
    extra: tuple[str, ...] = ()  # keyword arguments the paged attention would ignore
    mask: str | None = None  # how an attention mask the model built differs from the causal one
    layer: Any = None  # the module's ``layer_idx`` (None or -1 for a shared block)


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    #: the attention layers by ``layer_idx``, or by call site (see :mod:`.call_sites`) where ``call_sites``
    layers: dict[int, LayerLayout]
    host_reads: tuple[str, ...] = ()  # "aten.nonzero in model.layers.0.mlp.experts", first seen first
    host_read_modules: tuple[str, ...] = ()  # the innermost module of each, as named there
    #: every attention call of the forward, in call order (one layout per call)
    sites: tuple[LayerLayout, ...] = ()
    #: the cache holds one K/V per call site, not per layer (a module called twice, shared or unindexed)
    call_sites: bool = False
    ignores_positions: bool = False  # q/k differ along the row for one token at one position_id
    #: attention modules that called the interface without a ``layer_idx`` of their own, first seen first
    unindexed: tuple[torch.nn.Module, ...] = ()
    #: buffers the forward assigns back to themselves, as ``(module, name)`` (see :mod:`.self_assignments`)
    self_assigned: tuple[tuple[torch.nn.Module, str], ...] = ()
    #: layers whose state kernels are routed to the pb_state ops, by layer index (``mixers.StateLayer``)
    state_layers: dict[int, Any] = dataclasses.field(default_factory=dict)

    @functools.cached_property
    def _call_sites(self) -> CallSites | None:
        return CallSites([l.module for l in self.sites]) if self.call_sites else None

    def call_site_modules(self) -> CallSites | None:
        """The :class:`.CallSites` of the probed forward where the cache holds call sites, else None (one
        object per result: the attention modules and the wrapper share it)."""
        return self._call_sites

    def kv_shape(self) -> tuple[int, int, int]:
        """(attention layers, kv_heads, head_dim) of one cache that holds every attention layer (head dims
        padded to the widest); ``(0, 1, 1)`` for a model without attention."""
        if not self.layers:
            return 0, 1, 1
        return len(self.layers), max(l.kv_heads for l in self.layers.values()), self.head_dim

    def kv_layers(self) -> dict[int, int]:
        """Each attention layer's index in the cache (the cache holds attention layers only)."""
        return {layer: i for i, layer in enumerate(sorted(self.layers))}

    @property
    def head_dim(self) -> int:
        return max((max(l.k_dim, l.v_dim) for l in self.layers.values()), default=1)


def host_read_refusal(name: str, result: ProbeResult) -> str | None:
    """Why the probe's host reads rule the model out (where no break point takes them), or None."""
    if result.host_reads:
        return (
            f"{name} reads device data on the host in its forward ({result.host_reads[0]}): "
            "a data-dependent shape or a sync, which a CUDA graph would replay with the values seen at capture"
        )
    return None


def layout_refusal(name: str, result: ProbeResult, *, host_reads: bool = True) -> str | None:
    """Why the probe's findings rule the model out, or None; ``host_reads=False``: its host reads are
    left to :mod:`.host_breaks` (run as break points, or refused there)."""
    why = host_read_refusal(name, result) if host_reads else None
    if why is not None:
        return why
    if not result.layers and not result.state_layers:
        return f"{name} calls no attention through transformers' AttentionInterface and has no state layer it routes"
    if result.call_sites:
        kv: dict[int, set[int]] = {}
        for l in result.sites:
            kv.setdefault(id(l.module), set()).add(l.kv_heads)
        mixed = next((l for l in result.sites if len(kv[id(l.module)]) > 1), None)
        if mixed is not None:
            return (f"{name} calls attention from one {type(mixed.module).__name__} with KV head counts "
                    f"{sorted(kv[id(mixed.module)])}; a module's call sites must share one KV head count")
    for layer in result.state_layers.values():
        why = layer.refusal(name)
        if why:
            return why
    if result.ignores_positions:
        return (
            f"{name} ignores position_ids (its positions come from the sequence length), so the second request "
            "of a step and every decode token would get wrong positions"
        )
    # Only the attention a token-id forward runs: an audio or vision encoder's bidirectional attention
    # (or a decoder's cross-attention, absent without encoder states) is not served by the cache.
    bidirectional = next((i for i, l in result.layers.items() if not l.causal), None)
    if bidirectional is not None:
        kind = type(result.layers[bidirectional].module).__name__
        return f"{name} has non-causal attention (layer {bidirectional}, {kind}); paged attention is causal only"
    extra = next(((i, l.extra) for i, l in result.layers.items() if l.extra), None)
    if extra is not None:
        return f"{name} passes {list(extra[1])} to attention (layer {extra[0]}); the paged attention does not apply them"
    masked = next(((i, l.mask) for i, l in result.layers.items() if l.mask), None)
    if masked is not None:
        return f"{name} builds its own attention mask for layer {masked[0]}, {masked[1]}; the paged attention is causal only"
    bad = [i for i, l in result.layers.items() if l.q_heads % l.kv_heads]
    if bad:
        return f"{name}: layer {bad[0]} has {result.layers[bad[0]].q_heads} query heads, not a multiple of its KV heads"
    # One cache of the most KV heads: a layer with fewer repeats each KV head, which keeps GQA's pairing
    # only if the counts divide (and the layer's query heads are a multiple of the cache's count).
    if not result.layers:
        return None
    cache_kv = result.kv_shape()[1]
    odd = [i for i, l in result.layers.items() if cache_kv % l.kv_heads or l.q_heads % cache_kv]
    if odd:
        counts = sorted({(l.q_heads, l.kv_heads) for l in result.layers.values()})
        return f"{name} has layers with (query, KV) head counts {counts} that one paged cache of {cache_kv} KV heads cannot hold"
    return None
