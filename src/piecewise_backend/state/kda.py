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
import torch.nn.functional as F

from ..ops import register_splitting_op
from .metadata import apply_state_op, current_state_metadata, pick, state_tensor


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
    s = states.float() * g.float().exp()[..., None]
    correction = (v.float() - (s * k[..., None]).sum(-2)) * beta.float()[..., None]
    s = s + k[..., None] * correction[..., None, :]
    return (s * q[..., None]).sum(-2).to(v.dtype), s


def kda_sequence(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
    l2norm: bool = True, chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request: ``q``/``k``/``g`` (n, heads, key_dim), ``v`` (n, heads, value_dim), ``beta`` (n, heads), from
    ``state`` (heads, key_dim, value_dim) -> (output (n, heads, value_dim), new state), chunk by chunk."""
    n, heads, v_dim = v.shape
    q, k = _prepare(q, k, l2norm)
    pad = -n % chunk_size
    # (heads, chunks, L, dim); padded tokens have zero q/k/v/beta and no decay
    as_chunks = lambda t: F.pad(t.float().transpose(0, 1), (0, 0, 0, pad)).reshape(heads, -1, chunk_size, t.shape[-1])
    q, k, vf, log_decay = as_chunks(q), as_chunks(k), as_chunks(v), as_chunks(g).cumsum(-2)
    beta_c = F.pad(beta.float().transpose(0, 1), (0, pad)).reshape(heads, -1, chunk_size)
    k_beta, v_beta = k * beta_c[..., None], vf * beta_c[..., None]
    later = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=v.device).triu(1)
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
    out = out.reshape(heads, -1, v_dim)[:, :n].transpose(0, 1)
    return out.to(v.dtype), s


@torch.library.custom_op("pb_state::kda_rule", mutates_args=("out",))
def kda_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, out: torch.Tensor,
    state: int, l2norm: bool = True, chunk_size: int = 64,
) -> None:
    """``out`` = the Kimi delta rule per request from the slot's recurrent state ``state``, which it advances.

    ``q``/``k``/``g``: (tokens, heads, key_dim); ``v``/``out``: (tokens, heads, value_dim); ``beta``:
    (tokens, heads); tokens in the step's layout (request after request).
    """
    op = "pb_state::kda_rule"
    meta = current_state_metadata(op)
    states = state_tensor(meta, state, op)
    _, heads, v_dim = v.shape
    if q.shape != k.shape or g.shape != k.shape or k.shape[1] != heads or states.shape[1:] != (heads, k.shape[2], v_dim):
        raise ValueError(
            f"{op}: q {tuple(q.shape)}, k {tuple(k.shape)} and g {tuple(g.shape)} must be equal (tokens, heads, key_dim) "
            f"with v's {heads} heads of {v_dim}; the state holds {tuple(states.shape[1:])}, it must be (heads, key_dim, value_dim)"
        )
    if chunk_size < 1:
        raise ValueError(f"{op}: chunk_size must be >= 1, got {chunk_size}")
    apply_state_op(
        op, meta.state_index, states, out,
        step=lambda at, s: kda_step(pick(q, at), pick(k, at), pick(v, at), pick(g, at), pick(beta, at), s, l2norm),
        sequence=lambda p, s: kda_sequence(q[p], k[p], v[p], g[p], beta[p], s, l2norm, chunk_size),
    )

register_splitting_op(kda_rule)
