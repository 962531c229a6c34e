"""Indexed (sparse) attention, DeepSeek-V3.2 style: a lightning indexer picks the keys each query attends to.

Two splitting ops over the paged cache, both bounded by the context a step uses:

* ``pb_kv::indexer_topk`` writes the step's indexer keys (one ``(index_dim,)`` key per token, in the
  cache's ``indexer_caches`` at the token's K/V slot, so they share its blocks, preemption and
  rollback), scores each query against its request's cached prefix
  (``sum_h weight[h] * relu(scale * q[h] . k)``) and writes the positions of the ``topk`` best into
  ``out`` (``-1`` where the prefix is shorter than ``topk``). Eagerly it walks the blocks the step's
  longest context spans; inside a capture the static bound (``max_model_len``: top-k of a padded
  context, masked), so a FULL graph holds it.
* ``pb_kv::indexed_attention`` writes the step's K/V as ``pb_kv::paged_attention`` does, then
  attends each query to the ``topk`` positions it was given only: ``topk`` keys per token,
  whatever ``max_model_len``.

:func:`index_topk` and :func:`attend_selected` are their math (plain PyTorch, static shapes, graph-safe).
"""

from __future__ import annotations

import torch

from ..attention.backends import capturing
from ..ops import register_splitting_op
from .op import current_metadata, write_kv


def write_index_keys(k: torch.Tensor, index_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store ``k`` (tokens, index_dim) at the tokens' slots; padding (negative slots) to the scratch block."""
    blocks, block_size, dim = index_cache.shape
    slots = slot_mapping[: k.shape[0]]
    slots = torch.where(slots >= 0, slots, (blocks - 1) * block_size)
    index_cache.view(-1, dim).index_copy_(0, slots, k.to(index_cache.dtype))


def index_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    index_cache: torch.Tensor,
    positions: torch.Tensor,
    request_index: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    topk: int,
) -> torch.Tensor:
    """Positions ``(tokens, topk)`` of the best-scoring keys among each token's positions ``0..pos``.

    ``q``: (tokens, heads, index_dim); ``weights``: (tokens, heads); ``block_tables`` may be cut to
    the columns the step reaches. Fewer than ``topk`` visible keys: the rest are ``-1``.
    """
    tokens = q.shape[0]
    rows = request_index[:tokens]
    pos = positions[:tokens]
    keys = index_cache[block_tables.index_select(0, rows)].flatten(1, 2).float()  # (tokens, keys, dim)
    key_pos = torch.arange(keys.shape[1], device=q.device)
    hidden = key_pos[None, :] > pos[:, None]
    scores = torch.relu(torch.einsum("thd,tld->thl", q.float(), keys) * scale)
    index = torch.einsum("th,thl->tl", weights.float(), scores).masked_fill(hidden, float("-inf"))
    k = min(topk, index.shape[1])
    best, picked = index.topk(k, dim=-1)
    picked = picked.masked_fill(best == float("-inf"), -1)
    if k < topk:
        picked = torch.cat([picked, picked.new_full((tokens, topk - k), -1)], dim=1)
    return picked


def attend_selected(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    selected: torch.Tensor,
    positions: torch.Tensor,
    request_index: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of each token over the positions ``selected`` gives it (``-1`` or past its position: skipped);
    ``sinks`` (one logit per query head) joins each head's softmax denominator without a value."""
    tokens, q_heads, dim = q.shape
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    chosen = selected[:tokens].long()
    pos = positions[:tokens, None]
    hidden = (chosen < 0) | (chosen > pos)
    safe = chosen.clamp(min=0)
    rows = request_index[:tokens, None]
    slots = block_tables[rows, (safe // block_size).clamp(max=block_tables.shape[1] - 1)] * block_size + safe % block_size
    keys = key_cache.view(-1, kv_heads, key_cache.shape[-1])[slots].float()  # (tokens, topk, kv_heads, dim)
    # Never multiply a masked-out value: a reused or scratch block may hold anything, NaN included.
    values = value_cache.view(-1, kv_heads, value_cache.shape[-1])[slots].float().masked_fill(hidden[:, :, None, None], 0.0)
    grouped = q.reshape(tokens, kv_heads, q_heads // kv_heads, dim).float()
    scores = (torch.einsum("tkgd,tlkd->tkgl", grouped, keys) * scale).masked_fill(hidden[:, None, None, :], float("-inf"))
    if sinks is not None:  # one more logit per head whose value is zero: it only dilutes the others
        sink = sinks.float().reshape(1, kv_heads, q_heads // kv_heads, 1).expand(tokens, -1, -1, 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    return torch.einsum("tkgl,tlkd->tkgd", probs, values).reshape(tokens, q_heads, dim)


def _reached_tables(block_tables: torch.Tensor, positions: torch.Tensor, tokens: int, block_size: int) -> torch.Tensor:
    """The block-table columns the step's longest context reaches (eagerly: one host read), or all under capture."""
    if capturing(positions.device) or tokens == 0:
        return block_tables
    needed = int(positions[:tokens].max().cpu()) // block_size + 1
    return block_tables[:, : min(block_tables.shape[1], needed)]


@torch.library.custom_op("pb_kv::indexer_topk", mutates_args=("out",))
def indexer_topk(
    q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, out: torch.Tensor, layer: int, scale: float
) -> None:
    """Write indexer keys ``k`` (tokens, index_dim) of ``layer``, then ``out`` (tokens, topk) = the positions
    of each query's ``topk`` best keys (``q``: (tokens, heads, index_dim), ``weights``: (tokens, heads))."""
    meta = current_metadata()
    caches = meta.indexer_caches
    if not 0 <= layer < len(caches):
        raise ValueError(
            f"pb_kv::indexer_topk: layer {layer} out of range; the cache holds indexer keys for {len(caches)} layers "
            "(build it with indexer_dim > 0 for a model with indexed attention)"
        )
    cache = caches[layer]
    if k.shape[1:] != cache.shape[2:] or q.shape[-1] != cache.shape[-1] or weights.shape != q.shape[:2]:
        raise ValueError(
            f"pb_kv::indexer_topk: q {tuple(q.shape)}, k {tuple(k.shape)}, weights {tuple(weights.shape)} do not fit "
            f"an indexer cache of key dim {cache.shape[-1]} (q: (tokens, heads, dim), k: (tokens, dim), weights: (tokens, heads))"
        )
    write_index_keys(k, cache, meta.slot_mapping)
    tables = _reached_tables(meta.block_tables, meta.positions, q.shape[0], cache.shape[1])
    picked = index_topk(q, weights, cache, meta.positions, meta.request_index, tables, scale, out.shape[1])
    out[: q.shape[0]].copy_(picked)


@torch.library.custom_op("pb_kv::indexed_attention", mutates_args=("out",))
def indexed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, selected: torch.Tensor, layer: int, scale: float,
    sinks: torch.Tensor | None = None,
) -> None:
    """Write ``k``/``v`` of ``layer`` into the cache, then ``out`` = attention of each query over its ``selected``
    positions (``(tokens, topk)`` from ``pb_kv::indexer_topk``) only; ``sinks``: as ``pb_kv::paged_attention``'s."""
    meta = current_metadata()
    if not 0 <= layer < len(meta.key_caches):
        raise ValueError(f"pb_kv::indexed_attention: layer {layer} out of range; the cache has {len(meta.key_caches)} layers")
    key_cache, value_cache = meta.key_caches[layer], meta.value_caches[layer]
    if k.shape[1:] != key_cache.shape[2:] or q.shape[1] % k.shape[1] or selected.shape[0] < q.shape[0]:
        raise ValueError(
            f"pb_kv::indexed_attention: k has (kv_heads, head_dim) {tuple(k.shape[1:])}, the cache holds "
            f"{tuple(key_cache.shape[2:])}; q has {q.shape[1]} heads; selected has {selected.shape[0]} rows for {q.shape[0]} tokens"
        )
    if sinks is not None and sinks.shape != (q.shape[1],):
        raise ValueError(f"pb_kv::indexed_attention: sinks must be ({q.shape[1]},), one logit per query head; got {tuple(sinks.shape)}")
    write_kv(k, v, key_cache, value_cache, meta.slot_mapping)
    result = attend_selected(
        q, key_cache, value_cache, selected, meta.positions, meta.request_index, meta.block_tables, scale, sinks
    )
    out.copy_(result)


register_splitting_op(indexer_topk)
register_splitting_op(indexed_attention)
