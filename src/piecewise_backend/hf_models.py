"""Seeded tiny random-weight Hugging Face causal LMs of any model type (nothing downloaded)."""

from __future__ import annotations

from typing import Any

import torch

#: Sizes of :func:`tiny_random_model`; a config gets only the fields it has (and can set).
TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    num_experts_per_tok=2,
)
#: Shrunk only where the model's default config sets them (None means the feature is off).
TINY_IF_SET = dict(
    # mixture of experts: few small experts (the defaults allocate up to GBs: llama4, qwen3_5_moe, ...)
    num_local_experts=4, num_experts=4, n_routed_experts=4, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, intermediate_size_mlp=128, n_group=2, topk_group=1, first_k_dense_replace=1,
    # multi-head latent attention (deepseek_v2/v3, minicpm3, ...): v's head dim differs from q/k's on purpose
    kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
    # chunked / sliding attention and per-layer inputs sized to the tiny model
    attention_chunk_size=8, sliding_window=8, hidden_size_per_layer_input=16, vocab_size_per_layer_input=256,
    linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
)
# MLA configs expand K/V to every query head (num_key_value_heads = num_attention_heads) and derive
# head_dim from the rope part.
_MLA = ("kv_lora_rank",)


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as e:  # the adapter is an optional extra
        raise ImportError("piecewise_backend.hf needs transformers: pip install 'piecewise_backend[hf]'") from e
    return transformers


def _settable(config: Any, name: str) -> bool:
    """``config`` has ``name`` and it is not a read-only property (falcon's ``head_dim``)."""
    if not hasattr(config, name):
        return False
    prop = getattr(type(config), name, None)
    return not (isinstance(prop, property) and prop.fset is None)


def tiny_random_model(arch: str, *, seed: int = 0, device: torch.device | str = "cpu", **sizes: Any) -> torch.nn.Module:
    """A seeded random-weight causal LM of transformers model type ``arch`` (nothing downloaded).

    ``sizes`` override :data:`TINY`; only fields the model's config has (and can set) are set (GPT-2
    has no ``num_key_value_heads``...). The model uses HF's SDPA attention (eager where a model has no
    SDPA support) and is in eval mode.
    """
    transformers = _transformers()
    if arch not in transformers.CONFIG_MAPPING:
        raise ValueError(f"{arch!r} is not a transformers model type (the keys of transformers.CONFIG_MAPPING, e.g. 'llama')")
    defaults = transformers.AutoConfig.for_model(arch)
    if type(defaults) not in transformers.MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(f"transformers model type {arch!r} has no causal LM class (AutoModelForCausalLM cannot build it)")
    wanted = {**TINY, **sizes}
    if any(hasattr(defaults, k) for k in _MLA):  # K/V expanded to every query head; head_dim derived
        wanted["num_key_value_heads"] = sizes.get("num_key_value_heads", wanted["num_attention_heads"])
        if "head_dim" not in sizes:
            wanted.pop("head_dim")
    optional = {k: v for k, v in TINY_IF_SET.items() if k not in sizes and getattr(defaults, k, None) is not None}
    fields = {k: v for k, v in {**optional, **wanted}.items() if _settable(defaults, k)}
    config = transformers.AutoConfig.for_model(arch, **fields)
    torch.manual_seed(seed)
    try:
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    except ValueError:  # a model without SDPA support (Gemma2...): HF's eager attention
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return model.to(device).eval()
