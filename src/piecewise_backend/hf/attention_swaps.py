"""Attention modules outside transformers' AttentionInterface, swapped at module level onto the paged op.

falcon, bloom, mpt, gpt_neox_japanese, xglm, trocr, mvp and openai-gpt compute attention inside their own
``*Attention.forward`` (with ALiBi for bloom, mpt and falcon's ``alibi=True`` checkpoints), so
setting an attention implementation reaches none of them. :func:`swap` gives each such module a forward of its own that computes q/k/v with the
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
import re
import sys
import types
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from .adapted_state import SLOPES_BUFFER
from .modality import can_set_attention
from .paged_attention import ATTN_IMPLEMENTATION
from .patching import Changes, Swap, class_key, lookup, recorded

if TYPE_CHECKING:
    from .probe_result import ProbeResult

#: The module attribute naming the attention implementation a swapped forward calls.
IMPLEMENTATION_ATTR = "pb_attention"


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


def neox_japanese_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, attention_mask: Any, position_ids: Any = None,
    layer_past: Any = None, use_cache: bool | None = False, output_attentions: bool | None = False,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, **kwargs: Any,
) -> tuple[torch.Tensor, None, torch.Tensor | None]:
    """GPTNeoXJapaneseAttention's forward on the attention implementation: partial RoPE, bias returned apart."""
    batch, tokens, _ = hidden_states.shape
    qkv = self.query_key_value(hidden_states).view(batch, tokens, self.num_attention_heads, 3 * self.head_size)
    query, key, value = _heads_first(*qkv.split(self.head_size, dim=-1))
    rot = self.rotary_ndims
    cos, sin = position_embeddings
    q_rot, k_rot = _family(self).apply_rotary_pos_emb(query[..., :rot], key[..., :rot], cos, sin)
    query, key = torch.cat((q_rot, query[..., rot:]), dim=-1), torch.cat((k_rot, key[..., rot:]), dim=-1)
    out, _ = _attention(self)(self, query, key, value, None, scaling=1.0 / self.norm_factor)
    return self.dense(out.reshape(batch, tokens, -1)), None, self.dense_bias


def xglm_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, key_value_states: torch.Tensor | None = None, cache: Any = None,
    attention_mask: Any = None, **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """XGLMAttention's (and TrOCRAttention's) self-attention on the attention implementation (queries scaled
    first, as both do)."""
    if key_value_states is not None:
        raise ValueError(f"{type(self).__name__} swapped onto the paged attention serves self-attention only, not cross-attention")
    batch, tokens, _ = hidden_states.shape
    shape = (batch, tokens, self.num_heads, self.head_dim)
    query, key, value = _heads_first(
        (self.q_proj(hidden_states) * self.scaling).view(shape), self.k_proj(hidden_states).view(shape),
        self.v_proj(hidden_states).view(shape),
    )
    out, _ = _attention(self)(self, query, key, value, None, scaling=1.0)
    return self.out_proj(out.reshape(batch, tokens, -1)), None


def mvp_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, key_value_states: torch.Tensor | None = None, cache: Any = None,
    attention_mask: Any = None, attn_prompt: torch.Tensor | None = None, **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """MvpAttention's self-attention without prompts: XGLM's layout; a prompt's extra keys are refused."""
    if attn_prompt is not None:
        raise ValueError(
            "MvpAttention with use_prompt=True attends to its prompt's keys and values before the tokens' own, "
            "which the paged cache does not hold"
        )
    return xglm_forward(self, hidden_states, key_value_states, cache, attention_mask, **kwargs)


def openai_gpt_forward(
    self: torch.nn.Module, x: torch.Tensor, attention_mask: Any = None, output_attentions: bool = False,
) -> list[torch.Tensor]:
    """openai-gpt's ``Attention.forward`` on the attention implementation (scaled where the block says so)."""
    batch, tokens, _ = x.shape
    query, key, value = self.c_attn(x).split(self.split_size, dim=2)
    shape = (batch, tokens, self.n_head, self.split_size // self.n_head)
    query, key, value = _heads_first(query.view(shape), key.view(shape), value.view(shape))
    scale = shape[-1] ** -0.5 if self.scale else 1.0
    out, _ = _attention(self)(self, query, key, value, None, scaling=scale)
    return [self.resid_dropout(self.c_proj(out.reshape(batch, tokens, -1)))]


_FALCON = Swap(falcon_forward, slopes=falcon_slopes)
#: Swapped attention classes, by :func:`~.patching.class_key` (``module.qualname``); ``slopes`` gives an
#: ALiBi module's slopes, ``numbered`` numbers the modules of a class without ``layer_idx`` in model order.
SWAPS: dict[str, Swap] = {
    "transformers.models.falcon.modeling_falcon.FalconAttention": _FALCON,
    "transformers.models.falcon.modeling_falcon.FalconFlashAttention2": _FALCON,
    "transformers.models.bloom.modeling_bloom.BloomAttention": Swap(bloom_forward, slopes=bloom_slopes),
    "transformers.models.mpt.modeling_mpt.MptAttention": Swap(mpt_forward, slopes=mpt_slopes),
    "transformers.models.gpt_neox_japanese.modeling_gpt_neox_japanese.GPTNeoXJapaneseAttention": Swap(neox_japanese_forward),
    "transformers.models.xglm.modeling_xglm.XGLMAttention": Swap(xglm_forward),
    "transformers.models.trocr.modeling_trocr.TrOCRAttention": Swap(xglm_forward),  # the same layout
    "transformers.models.mvp.modeling_mvp.MvpAttention": Swap(mvp_forward),
    "transformers.models.openai.modeling_openai.Attention": Swap(openai_gpt_forward, numbered=True),
}


def swappable(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The attention modules of ``model`` that :func:`swap` replaces (empty: none)."""
    return [m for m in model.modules() if class_key(m) in SWAPS]


def swap(model: torch.nn.Module, implementation: str, changes: Changes) -> list[torch.nn.Module]:
    """Give every swappable attention module of ``model`` its paged forward, calling ``implementation``
    (an AttentionInterface name); ALiBi modules get their slopes buffer. Returns the modules; ``changes``
    can undo it all."""
    found = swappable(model)
    for index, module in enumerate(found):
        spec = lookup(SWAPS, module)
        if spec.numbered and getattr(module, "layer_idx", None) is None:
            changes.set(module, "layer_idx", index)
        slopes = spec.slopes(module) if spec.slopes is not None else None
        if slopes is not None:
            changes.buffer(module, SLOPES_BUFFER, slopes.to(next(module.parameters()).device))
        changes.set(module, IMPLEMENTATION_ATTR, implementation)
        changes.set(module, "forward", types.MethodType(spec.forward, module))
    return found


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


class AttentionSwaps:
    """The mechanism that swaps attention modules outside the AttentionInterface onto the paged op
    (:data:`SWAPS`); refuses a model whose attention can be neither set nor swapped."""

    name = "attention swaps"

    def refusal_of(self, model: torch.nn.Module, probed: ProbeResult | None) -> str | None:
        if can_set_attention(model) or swappable(model):
            return None
        return unswappable_reason(model, ATTN_IMPLEMENTATION)

    def install(self, model: torch.nn.Module, probed: ProbeResult | None) -> Callable[[], None]:
        return recorded(swap, model, ATTN_IMPLEMENTATION)


MECHANISM = AttentionSwaps()


#: Module classes that carry a recurrent state from token to token in their own code (rwkv's).
_RECURRENT = re.compile(r"^Rwkv\w*(Attention|FeedForward)$")


def unswappable_reason(model: torch.nn.Module, implementation: str) -> str:
    """Why ``model``'s attention can be neither set (AttentionInterface) nor swapped here.

    Two plain forwards say more where they can (nothing of the model is intercepted): one token
    repeated at one position gives every row the same logits unless the model takes positions from
    the row index (whatever its attention weights, identical keys give identical outputs); a prefix
    whose logits change with a later token means non-causal attention.
    """
    name = type(model).__name__
    what = (f"{name} does not route attention through transformers' AttentionInterface, so {implementation} "
            "cannot replace it")
    recurrent = next((type(m).__name__ for m in model.modules() if _RECURRENT.search(type(m).__name__)), None)
    if recurrent is not None:  # its rows differ by the state they carry, not by position: say that
        return (f"{what}; it keeps recurrent state between tokens in its own code ({recurrent}), which neither "
                "the paged cache nor the state cache can hold")
    try:
        behaviour = _behaviour(model)
    except (RuntimeError, ValueError, TypeError, IndexError, KeyError, AttributeError, NotImplementedError):
        # a forward that needs more than token ids: nothing more to say
        behaviour = None
    if behaviour == "positions":
        return (f"{what}; it also ignores position_ids (its positions come from the sequence length), so the "
                "second request of a step and every decode token would get wrong positions")
    if behaviour == "non-causal":
        return f"{what}; its attention is also non-causal (a prefix's logits change with later tokens)"
    return what + " (and no module-level swap exists for its attention modules)"


def _behaviour(model: torch.nn.Module, tokens: int = 4) -> str | None:
    """``"positions"``, ``"non-causal"`` or None, from plain forwards of ``model`` (see :func:`unswappable_reason`)."""
    device = next(model.parameters()).device
    vocab = model.config.get_text_config().vocab_size
    ids = torch.arange(3, 3 + tokens, device=device).clamp(max=vocab - 1)[None]
    zeros = torch.zeros_like(ids)

    def logits(input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits[0].float()

    same = logits(ids[:, :1].expand(1, tokens), zeros)
    if not torch.allclose(same, same[:1].expand_as(same), rtol=1e-4, atol=1e-5):
        return "positions"
    positions = torch.arange(tokens, device=device)[None]
    changed = ids.clone()
    changed[0, -1] = (changed[0, -1] + 1) % vocab
    if not torch.allclose(logits(ids, positions)[:-1], logits(changed, positions)[:-1], rtol=1e-4, atol=1e-5):
        return "non-causal"
    return None
