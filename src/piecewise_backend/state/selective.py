"""The Mamba1 selective scan of Mamba mixers (mamba, falcon_mamba, jamba): ``pb_state::selective_scan``.

Per channel ``d`` the state ``s`` (state_size) evolves token by token as

    dt <- softplus(dt + dt_bias);   s <- exp(dt * A[d]) * s + dt * B * u;   y = (s . C + D[d] * u) * silu(z)

with ``A`` (channels, state_size) fixed and ``B``/``C`` (state_size) per token. transformers runs
this recurrence itself without ``mamba_ssm``, for a prompt (:func:`selective_sequence`, token by
token in one request, channels first as it lays them out) and for a decode token
(:func:`selective_step`, one token of many requests, graph-safe), so tokens follow ``generate``.
The op picks as :mod:`.delta` does, and reads one copy of the slot and writes the other
(:mod:`.metadata`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops import register_splitting_op
from .metadata import StateOpCall, pick


def selective_sequence(
    u: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None,
    z: torch.Tensor | None, dt_bias: torch.Tensor | None, state: torch.Tensor, dt_softplus: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request: ``u``/``dt``/``z`` (n, channels), ``B``/``C`` (n, state_size), from ``state`` (channels,
    state_size) -> (y (n, channels), new state)."""
    dtype = u.dtype
    u, dt = u.t().contiguous()[None], dt.t().contiguous()[None]  # (1, channels, n): transformers' layout
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)[..., None]
    if dt_softplus:
        dt = F.softplus(dt)
    decay = torch.exp(A[None, :, None, :] * dt[:, :, :, None])  # (1, channels, n, state)
    push = dt[:, :, :, None] * B[None, None].float() * u[:, :, :, None].float()
    s = state[None].to(decay.dtype)
    outs = []
    for t in range(u.shape[2]):
        s = decay[:, :, t] * s + push[:, :, t]
        outs.append(torch.matmul(s.to(dtype), C[None, t, :, None])[:, :, 0])
    y = torch.stack(outs, dim=-1)  # (1, channels, n)
    if D is not None:
        y = y + u * D[None, :, None]
    if z is not None:
        y = y * F.silu(z.t().contiguous()[None])
    return y[0].t().to(dtype), s[0]


def selective_step(
    u: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None,
    z: torch.Tensor | None, dt_bias: torch.Tensor | None, states: torch.Tensor, dt_softplus: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per request: ``u``/``dt``/``z`` (R, channels), ``B``/``C`` (R, state_size), ``states``
    (R, channels, state_size) -> (y (R, channels), new states)."""
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    decay = torch.exp(dt.float()[..., None] * A.float())
    s = states.float() * decay + dt.float()[..., None] * B.float()[:, None, :] * u.float()[..., None]
    y = torch.matmul(s.to(C.dtype), C[..., None])[..., 0]
    if D is not None:
        y = y + u * D
    if z is not None:
        y = y * F.silu(z)
    return y.to(u.dtype), s


@torch.library.custom_op("pb_state::selective_scan", mutates_args=("out",))
def selective_scan(
    u: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None,
    z: torch.Tensor | None, dt_bias: torch.Tensor | None, out: torch.Tensor, state: int, dt_softplus: bool = True,
) -> None:
    """``out`` = the Mamba1 selective scan per request from the slot's SSM state ``state``, which it advances.

    ``u``/``dt``/``z``/``out``: (tokens, channels); ``A``: (channels, state_size); ``B``/``C``: (tokens,
    state_size); ``D``, ``dt_bias``: (channels,); tokens in the step's layout (request after request).
    """
    call = StateOpCall.current("pb_state::selective_scan", state)
    channels = u.shape[1]
    if A.shape != (channels, B.shape[1]) or call.slot_shape != A.shape:
        call.refuse(f"u has {channels} channels, A is {tuple(A.shape)}, B has state size {B.shape[1]}",
                    "(channels, state_size) like A")
    call.run(
        out,
        step=lambda at, s: selective_step(pick(u, at), pick(dt, at), A, pick(B, at), pick(C, at), D, pick(z, at), dt_bias,
                                          s, dt_softplus),
        sequence=lambda p, s: selective_sequence(u[p], dt[p], A, B[p], C[p], D, None if z is None else z[p], dt_bias, s,
                                                 dt_softplus),
    )

register_splitting_op(selective_scan)
