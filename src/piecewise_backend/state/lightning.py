"""The decayed linear attention of MiniMax's lightning-attention layers: ``pb_state::lightning_attention``.

Per head ``h`` with a fixed decay rate ``slope[h] > 0`` the state ``S`` (head_dim, head_dim) evolves as

    S <- exp(-slope) S + k^T v;   o = q S

(no normalization, no softmax). :func:`lightning_sequence` runs one request in blocks of
``block_size`` (within a block the decayed ``q k^T`` products, across blocks the state: what
transformers runs for a prompt), :func:`lightning_step` one token of each of many requests (the
recurrence transformers runs with a cache; graph-safe), both in float32 (transformers computes in the
model's dtype: equal in float32, within rounding in half precision).
"""

from __future__ import annotations

import torch

from ..ops import register_splitting_op
from .metadata import StateOpCall, pick


def lightning_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slope: torch.Tensor, states: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per request: ``q``/``k``/``v`` (R, heads, dim), ``slope`` (heads,), ``states`` (R, heads, dim, dim)."""
    decay = torch.exp(-slope.float())[None, :, None, None]
    s = states.float() * decay + k.float()[..., :, None] * v.float()[..., None, :]
    return (q.float()[..., None, :] @ s)[..., 0, :].to(v.dtype), s


def lightning_sequence(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slope: torch.Tensor, state: torch.Tensor, block_size: int = 256,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request: ``q``/``k``/``v`` (n, heads, dim) from ``state`` (heads, dim, dim) -> (output like ``v``, new state)."""
    n, dtype = q.shape[0], v.dtype
    q, k, v = (t.float().transpose(0, 1) for t in (q, k, v))  # (heads, n, dim)
    rate = slope.float()[:, None, None]  # (heads, 1, 1)
    s = state.float()
    out = torch.empty_like(v)
    for start in range(0, n, block_size):
        qb, kb, vb = q[:, start:start + block_size], k[:, start:start + block_size], v[:, start:start + block_size]
        size = qb.shape[1]
        steps = torch.arange(size, device=q.device, dtype=torch.float32)
        gap = steps[:, None] - steps[None, :]  # i - j
        within = torch.exp(-rate * gap.clamp(min=0)).masked_fill(gap < 0, 0.0)  # (heads, L, L)
        from_state = torch.exp(-rate * (steps[:, None] + 1))  # decay of the state to token i
        to_end = torch.exp(-rate * (size - 1 - steps[:, None]))  # decay of token j to the block's end
        out[:, start:start + size] = (qb * from_state) @ s + ((qb @ kb.transpose(-1, -2)) * within) @ vb
        s = s * torch.exp(-rate * size) + (kb * to_end).transpose(-1, -2) @ vb
    return out.transpose(0, 1).to(dtype), s


@torch.library.custom_op("pb_state::lightning_attention", mutates_args=("out",))
def lightning_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slope: torch.Tensor, out: torch.Tensor, state: int,
    block_size: int = 256,
) -> None:
    """``out`` = decayed linear attention per request from the slot's state ``state``, which it advances.

    ``q``/``k``/``v``/``out``: (tokens, heads, dim) in the step's layout; ``slope``: (heads,) decay rates.
    """
    call = StateOpCall.current("pb_state::lightning_attention", state)
    _, heads, dim = q.shape
    if k.shape != q.shape or v.shape != q.shape or slope.shape != (heads,) or call.slot_shape != (heads, dim, dim):
        call.refuse(f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} must be equal (tokens, heads, dim), "
                    f"slope {tuple(slope.shape)} (heads,)", "(heads, dim, dim)")
    call.require_positive("block_size", block_size)
    call.run(
        out,
        step=lambda at, s: lightning_step(pick(q, at), pick(k, at), pick(v, at), slope, s),
        sequence=lambda p, s: lightning_sequence(q[p], k[p], v[p], slope, s, block_size),
    )

register_splitting_op(lightning_attention)
