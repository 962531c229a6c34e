"""The gated delta rule of gated-delta-net layers (Qwen3-Next, Qwen3.5, OLMo hybrid): ``pb_state::gated_delta_rule``.

Per value head, the recurrent state ``S`` (key_dim, value_dim) evolves token by token as

    S <- exp(g) * S;   S <- S + k (beta * (v - S^T k))^T;   o = S^T q

with ``q``/``k`` L2-normalized (when asked) and ``q`` scaled by ``key_dim ** -0.5``; key heads are
shared by consecutive value heads (grouped). Two formulations, in float32:

* :func:`delta_sequence`: one request's tokens in chunks of ``chunk_size`` (the within-chunk
  updates solved as one unit-triangular system, then a scan over chunks): prefills;
* :func:`delta_step`: one token of each of many requests, the recurrence itself: decode, graph-safe.

They are what transformers runs without the ``fla`` kernels for a prompt and for a decode token, so
tokens follow ``generate``. The op picks :func:`delta_step` for every token inside a graph (FULL
uniform decode) and, eagerly, per request: one token -> the step, more -> the chunked form. It reads
the slot's current copy and writes the other (:mod:`.metadata`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops import register_splitting_op
from .metadata import StateOpCall, pick


def to_chunks(t: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Per-token ``(n, heads)`` or ``(n, heads, dim)`` values as ``(heads, chunks, chunk_size[, dim])`` in
    float32, the last chunk padded with zeros (a padded token has zero q/k/v/beta and no decay)."""
    t = t.float().transpose(0, 1)
    pad = -t.shape[1] % chunk_size
    if t.dim() == 2:
        return F.pad(t, (0, pad)).reshape(t.shape[0], -1, chunk_size)
    return F.pad(t, (0, 0, 0, pad)).reshape(t.shape[0], -1, chunk_size, t.shape[-1])


def from_chunks(out: torch.Tensor, n: int) -> torch.Tensor:
    """``(heads, chunks, chunk_size, dim)`` outputs back as the ``(n, heads, dim)`` of the ``n`` real tokens."""
    return out.reshape(out.shape[0], -1, out.shape[-1])[:, :n].transpose(0, 1)


def later_in_chunk(chunk_size: int, device: torch.device) -> torch.Tensor:
    """``(chunk_size, chunk_size)`` mask, True where token ``j`` comes after token ``i``: no pair there."""
    return torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=device).triu(1)


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _prepare(q: torch.Tensor, k: torch.Tensor, v_heads: int, l2norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Key heads repeated for their value heads, in float32, normalized if asked."""
    group = v_heads // q.shape[-2]
    if group > 1:
        q, k = q.repeat_interleave(group, dim=-2), k.repeat_interleave(group, dim=-2)
    q, k = q.float(), k.float()
    if l2norm:
        q, k = _unit(q), _unit(k)
    return q, k


def delta_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, states: torch.Tensor,
    l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per request: ``q``/``k`` (R, key_heads, key_dim), ``v`` (R, heads, value_dim), ``g``/``beta``
    (R, heads), ``states`` (R, heads, key_dim, value_dim) -> (output (R, heads, value_dim), new states)."""
    q, k = _prepare(q, k, v.shape[-2], l2norm)
    q = q / (q.shape[-1] ** 0.5)
    return delta_update(states.float() * g.float().exp()[..., None, None], q, k, v, beta)


def delta_update(
    s: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule's write then read, one token per request, on the already decayed float32 states ``s``
    (R, heads, key_dim, value_dim) with float32 ``q``/``k`` (R, heads, key_dim):
    ``S <- S + k (beta * (v - S^T k))^T;  o = S^T q`` -> (``o`` in ``v``'s dtype, new states). The gated
    and the Kimi delta rules differ only in how they decay ``S`` first."""
    remembered = (s * k[..., None]).sum(-2)  # S^T k: (R, heads, value_dim)
    correction = (v.float() - remembered) * beta.float()[..., None]
    s = s + k[..., None] * correction[..., None, :]
    return (s * q[..., None]).sum(-2).to(v.dtype), s


def delta_sequence(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
    l2norm: bool = True, chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request: ``q``/``k`` (n, key_heads, key_dim), ``v`` (n, heads, value_dim), ``g``/``beta`` (n, heads),
    from ``state`` (heads, key_dim, value_dim) -> (output (n, heads, value_dim), new state), chunk by chunk."""
    n, heads = v.shape[:2]
    q, k = _prepare(q, k, heads, l2norm)
    q = q * q.shape[-1] ** -0.5
    q, k, vf, beta_c, g_c = (to_chunks(t, chunk_size) for t in (q, k, v, beta, g))
    k_beta, v_beta = k * beta_c[..., None], vf * beta_c[..., None]
    log_decay = g_c.cumsum(-1)  # log of the decay from the chunk's start to each token
    later = later_in_chunk(chunk_size, v.device)
    pair = (log_decay[..., :, None] - log_decay[..., None, :]).masked_fill(later, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * pair  # unit lower triangular (the diagonal is taken as 1)
    within = (q @ k.transpose(-1, -2)) * pair
    values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    reads = torch.linalg.solve_triangular(system, k_beta * log_decay.exp()[..., None], upper=False, unitriangular=True)
    q_from_start = q * log_decay.exp()[..., None]
    k_to_end = k * (log_decay[..., -1:] - log_decay).exp()[..., None]
    whole = log_decay[..., -1].exp()[..., None, None]  # (heads, chunks, 1, 1)
    s = state.float()
    out = torch.empty_like(values)
    for c in range(values.shape[1]):
        fresh = values[:, c] - reads[:, c] @ s
        out[:, c] = q_from_start[:, c] @ s + within[:, c] @ fresh
        s = s * whole[:, c] + k_to_end[:, c].transpose(-1, -2) @ fresh
    return from_chunks(out, n).to(v.dtype), s


@torch.library.custom_op("pb_state::gated_delta_rule", mutates_args=("out",))
def gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, out: torch.Tensor,
    state: int, l2norm: bool = True, chunk_size: int = 64,
) -> None:
    """``out`` = the gated delta rule per request from the slot's recurrent state ``state``, which it advances.

    ``q``/``k``: (tokens, key_heads, key_dim); ``v``/``out``: (tokens, heads, value_dim); ``g`` (log
    decay, <= 0) and ``beta``: (tokens, heads); tokens in the step's layout (request after request).
    """
    call = StateOpCall.current("pb_state::gated_delta_rule", state)
    _, heads, v_dim = v.shape
    if heads % k.shape[1] or call.slot_shape != (heads, k.shape[2], v_dim):
        call.refuse(f"k has {k.shape[1]} heads of {k.shape[2]}, v {heads} heads of {v_dim} (a multiple of k's)",
                    "(value heads, key_dim, value_dim)")
    call.require_positive("chunk_size", chunk_size)
    call.run(
        out,
        step=lambda at, s: delta_step(pick(q, at), pick(k, at), pick(v, at), pick(g, at), pick(beta, at), s, l2norm),
        sequence=lambda p, s: delta_sequence(q[p], k[p], v[p], g[p], beta[p], s, l2norm, chunk_size),
    )

register_splitting_op(gated_delta_rule)
