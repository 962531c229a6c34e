"""The causal depthwise convolution of short-conv and gated-delta-net layers: ``pb_state::causal_conv1d``.

Each output channel ``c`` at token ``t`` is ``sum_j weight[c, j] * x[t - (K-1) + j, c]`` (+ bias),
over the request's own earlier inputs only: the first ``K - 1`` come from the slot's conv state
(zeros for a new request), which keeps the request's last ``K - 1`` inputs for the next step.

* :func:`conv_sequence` runs one request's tokens (a prefill or a prefill chunk);
* :func:`conv_step` runs one token of each of many requests (a decode batch), graph-safe.

The op runs :func:`conv_step` over every token when it runs inside a graph (a FULL uniform-decode
step: one token per request), and per request otherwise (eager steps and PIECEWISE breaks). It
reads the slot's current copy and writes the other one (:mod:`.metadata`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops import register_splitting_op
from .metadata import StateOpCall, pick

#: Activations the op applies after the convolution ("" = none).
ACTIVATIONS = {"": None, "silu": F.silu, "swish": F.silu}


def _activate(y: torch.Tensor, activation: str) -> torch.Tensor:
    fn = ACTIVATIONS[activation]
    return y if fn is None else fn(y)


def conv_sequence(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str = "",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request: ``x`` (tokens, channels) after ``state`` (channels, K - 1) -> (output like ``x``, new state)."""
    channels, width = weight.shape
    window = torch.cat([state.to(weight.dtype), x.transpose(0, 1).to(weight.dtype)], dim=-1)  # (C, K-1+n)
    y = F.conv1d(window[None], weight[:, None, :], bias, groups=channels)[0]  # (C, n)
    return _activate(y, activation).transpose(0, 1).to(x.dtype), window[:, window.shape[1] - (width - 1):]


def conv_step(
    x: torch.Tensor, states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str = "",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per request: ``x`` (requests, channels), ``states`` (requests, channels, K - 1)."""
    channels = weight.shape[0]
    window = torch.cat([states.to(weight.dtype), x[:, :, None].to(weight.dtype)], dim=-1)  # (R, C, K)
    y = F.conv1d(window, weight[:, None, :], bias, groups=channels)[:, :, 0]
    return _activate(y, activation).to(x.dtype), window[:, :, 1:]


@torch.library.custom_op("pb_state::causal_conv1d", mutates_args=("out",))
def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, state: int, activation: str = "",
) -> None:
    """``out = conv(x)`` per request over the slot's conv state ``state``, which it advances.

    ``x``/``out``: (tokens, channels) in the step's layout (request after request); ``weight``:
    (channels, K); ``state`` indexes the forward context's ``state_metadata.states``.
    """
    call = StateOpCall.current("pb_state::causal_conv1d", state)
    channels = x.shape[1]
    if weight.dim() != 2 or weight.shape[0] != channels or call.slot_shape != (channels, weight.shape[1] - 1):
        call.refuse(f"x has {channels} channels and weight is {tuple(weight.shape)} (channels, K)", "(channels, K - 1)")
    if activation not in ACTIVATIONS:
        raise ValueError(f"{call.op}: activation {activation!r} is not one of {sorted(ACTIVATIONS)}")
    call.run(
        out,
        step=lambda at, s: conv_step(pick(x, at), s, weight, bias, activation),
        sequence=lambda part, s: conv_sequence(x[part], s, weight, bias, activation),
    )

register_splitting_op(causal_conv1d)
