"""The paged attention op ``pb_kv::paged_attention`` and the per-step metadata it reads.

:class:`PagedAttentionMetadata` is one step's attention inputs (views of a runner's persistent
buffers, and the cache tensors); the op reads it from the forward context (:func:`current_metadata`),
writes the step's K/V at their slots (:func:`write_kv`, ``PAD_SLOT`` rows to the scratch block) and
runs the cache's attention backends (:mod:`.attention`). It is registered as a splitting op on import.
The cache that fills the metadata is :mod:`.kv` (which re-exports every name here).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..attention import cuda as attention_cuda  # noqa: F401  (registers the varlen backend)
from ..attention.backends import run_attention
from ..context import current_forward_context
from ..ops import register_splitting_op

#: Slot of a padding token: its K/V go to the scratch block and are never read.
PAD_SLOT = -1


@dataclasses.dataclass
class PagedAttentionMetadata:
    """One step's attention inputs: views of the runner's persistent buffers, and the cache tensors.

    Only tensors and lists of tensors (no cache object): a graph keeps what it read at capture,
    and the runner refuses context objects whose state it cannot see.
    """

    positions: torch.Tensor  # (tokens,) long: position of each token in its request
    slot_mapping: torch.Tensor  # (tokens,) long: cache slot to write each token's K/V to, PAD_SLOT for padding
    request_index: torch.Tensor  # (tokens,) long: row of ``block_tables`` of each token's request
    block_tables: torch.Tensor  # (requests, max_blocks_per_req) long: blocks of each request, 0-padded
    key_caches: list[torch.Tensor]  # per layer, PagedKVCache.key_caches
    value_caches: list[torch.Tensor]
    attention_backends: tuple[str, ...] = ("bounded",)  # names, in order: the op runs the first that can
    #: per layer, PagedKVCache.indexer_caches (indexed attention's keys, :mod:`.indexed`); empty without
    indexer_caches: list[torch.Tensor] = dataclasses.field(default_factory=list)


def write_kv(k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store ``k``/``v`` (tokens, kv_heads, head_dim) at their slots; PAD_SLOT rows go to the scratch block."""
    blocks, block_size, heads, dim = key_cache.shape
    slots = slot_mapping[: k.shape[0]]
    slots = torch.where(slots >= 0, slots, (blocks - 1) * block_size)
    key_cache.view(-1, heads, dim).index_copy_(0, slots, k.to(key_cache.dtype))
    value_cache.view(-1, heads, dim).index_copy_(0, slots, v.to(value_cache.dtype))


def current_metadata() -> PagedAttentionMetadata:
    ctx = current_forward_context()
    meta = getattr(ctx, "attn_metadata", None)
    if not isinstance(meta, PagedAttentionMetadata):
        raise RuntimeError(
            "pb_kv::paged_attention needs a PagedAttentionMetadata as `attn_metadata` in the forward context "
            f"(got {type(meta).__name__}); run the model through a GraphRunner with "
            "context_fn=cache.context_fn, or under pb.set_forward_context(attn_metadata=cache.metadata(...))"
        )
    return meta


@torch.library.custom_op("pb_kv::paged_attention", mutates_args=("out",))
def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    layer: int,
    scale: float,
    sliding_window: int,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    chunk_size: int = 0,
    alibi_slopes: torch.Tensor | None = None,
) -> None:
    """Write ``k``/``v`` of layer ``layer`` into the cache, then ``out = attention(q, cached prefix)``.

    ``q``/``out``: (tokens, heads, head_dim); ``k``/``v``: (tokens, kv_heads, head_dim).
    ``softcap`` > 0 soft-caps the scores (``tanh(s / softcap) * softcap``, gemma2-style); ``sinks``
    (``(heads,)``, gpt-oss-style) is a per-head logit added to the softmax denominator only;
    ``chunk_size`` > 0 lets a token see only keys of its own chunk of positions (llama4-style);
    ``alibi_slopes`` (``(heads,)``, bloom/mpt/falcon-style ALiBi) adds ``slope * (key_pos - query_pos)``
    to each head's scores (after ``scale``).
    """
    meta = current_metadata()
    if not 0 <= layer < len(meta.key_caches):
        raise ValueError(f"pb_kv::paged_attention: layer {layer} out of range; the cache has {len(meta.key_caches)} layers")
    key_cache, value_cache = meta.key_caches[layer], meta.value_caches[layer]
    if k.shape[1:] != key_cache.shape[2:] or q.shape[1] % k.shape[1]:
        raise ValueError(
            f"pb_kv::paged_attention: k has (kv_heads, head_dim) {tuple(k.shape[1:])}, the cache holds "
            f"{tuple(key_cache.shape[2:])}; q has {q.shape[1]} heads (must be a multiple of kv_heads)"
        )
    if meta.slot_mapping.shape[0] < q.shape[0]:
        raise ValueError(f"pb_kv::paged_attention: {q.shape[0]} tokens but metadata for {meta.slot_mapping.shape[0]}")
    if softcap < 0 or not math.isfinite(softcap):
        raise ValueError(f"pb_kv::paged_attention: softcap must be a finite float >= 0 (0 = off), got {softcap}")
    if sinks is not None and sinks.shape != (q.shape[1],):
        raise ValueError(
            f"pb_kv::paged_attention: sinks must hold one logit per query head, shape ({q.shape[1]},); "
            f"got {tuple(sinks.shape)}"
        )
    if alibi_slopes is not None and alibi_slopes.shape != (q.shape[1],):
        raise ValueError(
            f"pb_kv::paged_attention: alibi_slopes must hold one slope per query head, shape ({q.shape[1]},); "
            f"got {tuple(alibi_slopes.shape)}"
        )
    if chunk_size < 0:
        raise ValueError(f"pb_kv::paged_attention: chunk_size must be an int >= 0 (0 = off), got {chunk_size}")
    write_kv(k, v, key_cache, value_cache, meta.slot_mapping)
    backends = meta.attention_backends
    result = run_attention(
        backends, q, key_cache, value_cache, meta, scale, sliding_window, softcap, sinks, chunk_size=chunk_size,
        alibi_slopes=alibi_slopes,
    )
    out.copy_(result)


register_splitting_op(paged_attention)
