"""What :func:`~piecewise_backend.hf.adapt` learnt of one attention module: one frozen record on the module.

The probe reads each attention layer's layout; the paged-attention mechanism (:mod:`.paged_attention`)
sets an :class:`AdaptedAttention` on each module once (:data:`ADAPTED_ATTR`), which
:func:`~piecewise_backend.hf.paged_attention_forward` (and an indexer's forward, :mod:`.indexed`)
reads once per call. A frozen dataclass attribute is Dynamo-friendly: Dynamo guards on module attributes.
"""

from __future__ import annotations

import dataclasses

from .call_sites import CallSites

#: The attribute holding an attention module's (or an indexer's) :class:`AdaptedAttention`.
ADAPTED_ATTR = "pb_adapted"
#: The buffer holding a swapped ALiBi module's per-head slopes (:mod:`.attention_swaps`): a buffer, so it
#: moves with the model and Dynamo reads it as one.
SLOPES_BUFFER = "pb_alibi_slopes"


@dataclasses.dataclass(frozen=True)
class AdaptedAttention:
    """What the paged attention needs of one attention module (or one indexer: ``kv_layer`` only)."""

    #: the cache's head dim: q/k/v are zero-padded to it
    head_dim: int
    #: each of the module's KV heads is repeated this often to the cache's KV head count
    kv_repeat: int = 1
    #: the module's layer in the cache (attention layers only, in layer order)
    kv_layer: int = 0
    #: its ``attention_chunk_size`` where ``layer_types`` marks it ``chunked_attention`` (0: not chunked)
    chunk_size: int = 0
    #: a cache slot per attention call, not per layer (:mod:`.call_sites`); None: ``kv_layer``
    call_sites: CallSites | None = None
    #: the module holds ALiBi slopes in :data:`SLOPES_BUFFER` (swapped by :mod:`.attention_swaps`)
    alibi: bool = False
