"""The Kimi delta rule of Kimi Delta Attention layers (Kimi Linear): ``pb_state::kda_rule``.

The gated delta rule (:mod:`.delta`) with a decay per key channel instead of per head: per head the
recurrent state ``S`` (key_dim, value_dim) evolves token by token as

    S <- diag(exp(g)) S;   S <- S + k (beta * (v - S^T k))^T;   o = S^T q

``g`` (tokens, heads, key_dim) is the log decay, ``q``/``k`` are L2-normalized (when asked) and ``q``
is scaled by ``key_dim ** -0.5``, in float32. :func:`kda_sequence` runs one request in chunks (the
within-chunk updates one unit-triangular solve, then a scan over chunks; the pairwise decays kept
per channel, never as a ratio of exponentials that could overflow), :func:`kda_step` one token of
each of many requests (decode, graph-safe): what transformers' ``chunk_kda`` / ``fused_recurrent_kda``
fallbacks compute for a prompt and a decode token.
"""

from __future__ import annotations

import torch

from ..ops import register_splitting_op
from .delta import delta_update, from_chunks, later_in_chunk, to_chunks
from .metadata import StateOpCall, pick


def _prepare(q: torch.Tensor, k: torch.Tensor, l2norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    q, k = q.float(), k.float()
    if l2norm:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    return q * q.shape[-1] ** -0.5, k


def kda_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, states: torch.Tensor,
    l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per request: ``q``/``k``/``g`` (R, heads, key_dim), ``v`` (R, heads, value_dim), ``beta`` (R, heads),
    ``states`` (R, heads, key_dim, value_dim) -> (output (R, heads, value_dim), new states)."""
    q, k = _prepare(q, k, l2norm)
    return delta_update(states.float() * g.float().exp()[..., None], q, k, v, beta)


def kda_sequence(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
    l2norm: bool = True, chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request: ``q``/``k``/``g`` (n, heads, key_dim), ``v`` (n, heads, value_dim), ``beta`` (n, heads), from
    ``state`` (heads, key_dim, value_dim) -> (output (n, heads, value_dim), new state), chunk by chunk."""
    n = v.shape[0]
    q, k = _prepare(q, k, l2norm)
    q, k, vf, beta_c = (to_chunks(t, chunk_size) for t in (q, k, v, beta))
    log_decay = to_chunks(g, chunk_size).cumsum(-2)
    k_beta, v_beta = k * beta_c[..., None], vf * beta_c[..., None]
    later = later_in_chunk(chunk_size, v.device)
    s = state.float()
    out = torch.empty_like(vf)
    # chunk by chunk: the pairwise decays (heads, L, L, key_dim) of one chunk at a time bound the memory
    for c in range(vf.shape[1]):
        decay, kc, kb = log_decay[:, c], k[:, c], k_beta[:, c]
        pair = (decay[:, :, None, :] - decay[:, None, :, :]).masked_fill(later[..., None], float("-inf")).exp()
        system = (kb[:, :, None, :] * kc[:, None, :, :] * pair).sum(-1)  # unit lower triangular (diagonal taken as 1)
        within = (q[:, c, :, None, :] * kc[:, None, :, :] * pair).sum(-1)
        values = torch.linalg.solve_triangular(system, v_beta[:, c], upper=False, unitriangular=True)
        reads = torch.linalg.solve_triangular(system, kb * decay.exp(), upper=False, unitriangular=True)
        fresh = values - reads @ s
        out[:, c] = (q[:, c] * decay.exp()) @ s + within @ fresh
        s = s * decay[:, -1, :].exp()[..., None] + (kc * (decay[:, -1:, :] - decay).exp()).transpose(-1, -2) @ fresh
    return from_chunks(out, n).to(v.dtype), s


@torch.library.custom_op("pb_state::kda_rule", mutates_args=("out",))
def kda_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, out: torch.Tensor,
    state: int, l2norm: bool = True, chunk_size: int = 64,
) -> None:
    """``out`` = the Kimi delta rule per request from the slot's recurrent state ``state``, which it advances.

    ``q``/``k``/``g``: (tokens, heads, key_dim); ``v``/``out``: (tokens, heads, value_dim); ``beta``:
    (tokens, heads); tokens in the step's layout (request after request).
    """
    call = StateOpCall.current("pb_state::kda_rule", state)
    _, heads, v_dim = v.shape
    if q.shape != k.shape or g.shape != k.shape or k.shape[1] != heads or call.slot_shape != (heads, k.shape[2], v_dim):
        call.refuse(f"q {tuple(q.shape)}, k {tuple(k.shape)} and g {tuple(g.shape)} must be equal (tokens, heads, "
                    f"key_dim) with v's {heads} heads of {v_dim}", "(heads, key_dim, value_dim)")
    call.require_positive("chunk_size", chunk_size)
    call.run(
        out,
        step=lambda at, s: kda_step(pick(q, at), pick(k, at), pick(v, at), pick(g, at), pick(beta, at), s, l2norm),
        sequence=lambda p, s: kda_sequence(q[p], k[p], v[p], g[p], beta[p], s, l2norm, chunk_size),
    )

register_splitting_op(kda_rule)
