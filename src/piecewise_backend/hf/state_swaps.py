"""Forwards of our own for the HF state layers that keep their state in their own code (no module-level kernel).

:mod:`.mixers` routes layers whose forward calls a kernel by name; MiniMax's lightning attention,
RecurrentGemma's recurrent block and ZAYA's CCA projection compute their recurrence (or their
window of past tokens) inline, so :data:`SWAPS` gives each such class a forward that computes what
transformers' does, with every state-keeping step a call ``kernels[name](...)`` on the tokens of the
row ((tokens, ...) tensors): the probe binds those calls to the reference forms on a zero state and
records the states they need, serving binds them to the ``pb_state`` ops on the layer's slots.

:data:`KINDS` names, per kind of state call, its op, its state's shape, and its two reference forms.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ..state import conv, lightning, lru, window
from .patching import ByClassName, Swap

Kernels = dict[str, Callable[..., torch.Tensor]]


@dataclasses.dataclass(frozen=True)
class Kind:
    """One kind of state call ``(*args) -> output``: the state's shape and dtype from its arguments, its
    whole-sequence form ``(*args, state)`` and its one-token-per-request form ``(*args, states)``
    (both ``-> (output, new state)``), and ``run(index, *args)``: the ``pb_state`` op on state ``index``."""

    shape: Callable[..., tuple[int, ...]]
    dtype: Callable[..., torch.dtype]
    sequence: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    step: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    run: Callable[..., torch.Tensor]


def _run_conv(index: int, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = torch.empty_like(x)
    torch.ops.pb_state.causal_conv1d(x, weight, bias, out, index, "")
    return out


def _run_lightning(index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slope: torch.Tensor,
                   block_size: int) -> torch.Tensor:
    out = torch.empty_like(v)
    torch.ops.pb_state.lightning_attention(q, k, v, slope, out, index, block_size)
    return out


def _run_recurrence(index: int, a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    torch.ops.pb_state.linear_recurrence(a, x, out, index)
    return out


def _window_kind() -> Kind:
    """The recent inputs of ``x`` (tokens, channels), ``keep`` past tokens with each."""

    def run(index: int, x: torch.Tensor, keep: int) -> torch.Tensor:
        out = x.new_empty((*x.shape, keep + 1))
        torch.ops.pb_state.causal_window(x, out, index)
        return out

    return Kind(
        shape=lambda x, keep: (x.shape[1], keep), dtype=lambda x, keep: x.dtype,
        sequence=lambda x, keep, s: window.window_sequence(x, s), step=lambda x, keep, s: window.window_step(x, s),
        run=run,
    )


KINDS: dict[str, Kind] = {
    "conv": Kind(  # (x (tokens, channels), weight (channels, K), bias): a causal depthwise convolution, no activation
        shape=lambda x, w, b: (x.shape[1], w.shape[1] - 1), dtype=lambda x, w, b: x.dtype,
        sequence=lambda x, w, b, s: conv.conv_sequence(x, s, w, b), step=lambda x, w, b, s: conv.conv_step(x, s, w, b),
        run=_run_conv,
    ),
    "lightning": Kind(  # (q, k, v (tokens, heads, dim), slope (heads,), block_size)
        shape=lambda q, k, v, slope, block: (q.shape[1], q.shape[2], v.shape[2]), dtype=lambda *a: torch.float32,
        sequence=lambda q, k, v, slope, block, s: lightning.lightning_sequence(q, k, v, slope, s, block),
        step=lambda q, k, v, slope, block, s: lightning.lightning_step(q, k, v, slope, s),
        run=_run_lightning,
    ),
    "recurrence": Kind(  # (a, x (tokens, width)): h <- a * h + x
        shape=lambda a, x: (x.shape[1],), dtype=lambda *a: torch.float32,
        sequence=lambda a, x, s: lru.recurrence_sequence(a, x, s), step=lambda a, x, s: lru.recurrence_step(a, x, s),
        run=_run_recurrence,
    ),
    "window": _window_kind(),  # (x (tokens, channels), keep)
}


def _one_row(name: str, hidden: torch.Tensor) -> None:
    if hidden.shape[0] != 1:
        raise ValueError(
            f"{name}: piecewise_backend's forward serves one tokens-first row (batch 1), got hidden states {tuple(hidden.shape)}"
        )


def lightning_forward(self: Any, kernels: Kernels, hidden_states: torch.Tensor, position_embeddings: Any = None,
                      attention_mask: torch.Tensor | None = None, cache: Any = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """MiniMax's lightning attention: the gated, normalized output of decayed linear attention."""
    _one_row(type(self).__name__, hidden_states)
    n = hidden_states.shape[1]
    qkv = self.act_fn(self.qkv_proj(hidden_states))
    if attention_mask is not None and attention_mask.dim() == 2:  # a padding mask, as transformers applies it
        qkv = qkv * attention_mask[:, :, None].to(qkv.dtype)
    q, k, v = qkv[0].reshape(n, self.num_attention_heads, 3 * self.head_dim).split(self.head_dim, dim=-1)
    mixed = kernels["linear"](q, k, v, self.slope_rate.reshape(-1), int(self.block_size))
    out = self.norm(mixed.reshape(1, n, -1).to(hidden_states.dtype))
    out = torch.sigmoid(self.output_gate(hidden_states)) * out
    return self.out_proj(out), None


def recurrent_block_forward(self: Any, kernels: Kernels, input_states: torch.Tensor, position_ids: torch.Tensor,
                            attention_mask: Any = None, use_cache: bool = True, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """RecurrentGemma's (Griffin's) recurrent block: a gated branch times conv1d -> RG-LRU of the other."""
    _one_row(type(self).__name__, input_states)
    n = input_states.shape[1]
    gate = self.act_fn(self.linear_y(input_states))
    x = kernels["conv"](self.linear_x(input_states)[0], self.conv_1d.weight[:, 0, :], self.conv_1d.bias)
    lru_ = self.rg_lru
    blocks = x.reshape(n, lru_.num_attention_heads, lru_.block_width).transpose(0, 1)  # (heads, tokens, block)
    per_head = lambda w, b: torch.baddbmm(b[:, None, :], blocks, w).transpose(0, 1).reshape(n, -1)
    input_gate = torch.sigmoid(per_head(lru_.input_gate_weight, lru_.input_gate_bias))
    decay_gate = torch.sigmoid(per_head(lru_.recurrent_gate_weight, lru_.recurrent_gate_bias))
    log_a = -8.0 * decay_gate * F.softplus(lru_.recurrent_param)
    # a request's first token (position 0) restarts: no decay of the (zero) state, no input normalization
    start = (position_ids[0] == 0)[:, None]
    scale = torch.where(start, torch.ones_like(log_a), torch.sqrt(1 - torch.exp(2 * log_a)))
    h = kernels["lru"](torch.exp(log_a) * ~start, x * input_gate * scale.to(x.dtype))
    return self.linear_out(h[None] * gate), None


def cca_forward(self: Any, kernels: Kernels, hidden_states: torch.Tensor, cache: Any = None,
                conv_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ZAYA's compressed convolutional attention projection: q/k mixed over a window of past tokens by two
    stacked convolutions plus residual paths; half of each value head from the previous token."""
    _one_row(type(self).__name__, hidden_states)
    if conv_mask is not None:
        hidden_states = hidden_states * conv_mask[:, :, None].to(hidden_states.dtype)
    h, n, d, groups = hidden_states[0], hidden_states.shape[1], self.head_dim, self.num_key_value_groups
    q, k = self.q_proj(h), self.k_proj(h)
    q_res = (q.view(n, -1, d) + k.view(n, -1, d).repeat_interleave(groups, dim=1)) * 0.5
    k_res = q_res.view(n, -1, groups, d).mean(-2)
    recent = kernels["qk"](torch.cat([q, k], dim=-1), int(self.conv_kernel_size))  # (tokens, channels, window)
    mixed = self.conv_qk_grouped(self.conv_qk_depthwise(recent))[..., 0]  # one output per token's window
    query = mixed[:, :q.shape[-1]].view(n, -1, d) + q_res
    key = mixed[:, q.shape[-1]:].view(n, -1, d) + k_res
    delayed, bias = self.v_proj_delayed(h), self.v_proj_delayed.bias
    # the state keeps the previous token's projection without its bias: zeros before the first token, whose
    # delayed half is then the projection of zeros (the bias), as transformers' is
    raw = delayed if bias is None else delayed - bias
    previous = kernels["value"](raw, 1)[..., 0]
    if bias is not None:
        previous = previous + bias
    value = torch.cat([self.v_proj_current(h), previous], dim=-1).view(n, -1, d)
    return query[None], key[None], value[None]


#: Forwards of ours, by :func:`~.patching.class_key` (transformers 5.24's classes of these families); each
#: :class:`~.patching.Swap`'s ``states`` maps its state calls to their kinds (:data:`KINDS`).
REGISTRY: dict[str, Swap] = {
    "transformers.models.minimax.modeling_minimax.MiniMaxLightningAttention": Swap(lightning_forward, {"linear": "lightning"}),
    "transformers.models.recurrent_gemma.modeling_recurrent_gemma.RecurrentGemmaRecurrentBlock": Swap(
        recurrent_block_forward, {"conv": "conv", "lru": "recurrence"}
    ),
    "transformers.models.zaya.modeling_zaya.ZayaCCAProjection": Swap(cca_forward, {"qk": "window", "value": "window"}),
}
#: :data:`REGISTRY` by bare class name (``SWAPS["MiniMaxLightningAttention"]``), as documented.
SWAPS = ByClassName(REGISTRY)
