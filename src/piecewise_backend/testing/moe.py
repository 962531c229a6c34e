"""ToyMoE: a small MoE decoder with expert parallelism over torch.distributed (the micro-batching reference).

Each layer: causal attention within each request, then an MoE block (router, top-k experts,
a shared expert). Experts are sharded across the ranks of the default process group; tokens
reach their experts' rank and come back through two ``all_to_all_single`` collectives of a
fixed shape (every rank sends each peer all of its ``tokens * top_k`` routed rows, the expert
id riding along as one more column; the receiver keeps the rows of its own experts), so a
step's collectives depend on its token count only and can be captured in a graph.
Each collective is launched in a ``dbo_comm()`` region (on CUDA: the communication stream) and
followed by ``dbo_yield()``: under micro-batching the other half computes while this half's rows
are on the wire.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from ..ubatch.threads import dbo_comm, dbo_yield

_functional = torch.ops._c10d_functional


def _normal(gen: torch.Generator, *shape: int, fan_in: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) / math.sqrt(fan_in)


def rms_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class Attention(nn.Module):
    """Single-head causal attention over the tokens of the same request (``seq_ids``; padding: -1)."""

    def __init__(self, dim: int, gen: torch.Generator):
        super().__init__()
        self.qkv = nn.Parameter(_normal(gen, dim, 3 * dim, fan_in=dim))
        self.out = nn.Parameter(_normal(gen, dim, dim, fan_in=dim))

    def forward(self, x: torch.Tensor, seq_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        q, k, v = (x @ self.qkv).chunk(3, dim=-1)
        scores = q @ k.T / math.sqrt(x.shape[-1])
        visible = (seq_ids[:, None] == seq_ids[None, :]) & (positions[None, :] <= positions[:, None])
        return torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1) @ v @ self.out


class MoE(nn.Module):
    """Router, ``top_k`` of ``num_experts`` experts (this rank holds its share), a shared expert."""

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int, gen: torch.Generator, sharded: bool):
        super().__init__()
        self.world = dist.get_world_size() if sharded and dist.is_initialized() else 1
        self.rank = dist.get_rank() if self.world > 1 else 0
        if num_experts % self.world:
            raise ValueError(f"ToyMoE: num_experts={num_experts} must divide evenly over {self.world} ranks")
        self.top_k = top_k
        self.router = nn.Parameter(_normal(gen, dim, num_experts, fan_in=dim))
        w1 = _normal(gen, num_experts, dim, hidden, fan_in=dim)
        w2 = _normal(gen, num_experts, hidden, dim, fan_in=hidden)
        local = num_experts // self.world
        self.first = self.rank * local  # global id of this rank's first expert
        self.w1 = nn.Parameter(w1[self.first:self.first + local].clone())
        self.w2 = nn.Parameter(w2[self.first:self.first + local].clone())
        self.shared1 = nn.Parameter(_normal(gen, dim, hidden, fan_in=dim))
        self.shared2 = nn.Parameter(_normal(gen, hidden, dim, fan_in=hidden))

    def _all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """Launch a fixed-shape all-to-all, let the other micro-batch run, then wait for the result."""
        rows = [x.shape[0] // self.world] * self.world
        with dbo_comm(x):
            out = _functional.all_to_all_single(x, rows, rows, dist.group.WORLD.group_name)
        dbo_yield()  # in flight: the other half computes meanwhile (its compute waits for it on resuming)
        return _functional.wait_tensor(out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens, dim = x.shape
        weights, experts = torch.softmax(x @ self.router, dim=-1).topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        routed = torch.cat([x.repeat_interleave(self.top_k, 0), experts.reshape(-1, 1).to(x.dtype)], dim=1)
        if self.world > 1:  # dispatch: every rank gets every routed row, keeps those of its experts
            routed = self._all_to_all(routed.repeat(self.world, 1))
        h, ids = routed[:, :dim], routed[:, dim].round().long()
        out = torch.zeros_like(h)
        for j in range(self.w1.shape[0]):  # dense over the rows, masked: no data-dependent shapes
            mine = (ids == self.first + j).unsqueeze(1).to(h.dtype)
            out = out + mine * (torch.relu(h @ self.w1[j]) @ self.w2[j])
        if self.world > 1:  # combine: each row comes back from every rank, non-zero from its expert's
            out = self._all_to_all(out).view(self.world, -1, dim).sum(0)
        routed_out = (out.view(tokens, self.top_k, dim) * weights.unsqueeze(-1)).sum(1)
        return routed_out + torch.relu(x @ self.shared1) @ self.shared2


class ToyMoE(nn.Module):
    """``forward(input_ids, seq_ids, positions) -> logits``; ``sharded=False``: every expert on this rank."""

    def __init__(
        self, vocab: int = 64, dim: int = 16, hidden: int = 32, num_layers: int = 2, num_experts: int = 4,
        top_k: int = 2, seed: int = 0, sharded: bool = True,
    ):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.embed = nn.Parameter(_normal(gen, vocab, dim, fan_in=1))
        self.attn = nn.ModuleList()
        self.moe = nn.ModuleList()
        for _ in range(num_layers):
            self.attn.append(Attention(dim, gen))
            self.moe.append(MoE(dim, hidden, num_experts, top_k, gen, sharded))
        self.head = nn.Parameter(_normal(gen, dim, vocab, fan_in=dim))

    def forward(self, input_ids: torch.Tensor, seq_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed[input_ids]
        for attn, moe in zip(self.attn, self.moe):
            x = x + attn(rms_norm(x), seq_ids, positions)
            x = x + moe(rms_norm(x))
        return rms_norm(x) @ self.head
