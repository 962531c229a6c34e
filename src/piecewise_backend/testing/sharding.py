"""Tensor-parallel sharding of the toy models (DTensor over a device mesh) and their KV caches."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn as nn


class ToyMLP(nn.Module):
    """``up -> relu -> down``: colwise then rowwise sharding needs one all-reduce."""

    def __init__(self, dim: int = 8, hidden: int = 16, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def shard_mlp(model: ToyMLP, mesh: Any) -> ToyMLP:
    """Shard ``model`` in place over ``mesh``: ``up`` colwise, ``down`` rowwise (all-reduce)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    _check_divides("ToyMLP hidden size", model.up.out_features, mesh.size())
    return parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})


def _check_divides(what: str, value: int, ranks: int) -> None:
    if value % ranks:
        raise ValueError(
            f"{what} {value} is not divisible by the tensor-parallel size {ranks}; use a size that divides it"
        )


def _group_rows(weight: torch.Tensor, parts: int, ranks: int) -> torch.Tensor:
    """Reorder a fused ``(parts * out, in)`` weight so rank r's contiguous row block holds its slice of each part."""
    rows, cols = weight.shape
    return weight.reshape(parts, ranks, rows // (parts * ranks), cols).transpose(0, 1).reshape(rows, cols)


def shard_toy_llama(model: nn.Module, mesh: Any) -> nn.Module:
    """Shard a :class:`~piecewise_backend.toy_llama.ToyLlama` in place over ``mesh``, Megatron style.

    Per layer: fused QKV and gate/up colwise (rows regrouped so each rank holds whole heads
    of q, k and v), o_proj and down_proj rowwise (one all-reduce each); ``lm_head`` is
    vocab-parallel with a replicated output (one all-gather). Embedding and norms stay
    replicated. Each layer then sees its local head count, as attention needs.
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    cfg, ranks = model.cfg, mesh.size()
    _check_divides("ToyLlama num_heads", cfg.num_heads, ranks)
    _check_divides("ToyLlama intermediate_size", cfg.intermediate_size, ranks)
    _check_divides("ToyLlama vocab_size", cfg.vocab_size, ranks)
    local = dataclasses.replace(
        cfg, hidden_size=cfg.hidden_size // ranks, num_heads=cfg.num_heads // ranks,
        intermediate_size=cfg.intermediate_size // ranks,
    )
    plan: dict[str, Any] = {"lm_head": ColwiseParallel(output_layouts=Replicate())}
    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            layer.qkv_proj.weight.copy_(_group_rows(layer.qkv_proj.weight, 3, ranks))
            layer.gate_up_proj.weight.copy_(_group_rows(layer.gate_up_proj.weight, 2, ranks))
            layer.cfg = local  # the layer's forward reads its (local) head count from here
            plan.update({
                f"layers.{i}.qkv_proj": ColwiseParallel(), f"layers.{i}.o_proj": RowwiseParallel(),
                f"layers.{i}.gate_up_proj": ColwiseParallel(), f"layers.{i}.down_proj": RowwiseParallel(),
            })
    return parallelize_module(model, mesh, plan)


def make_kv_caches(model: nn.Module, num_slots: int, max_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer KV caches for this rank's heads of a (sharded or not) ToyLlama."""
    device, dtype = model.embed.weight.device, model.embed.weight.dtype
    caches = []
    for layer in model.layers:
        shape = (num_slots, max_len, layer.cfg.num_heads, layer.cfg.head_dim)
        caches.append((torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype)))
    return caches
