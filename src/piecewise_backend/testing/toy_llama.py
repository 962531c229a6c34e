"""A tiny Llama-style model with random weights, for examples, tests and benchmarks.

RMSNorm, fused QKV, SiLU-gated MLP, and a swappable attention:

* ``"inplace"``: ``pb_toy::attention`` custom op that writes into a caller-provided ``out``;
* ``"fresh"``: ``pb_toy::attention_fresh`` custom op that returns a new tensor;
* ``"break"``: plain Python attention decorated with :func:`piecewise_backend.eager_break`;
* ``"sdpa"``: ``F.scaled_dot_product_attention`` straight in the model (causal, no KV cache).

With no ``attn_metadata`` in the forward context, attention is causal over the batch as one
sequence. With one (see :class:`AttnMetadata`), each token attends to its request's KV cache:
tensors only, no host sync, so the same code runs inside a FULL graph.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..capture.session import eager_break
from ..context import current_forward_context
from ..ops import register_splitting_op

ATTENTION_KINDS = ("inplace", "fresh", "break", "sdpa")


@dataclasses.dataclass
class AttnMetadata:
    """Per-step attention inputs: a token's KV slot and position, and the caches per layer."""

    slot_mapping: torch.Tensor  # (tokens,) long: request slot of each token
    positions: torch.Tensor  # (tokens,) long: position of each token in its request
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (slots, max_len, heads, head_dim)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    ctx = current_forward_context()
    meta: AttnMetadata | None = getattr(ctx, "attn_metadata", None)
    if meta is None:
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
        return out.transpose(0, 1).contiguous()
    k_cache, v_cache = meta.kv_caches[layer]
    slots, pos = meta.slot_mapping[: q.shape[0]], meta.positions[: q.shape[0]]
    k_cache[slots, pos] = k
    v_cache[slots, pos] = v
    keys, values = k_cache[slots], v_cache[slots]  # (tokens, max_len, heads, head_dim)
    scores = torch.einsum("thd,tlhd->thl", q, keys) * q.shape[-1] ** -0.5
    visible = torch.arange(keys.shape[1], device=q.device)[None, :] <= pos[:, None]
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    return torch.einsum("thl,tlhd->thd", scores.softmax(-1), values)


@torch.library.custom_op("pb_toy::attention", mutates_args=("out",))
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layer: int) -> None:
    out.copy_(_attend(q, k, v, layer))


@torch.library.custom_op("pb_toy::attention_fresh", mutates_args=())
def attention_fresh(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    return _attend(q, k, v, layer)


@attention_fresh.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    return torch.empty_like(q)


@eager_break
def attention_break(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    return _attend(q, k, v, layer)


register_splitting_op(attention)
register_splitting_op(attention_fresh)


@dataclasses.dataclass(frozen=True)
class ToyConfig:
    vocab_size: int = 128
    hidden_size: int = 32
    num_heads: int = 4
    intermediate_size: int = 64
    num_layers: int = 2
    attention: str = "inplace"

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"ToyConfig.attention must be one of {ATTENTION_KINDS}, got {self.attention!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"ToyConfig.hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ToyConfig, index: int):
        super().__init__()
        self.cfg, self.index = cfg, index
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.input_norm, self.post_norm = RMSNorm(h), RMSNorm(h)
        self.qkv_proj = nn.Linear(h, 3 * h, bias=False)
        self.o_proj = nn.Linear(h, h, bias=False)
        self.gate_up_proj = nn.Linear(h, 2 * i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def attn(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kind = self.cfg.attention
        if kind == "inplace":
            out = torch.empty_like(q)
            torch.ops.pb_toy.attention(q, k, v, out, self.index)
            return out
        if kind == "fresh":
            return torch.ops.pb_toy.attention_fresh(q, k, v, self.index)
        if kind == "break":
            return attention_break(q, k, v, self.index)
        t = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        return F.scaled_dot_product_attention(*t, is_causal=True).transpose(0, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, heads, d = x.shape[0], self.cfg.num_heads, self.cfg.head_dim
        q, k, v = self.qkv_proj(self.input_norm(x)).view(n, 3, heads, d).unbind(1)
        x = x + self.o_proj(self.attn(q.contiguous(), k.contiguous(), v.contiguous()).reshape(n, heads * d))
        gate, up = self.gate_up_proj(self.post_norm(x)).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)


class ToyLlama(nn.Module):
    """``forward(input_ids: (tokens,) long) -> logits (tokens, vocab)``."""

    def __init__(self, cfg: ToyConfig | None = None):
        super().__init__()
        self.cfg = cfg = cfg or ToyConfig()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))

    def make_kv_caches(self, num_slots: int, max_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape = (num_slots, max_len, self.cfg.num_heads, self.cfg.head_dim)
        dev, dt = self.lm_head.weight.device, self.lm_head.weight.dtype
        return [(torch.zeros(shape, device=dev, dtype=dt), torch.zeros(shape, device=dev, dtype=dt)) for _ in self.layers]


def make_model(
    num_layers: int = 2, attention: str = "inplace", seed: int = 0, device: str | torch.device = "cpu", **kw: int
) -> ToyLlama:
    """A seeded random ToyLlama in eval mode (the factory the CLI and examples use)."""
    torch.manual_seed(seed)
    return ToyLlama(ToyConfig(num_layers=num_layers, attention=attention, **kw)).to(device).eval()
