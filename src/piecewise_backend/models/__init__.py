"""Toy models for examples, tests and benchmarks: a Llama-like decoder, an expert-parallel MoE, their sharding."""

from .moe import Attention, MoE, ToyMoE, rms_norm
from .sharding import ToyMLP, make_kv_caches, shard_mlp, shard_toy_llama
from .toy_llama import (
    ATTENTION_KINDS,
    AttnMetadata,
    DecoderLayer,
    RMSNorm,
    ToyConfig,
    ToyLlama,
    attention,
    attention_break,
    attention_fresh,
    make_model,
)

__all__ = [
    "attention",
    "attention_break",
    "attention_fresh",
    "ATTENTION_KINDS",
    "AttnMetadata",
    "DecoderLayer",
    "make_model",
    "RMSNorm",
    "ToyConfig",
    "ToyLlama",
    "Attention",
    "MoE",
    "rms_norm",
    "ToyMoE",
    "make_kv_caches",
    "shard_mlp",
    "shard_toy_llama",
    "ToyMLP",
]
