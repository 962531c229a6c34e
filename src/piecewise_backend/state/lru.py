"""The diagonal linear recurrence of RG-LRU layers (RecurrentGemma, Griffin): ``pb_state::linear_recurrence``.

Per channel the state ``h`` evolves as ``h <- a * h + x`` and every token outputs its new ``h``;
``a`` (the gated decay, 0 where a request restarts) and ``x`` (the normalized, gated input) come from
the layer. The accumulation is float32, as transformers' scan. :func:`recurrence_sequence` runs
one request's tokens, :func:`recurrence_step` one token of each of many requests (graph-safe).
"""

from __future__ import annotations

import torch

from ..ops import register_splitting_op
from .metadata import StateOpCall, pick


def recurrence_step(a: torch.Tensor, x: torch.Tensor, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per request: ``a``/``x`` (R, width), ``states`` (R, width) -> (outputs like ``x``, new states)."""
    h = a.float() * states.float() + x.float()
    return h.to(x.dtype), h


def recurrence_sequence(a: torch.Tensor, x: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One request: ``a``/``x`` (n, width) from ``state`` (width,) -> (outputs like ``x``, new state)."""
    h = state.float()
    out = torch.empty_like(x)
    for t in range(x.shape[0]):
        h = a[t].float() * h + x[t].float()
        out[t] = h.to(x.dtype)
    return out, h


@torch.library.custom_op("pb_state::linear_recurrence", mutates_args=("out",))
def linear_recurrence(a: torch.Tensor, x: torch.Tensor, out: torch.Tensor, state: int) -> None:
    """``out`` = the recurrence ``h <- a * h + x`` per request from the slot's state ``state``, which it advances.

    ``a``/``x``/``out``: (tokens, width) in the step's layout.
    """
    call = StateOpCall.current("pb_state::linear_recurrence", state)
    if a.shape != x.shape or x.dim() != 2 or call.slot_shape != x.shape[1:]:
        call.refuse(f"a {tuple(a.shape)} and x {tuple(x.shape)} must be equal (tokens, width)", "(width,)")
    call.run(
        out,
        step=lambda at, s: recurrence_step(pick(a, at), pick(x, at), s),
        sequence=lambda p, s: recurrence_sequence(a[p], x[p], s),
    )

register_splitting_op(linear_recurrence)
