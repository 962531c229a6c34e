"""Attention modules outside transformers' AttentionInterface, swapped at module level onto the paged op.

falcon, bloom and mpt compute attention inside their own ``*Attention.forward`` (with ALiBi for
bloom, mpt and falcon's ``alibi=True`` checkpoints), so setting an attention implementation reaches
none of them. :func:`swap` gives each such module a forward of its own that computes q/k/v with the
module's projections (and RoPE for rotary falcon), calls the attention implementation named by the
module's ``pb_attention`` attribute (the probe's, then ``pb_paged``: the same entry points as every
AttentionInterface model), and applies the module's output projection. K/V stay grouped as the
projections give them (falcon's multi-query and ``new_decoder_architecture`` layouts), so the cache
holds the model's own KV heads.

ALiBi slopes are read from the family's own bias function (the bias at key positions 0 and 1, one
row per head), scaled as the family scales its bias, and kept on the module as the non-persistent
buffer ``pb_alibi_slopes``, which :func:`~piecewise_backend.hf.paged_attention_forward` passes to
``pb_kv::paged_attention``. Falcon rounds its bias to bfloat16 (``slope * position`` in bfloat16):
the slopes keep that rounding, the products do not, so positions past 256 (or slopes that are not
powers of two, with more than 8 heads) can differ from transformers by bfloat16's rounding.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

#: The module attribute naming the attention implementation a swapped forward calls.
IMPLEMENTATION_ATTR = "pb_attention"
#: The buffer holding a swapped ALiBi module's per-head slopes (scaled as the family scales its bias).
SLOPES_BUFFER = "pb_alibi_slopes"


def _attention(module: torch.nn.Module) -> Callable[..., Any]:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[getattr(module, IMPLEMENTATION_ATTR)]


def _heads_first(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(batch, tokens, heads, dim) -> (batch, heads, tokens, dim), the AttentionInterface layout."""
    return tuple(t.transpose(1, 2) for t in tensors)


def _family(module: torch.nn.Module) -> Any:
    """The transformers modeling module ``module``'s class is defined in (its bias and RoPE functions)."""
    return sys.modules[type(module).__module__]


def _slopes_of(bias: torch.Tensor) -> torch.Tensor:
    """Per-head slopes from an ALiBi bias at key positions 0 and 1: ``(heads, 1, 2)`` -> ``(heads,)``."""
    return (bias[:, 0, 1] - bias[:, 0, 0]).float()


def falcon_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, alibi: torch.Tensor | None, attention_mask: Any,
    position_ids: Any = None, layer_past: Any = None, use_cache: bool = False, output_attentions: bool = False,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """FalconAttention's forward on the attention implementation: the three q/k/v layouts, RoPE or ALiBi."""
    fused = self.query_key_value(hidden_states)
    batch, tokens, _ = fused.shape
    heads, dim = self.num_heads, self.head_dim
    if self.new_decoder_architecture:  # per KV group: its query heads, then one key and one value
        qkv = fused.view(batch, tokens, self.num_kv_heads, heads // self.num_kv_heads + 2, dim)
        query, key, value = qkv[:, :, :, :-2].flatten(2, 3), qkv[:, :, :, -2], qkv[:, :, :, -1]
    elif self.multi_query:  # every query head, then one shared key and value
        qkv = fused.view(batch, tokens, heads + 2, dim)
        query, key, value = qkv[:, :, :-2], qkv[:, :, -2:-1], qkv[:, :, -1:]
    else:
        qkv = fused.view(batch, tokens, heads, 3, dim)
        query, key, value = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
    query, key, value = _heads_first(query, key, value)
    if getattr(self, SLOPES_BUFFER, None) is None:  # rotary falcon (alibi=False)
        cos, sin = position_embeddings
        query, key = _family(self).apply_rotary_pos_emb(query, key, cos, sin)
    out, _ = _attention(self)(self, query, key, value, None, scaling=self.inv_norm_factor)
    return self.dense(out.reshape(batch, tokens, heads * dim)), None


def falcon_slopes(module: torch.nn.Module) -> torch.Tensor | None:
    """Falcon's ALiBi slopes (bfloat16-rounded as its bias is), times its ``1/sqrt(head_dim)``; None when rotary."""
    if not module.config.alibi:
        return None
    ones = torch.ones(1, 2, dtype=torch.long)
    return _slopes_of(_family(module).build_alibi_tensor(ones, module.num_heads, torch.float32)) * module.inv_norm_factor


def bloom_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, residual: torch.Tensor, alibi: torch.Tensor,
    attention_mask: Any, layer_past: Any = None, use_cache: bool = False, output_attentions: bool = False,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """BloomAttention's forward on the attention implementation (ALiBi through the slopes buffer)."""
    batch, tokens, _ = hidden_states.shape
    query, key, value = self._reshape(self.query_key_value(hidden_states))  # already heads first
    out, _ = _attention(self)(self, query, key, value, None, scaling=self.inv_norm_factor)
    context = out.reshape(batch, tokens, -1)
    if self.pretraining_tp > 1 and self.slow_but_exact:  # bloom's sliced projection, which adds no bias
        projected = F.linear(context, self.dense.weight)
    else:
        projected = self.dense(context)
    return residual + F.dropout(projected, p=self.hidden_dropout, training=self.training), None


def bloom_slopes(module: torch.nn.Module) -> torch.Tensor:
    ones = torch.ones(1, 2, dtype=torch.long)
    return _slopes_of(_family(module).build_alibi_tensor(ones, module.num_heads, torch.float32))


def mpt_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, position_bias: torch.Tensor | None = None, cache: Any = None,
    attention_mask: Any = None, **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """MptAttention's forward on the attention implementation (ALiBi through the slopes buffer)."""
    batch, tokens = hidden_states.shape[:2]
    mixed = self.Wqkv(hidden_states)
    if self.clip_qkv:
        mixed = mixed.clamp(min=-self.clip_qkv, max=self.clip_qkv)
    query, key, value = (t.reshape(batch, tokens, self.n_heads, self.head_dim) for t in mixed.chunk(3, dim=2))
    query, key, value = _heads_first(query, key, value)
    out, _ = _attention(self)(self, query, key, value, None, scaling=self.softmax_scale)
    return self.out_proj(out.reshape(batch, tokens, -1)), None


def mpt_slopes(module: torch.nn.Module) -> torch.Tensor:
    # MptModel builds its bias with the function's default alibi_bias_max (8), whatever the config says
    return _slopes_of(_family(module).build_mpt_alibi_tensor(module.n_heads, 2))


@dataclasses.dataclass(frozen=True)
class Swap:
    """One attention module class and what replaces its forward."""

    forward: Callable[..., tuple[torch.Tensor, None]]
    #: the module's ALiBi slopes (None: the module uses none)
    slopes: Callable[[torch.nn.Module], torch.Tensor | None]


_FALCON = Swap(falcon_forward, falcon_slopes)
#: Swapped attention classes, by ``module.qualname``.
SWAPS: dict[str, Swap] = {
    "transformers.models.falcon.modeling_falcon.FalconAttention": _FALCON,
    "transformers.models.falcon.modeling_falcon.FalconFlashAttention2": _FALCON,
    "transformers.models.bloom.modeling_bloom.BloomAttention": Swap(bloom_forward, bloom_slopes),
    "transformers.models.mpt.modeling_mpt.MptAttention": Swap(mpt_forward, mpt_slopes),
}


def _key(module: torch.nn.Module) -> str:
    return f"{type(module).__module__}.{type(module).__qualname__}"


def swappable(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The attention modules of ``model`` that :func:`swap` replaces (empty: none)."""
    return [m for m in model.modules() if _key(m) in SWAPS]


def swap(model: torch.nn.Module, implementation: str) -> list[torch.nn.Module]:
    """Give every swappable attention module of ``model`` its paged forward, calling ``implementation``
    (an AttentionInterface name); ALiBi modules get their slopes buffer. Returns the modules."""
    found = swappable(model)
    for module in found:
        spec = SWAPS[_key(module)]
        slopes = spec.slopes(module)
        if slopes is not None:
            device = next(module.parameters()).device
            module.register_buffer(SLOPES_BUFFER, slopes.to(device), persistent=False)
        setattr(module, IMPLEMENTATION_ATTR, implementation)
        module.forward = types.MethodType(spec.forward, module)
    return found


def restore(model: torch.nn.Module) -> None:
    """Undo :func:`swap`: the modules' own forwards again, no slopes buffer."""
    for module in swappable(model):
        module.__dict__.pop("forward", None)
        module.__dict__.pop(IMPLEMENTATION_ATTR, None)
        if hasattr(module, SLOPES_BUFFER):
            delattr(module, SLOPES_BUFFER)


@contextlib.contextmanager
def using(model: torch.nn.Module, implementation: str) -> Iterator[None]:
    """Within: the modules :func:`swap` swapped in ``model`` call ``implementation`` (the probe's); their own after."""
    modules = [m for m in swappable(model) if IMPLEMENTATION_ATTR in m.__dict__]
    before = [getattr(m, IMPLEMENTATION_ATTR) for m in modules]
    try:
        for m in modules:
            setattr(m, IMPLEMENTATION_ATTR, implementation)
        yield
    finally:
        for m, name in zip(modules, before):
            setattr(m, IMPLEMENTATION_ATTR, name)


def unswappable_reason(model: torch.nn.Module, implementation: str) -> str:
    """Why ``model``'s attention can be neither set (AttentionInterface) nor swapped here."""
    return (f"{type(model).__name__} does not route attention through transformers' AttentionInterface, so "
            f"{implementation} cannot replace it")
