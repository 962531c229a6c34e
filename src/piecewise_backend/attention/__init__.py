"""Attention backends (a registry chosen per step), their kernels, and the CUDA varlen kernel."""

from .backends import (
    AttentionBackend,
    AttentionFn,
    AttentionInputs,
    BoundedAttention,
    attention_backends,
    capturing,
    describe,
    get_attention_backend,
    register_attention_backend,
    run_attention,
    select_attention_backends,
)
from .cuda import VARLEN, Kernel, VarlenAttention, varlen_accepts, varlen_arguments, varlen_unavailable
from .kernels import attend, attend_blocks, visible_start

__all__ = [
    "attention_backends",
    "AttentionBackend",
    "AttentionFn",
    "AttentionInputs",
    "BoundedAttention",
    "capturing",
    "describe",
    "get_attention_backend",
    "register_attention_backend",
    "run_attention",
    "select_attention_backends",
    "attend",
    "attend_blocks",
    "visible_start",
    "Kernel",
    "VARLEN",
    "varlen_accepts",
    "varlen_arguments",
    "varlen_unavailable",
    "VarlenAttention",
]
