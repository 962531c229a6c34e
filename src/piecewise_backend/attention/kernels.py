"""The paged attention math in plain PyTorch: static shapes, no host reads, graph-safe.

* :func:`attend` is the ``reference``: every token's whole block table, masked, in float32.
* :func:`attend_blocks` walks a fixed number of blocks per token a chunk at a time with an online
  softmax: the kernel of the ``bounded`` backend (:class:`~piecewise_backend.attention.BoundedAttention`
  chooses how many blocks, eagerly or under capture).

Both share the score and softmax helpers here (soft-capping, ALiBi, sinks, masking of stale blocks).
Which backend runs a call is :mod:`.attention`'s business.
"""

from __future__ import annotations

import torch


def _scores(
    grouped: torch.Tensor, keys: torch.Tensor, scale: float, softcap: float,
    alibi_slopes: torch.Tensor | None = None, distance: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(tokens, kv_heads, group, keys)`` scores: scaled, soft-capped, plus each head's ALiBi bias
    ``slope * (key_pos - query_pos)`` (``distance``: ``(tokens, keys)``) where slopes are given."""
    scores = torch.einsum("tkgd,tlkd->tkgl", grouped, keys) * scale
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    if alibi_slopes is not None and distance is not None:
        slopes = alibi_slopes.float().reshape(1, *grouped.shape[1:3], 1)
        scores = scores + slopes * distance.float()[:, None, None, :]
    return scores


def visible_start(pos: torch.Tensor, sliding_window: int = -1, chunk_size: int = 0) -> torch.Tensor:
    """The first position each token sees: its window's start (``sliding_window`` > 0), its chunk's
    (``chunk_size`` > 0), the later of the two, or 0."""
    start = torch.zeros_like(pos)
    if sliding_window > 0:
        start = (pos - sliding_window + 1).clamp(min=0)
    if chunk_size > 0:
        start = torch.maximum(start, pos // chunk_size * chunk_size)
    return start


def attend(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    positions: torch.Tensor,
    request_index: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sliding_window: int = -1,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    chunk_size: int = 0,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """The reference: causal attention of each query token over its request's cached keys, in float32.

    Gathers every token's whole block table (static shape: ``max_blocks_per_req * block_size``
    keys) and masks keys after the token's position (and outside ``sliding_window`` if > 0, and
    before the start of the token's chunk of ``chunk_size`` positions if > 0: llama4's chunked attention).
    ``softcap`` > 0 caps each score to ``tanh(s / softcap) * softcap`` before masking; ``sinks``
    (one logit per query head) joins each head's softmax denominator without a value;
    ``alibi_slopes`` (one per query head) adds ``slope * (key_pos - query_pos)`` to each score (bloom, mpt).
    """
    tokens, q_heads, dim = q.shape
    kv_heads = key_cache.shape[2]
    blocks = block_tables.index_select(0, request_index[:tokens])  # (tokens, max_blocks)
    keys = key_cache[blocks].flatten(1, 2).float()  # (tokens, keys, kv_heads, dim)
    values = value_cache[blocks].flatten(1, 2).float()
    key_pos = torch.arange(keys.shape[1], device=q.device)
    pos = positions[:tokens, None]
    visible = key_pos[None, :] <= pos
    if sliding_window > 0:
        visible = visible & (key_pos[None, :] > pos - sliding_window)
    if chunk_size > 0:
        visible = visible & (key_pos[None, :] >= pos // chunk_size * chunk_size)
    hidden = ~visible
    # Never multiply a masked-out value: a reused or scratch block may hold anything, NaN included.
    values = values.masked_fill(hidden[:, :, None, None], 0.0)
    grouped = q.reshape(tokens, kv_heads, q_heads // kv_heads, dim).float()
    distance = key_pos[None, :] - pos if alibi_slopes is not None else None
    scores = _scores(grouped, keys, scale, softcap, alibi_slopes, distance).masked_fill(
        hidden[:, None, None, :], float("-inf")
    )
    return torch.einsum("tkgl,tlkd->tkgd", _probs(scores, sinks), values).reshape(tokens, q_heads, dim)


def _probs(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax of masked ``(tokens, kv_heads, group, keys)`` scores, with each head's sink in the denominator."""
    if sinks is None:
        return scores.softmax(-1)
    # The sink is one more logit per head whose value is zero: it only dilutes the others.
    sink = sinks.float().reshape(1, *scores.shape[1:3], 1).expand(scores.shape[0], -1, -1, 1)
    return torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]


def attend_blocks(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    positions: torch.Tensor,
    request_index: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sliding_window: int = -1,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    *,
    num_blocks: int,
    chunk_blocks: int,
    chunk_size: int = 0,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention over ``num_blocks`` blocks per token, ``chunk_blocks`` at a time, with an online softmax.

    Token ``t`` reads blocks ``first[t] .. first[t] + num_blocks - 1`` of its request, where
    ``first[t]`` is the first block its sliding window (or its attention chunk, ``chunk_size`` > 0)
    reaches (0 without either); keys past its position are masked, so any ``num_blocks`` covering
    the step's longest span is exact. ``alibi_slopes`` as in :func:`attend`.
    Static shapes and no host read: graph-safe. Memory: one chunk per token at a time.
    """
    tokens, q_heads, dim = q.shape
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    group, width = q_heads // kv_heads, block_tables.shape[1]
    pos = positions[:tokens]
    rows = request_index[:tokens, None]
    seen_from = visible_start(pos, sliding_window, chunk_size)
    first = seen_from // block_size
    grouped = q.reshape(tokens, kv_heads, group, dim).float()
    offsets = torch.arange(block_size, device=q.device)

    def chunk(start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Masked scores and values of blocks ``start .. stop - 1`` of each token's walk."""
        logical = first[:, None] + torch.arange(start, stop, device=q.device)
        blocks = block_tables[rows, logical.clamp(max=width - 1)]  # past the table: masked below (key_pos > pos)
        key_pos = (logical[:, :, None] * block_size + offsets).flatten(1)  # (tokens, chunk keys)
        hidden = (key_pos > pos[:, None]) | (key_pos < seen_from[:, None])
        keys = key_cache[blocks].flatten(1, 2).float()
        # Never multiply a masked-out value: a reused or scratch block may hold anything, NaN included.
        values = value_cache[blocks].flatten(1, 2).float().masked_fill(hidden[:, :, None, None], 0.0)
        distance = key_pos - pos[:, None] if alibi_slopes is not None else None
        scores = _scores(grouped, keys, scale, softcap, alibi_slopes, distance)
        return scores.masked_fill(hidden[:, None, None, :], float("-inf")), values

    if num_blocks <= chunk_blocks:  # one chunk: a plain softmax, fewer ops for a graph to replay
        scores, values = chunk(0, num_blocks)
        return torch.einsum("tkgl,tlkd->tkgd", _probs(scores, sinks), values).reshape(tokens, q_heads, dim)
    peak = torch.full((tokens, kv_heads, group), float("-inf"), device=q.device)
    total = torch.zeros(tokens, kv_heads, group, device=q.device)
    acc = torch.zeros(tokens, kv_heads, group, dim, device=q.device)
    for start in range(0, num_blocks, chunk_blocks):
        scores, values = chunk(start, min(start + chunk_blocks, num_blocks))
        new_peak = torch.maximum(peak, scores.amax(-1))
        shift = new_peak.masked_fill(new_peak == float("-inf"), 0.0)  # no key seen yet: exp(-inf - 0) = 0
        probs = torch.exp(scores - shift[..., None])
        rescale = torch.exp(peak - shift)
        total = total * rescale + probs.sum(-1)
        acc = acc * rescale[..., None] + torch.einsum("tkgl,tlkd->tkgd", probs, values)
        peak = new_peak
    if sinks is not None:  # every token sees its own key, so the peak is finite here
        total = total + torch.exp(sinks.float().reshape(1, kv_heads, group) - peak)
    return (acc / total[..., None]).reshape(tokens, q_heads, dim)
