"""The recent inputs of layers that mix a fixed window of past tokens their own way: ``pb_state::causal_window``.

Token ``t`` gets the ``width + 1`` inputs ``x[t - width], ..., x[t]`` of its own request, oldest
first (zeros before the request's first token); the slot's state keeps the last ``width``. A layer
then applies what it likes to the window (ZAYA's stacked depthwise and grouped convolutions, its
one-token value delay) as a batch of one-token problems: no state flows between requests.
:func:`window_sequence` serves one request's tokens, :func:`window_step` one token of each of many
requests (graph-safe).
"""

from __future__ import annotations

import torch

from ..ops import register_splitting_op
from .metadata import StateOpCall, pick


def window_step(x: torch.Tensor, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per request: ``x`` (R, channels), ``states`` (R, channels, width) -> ((R, channels, width + 1), new states)."""
    window = torch.cat([states.to(x.dtype), x[:, :, None]], dim=-1)
    return window, window[:, :, 1:]


def window_sequence(x: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One request: ``x`` (n, channels) after ``state`` (channels, width) -> ((n, channels, width + 1), new state)."""
    n, width = x.shape[0], state.shape[-1]
    row = torch.cat([state.to(x.dtype), x.transpose(0, 1)], dim=-1)  # (channels, width + n)
    return row.unfold(-1, width + 1, 1).transpose(0, 1), row[:, n:]


@torch.library.custom_op("pb_state::causal_window", mutates_args=("out",))
def causal_window(x: torch.Tensor, out: torch.Tensor, state: int) -> None:
    """``out[t]`` = the last ``width + 1`` inputs of token ``t``'s request, from the slot's state ``state``
    (channels, width), which it advances.

    ``x``: (tokens, channels) in the step's layout; ``out``: (tokens, channels, width + 1).
    """
    call = StateOpCall.current("pb_state::causal_window", state)
    if x.dim() != 2 or call.slot_shape[:-1] != x.shape[1:] or out.shape != (*x.shape, call.slot_shape[-1] + 1):
        call.refuse(f"x {tuple(x.shape)} must be (tokens, channels) and out {tuple(out.shape)} (tokens, channels, "
                    "width + 1)", "(channels, width)")
    call.run(
        out,
        step=lambda at, s: window_step(pick(x, at), s),
        sequence=lambda p, s: window_sequence(x[p], s),
    )

register_splitting_op(causal_window)
