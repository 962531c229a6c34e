"""The Mamba2 state-space scan (SSD) of Mamba2 mixers (nemotron_h, bamba, granitemoehybrid, falcon_h1):
``pb_state::ssd_scan``.

Per head ``h`` the state ``S`` (head_dim, state_size) evolves token by token as

    dt <- softplus(dt + dt_bias);   S <- exp(dt * A[h]) * S + dt * x B^T;   y = S C + D[h] * x

with ``B``/``C`` (state_size) shared by the heads of a group. Two formulations, in float32:

* :func:`ssd_sequence`: one request's tokens in chunks of ``chunk_size`` (within a chunk a masked,
  decayed ``C B^T`` product; across chunks a recurrence of chunk-end states): prefills; ``dt`` is
  clamped to ``dt_limit`` there, as transformers does in its chunked form;
* :func:`ssd_step`: one token of each of many requests, the recurrence itself: decode, graph-safe
  (``dt`` not clamped: transformers' single-step form does not clamp it either).

They are what transformers runs without ``mamba_ssm`` for a prompt and for a decode token, so tokens
follow ``generate``. The op picks as :mod:`.delta` does, and reads one copy of the slot and writes
the other (:mod:`.metadata`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops import register_splitting_op
from .metadata import StateOpCall, pick


def _dt(dt: torch.Tensor, dt_bias: torch.Tensor | None, softplus: bool) -> torch.Tensor:
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    return F.softplus(dt) if softplus else dt


def _segment_sums(a: torch.Tensor) -> torch.Tensor:
    """``out[..., i, j] = a[..., j+1] + ... + a[..., i]`` for ``j <= i`` (0 on the diagonal), -inf above it;
    summed from masked copies rather than as differences of a cumulative sum (steadier)."""
    n = a.shape[-1]
    below = torch.ones(n, n, dtype=torch.bool, device=a.device).tril(-1)
    sums = a[..., None].expand(*a.shape, n).masked_fill(~below, 0).cumsum(-2)
    return sums.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=a.device).tril(), float("-inf"))


def ssd_sequence(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None,
    dt_bias: torch.Tensor | None, state: torch.Tensor, chunk_size: int = 256, dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request: ``x`` (n, heads, head_dim), ``dt`` (n, heads), ``A``/``D``/``dt_bias`` (heads,), ``B``/``C``
    (n, groups, state_size), from ``state`` (heads, head_dim, state_size) -> (y like ``x``, new state)."""
    n, heads, _ = x.shape
    dt = _dt(dt, dt_bias, dt_softplus).clamp(min=dt_limit[0], max=dt_limit[1])
    xf = x.float()
    per_group = heads // B.shape[1]
    B, C = (t.float().repeat_interleave(per_group, dim=1) for t in (B, C))  # (n, heads, state_size)
    pad = -n % chunk_size
    skip = None if D is None else D[:, None] * F.pad(xf, (0, 0, 0, 0, 0, pad))
    xs = xf * dt[..., None].float()
    a = A.to(xs.dtype) * dt.float()  # (n, heads): log decay of each token
    chunked = lambda t: F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad)).reshape(-1, chunk_size, *t.shape[1:])  # noqa: E731
    xs, a, B, C = chunked(xs), chunked(a), chunked(B), chunked(C)  # (chunks, L, heads, ...)
    a = a.permute(2, 0, 1)  # (heads, chunks, L)
    cum = a.cumsum(-1)
    within = torch.einsum("clhn,cshn->clsh", C, B) * _segment_sums(a).exp().permute(1, 2, 3, 0)
    y = torch.einsum("clsh,cshp->clhp", within, xs)
    to_end = (cum[..., -1:] - cum).exp()  # decay from each token to its chunk's end
    ends = torch.einsum("clhn,clhp->chpn", B * to_end.permute(1, 2, 0)[..., None], xs)
    ends = torch.cat([state.float()[None], ends])  # (1 + chunks, heads, head_dim, state)
    across = _segment_sums(F.pad(cum[..., -1], (1, 0))).exp()  # (heads, 1 + chunks, 1 + chunks)
    starts = torch.einsum("hcz,zhpn->chpn", across, ends)
    y = y + torch.einsum("clhn,chpn->clhp", C, starts[:-1]) * cum.exp().permute(1, 2, 0)[..., None]
    y = y.reshape(-1, heads, x.shape[-1])
    if skip is not None:
        y = y + skip
    return y[:n].to(x.dtype), starts[-1]


def ssd_step(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None,
    dt_bias: torch.Tensor | None, states: torch.Tensor, dt_softplus: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per request: ``x`` (R, heads, head_dim), ``dt`` (R, heads), ``B``/``C`` (R, groups, state_size),
    ``states`` (R, heads, head_dim, state_size) -> (y like ``x``, new states)."""
    requests, heads, head_dim = x.shape
    size = B.shape[-1]
    # Per (head, head_dim) element, as transformers' single-step form computes it: the same elementwise
    # shapes give the same vectorized exp/softplus roundings.
    bias = None if dt_bias is None else dt_bias[:, None].expand(heads, head_dim)
    dt = _dt(dt[..., None].expand(requests, heads, head_dim), bias, dt_softplus)[..., None]  # (R, heads, head_dim, 1)
    per_group = heads // B.shape[1]
    B, C = (t.repeat_interleave(per_group, dim=1) for t in (B, C))  # (R, heads, state_size)
    decay = torch.exp(dt.float() * A.float()[:, None, None].expand(heads, head_dim, size))
    s = states * decay + dt * B[:, :, None, :] * x[..., None]
    y = (s.to(C.dtype) @ C[..., None])[..., 0]  # (R, heads, head_dim)
    if D is not None:
        y = y + x * D[:, None].expand(heads, head_dim)
    return y.to(x.dtype), s


@torch.library.custom_op("pb_state::ssd_scan", mutates_args=("out",))
def ssd_scan(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None,
    dt_bias: torch.Tensor | None, out: torch.Tensor, state: int, chunk_size: int, dt_softplus: bool, dt_min: float,
    dt_max: float,
) -> None:
    """``out`` = the Mamba2 scan per request from the slot's SSM state ``state``, which it advances.

    ``x``/``out``: (tokens, heads, head_dim); ``dt``: (tokens, heads); ``B``/``C``: (tokens, groups,
    state_size); ``A``, ``D``, ``dt_bias``: (heads,); tokens in the step's layout (request after request);
    prefills clamp ``dt`` to ``[dt_min, dt_max]`` (``dt_max`` may be ``inf``).
    """
    call = StateOpCall.current("pb_state::ssd_scan", state)
    _, heads, head_dim = x.shape
    if heads % B.shape[1] or call.slot_shape != (heads, head_dim, B.shape[2]):
        call.refuse(f"x has {heads} heads of {head_dim}, B {B.shape[1]} groups (dividing the heads) of state size "
                    f"{B.shape[2]}", "(heads, head_dim, state_size)")
    call.require_positive("chunk_size", chunk_size)
    call.run(
        out,
        step=lambda at, s: ssd_step(pick(x, at), pick(dt, at), A, pick(B, at), pick(C, at), D, dt_bias, s, dt_softplus),
        sequence=lambda p, s: ssd_sequence(x[p], dt[p], A, B[p], C[p], D, dt_bias, s, chunk_size, dt_softplus,
                                           (dt_min, dt_max)),
    )

register_splitting_op(ssd_scan)
