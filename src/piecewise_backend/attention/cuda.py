"""The ``varlen`` attention backend: FlashAttention's paged kernel on CUDA, through torch's own varlen API.

``torch.nn.attention.varlen.varlen_attn_out`` takes the cache as a pool of pages with a
``block_table`` and per-sequence lengths ``seqused_k`` read on the device, so the kernel's work
follows each request's real length and one FULL graph serves every context length.

Each query token is passed as its own sequence of one query: its keys are its request's blocks
(``block_table`` row), used up to its own position (``seqused_k = position + 1``), which is
exactly causal masking, for prefill chunks as for decode. Every shape is the step's token count
and ``max_k`` is the static ``max_model_len`` bound: no host read, graph-safe.

Where it runs (:func:`varlen_unavailable`): CUDA, a torch whose ``varlen_attn_out`` takes
``block_table`` (2.13; 2.11 has none), fp16/bf16 caches, head_dim a multiple of 8 up to 256,
and ``block_size`` a multiple of 256 (FlashAttention 2's paged-KV rule in ATen). It carries
sliding windows, not soft-capping, sinks or ALiBi slopes (torch's varlen API takes none): layers that
use those run the next backend (``bounded``, which takes every one of them).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from ..modes import AttentionGraphSupport
from .backends import AttentionBackend, AttentionInputs, register_attention_backend

#: What the kernel call is, replaceable for the CPU twin of the CUDA tests.
Kernel = Callable[..., Any]


def _torch_kernel() -> Kernel | None:
    try:
        from torch.nn.attention import varlen
    except ImportError:
        return None
    fn = getattr(varlen, "varlen_attn_out", None)
    if fn is None or "block_table" not in inspect.signature(fn).parameters:
        return None
    return fn


def varlen_unavailable(device: torch.device, block_size: int, dtype: torch.dtype = torch.bfloat16) -> str | None:
    """Why ``varlen`` cannot serve a cache on ``device`` with ``block_size`` and ``dtype``, or None."""
    if device.type != "cuda":
        return f"it needs a CUDA device, the cache is on {device}"
    if _torch_kernel() is None:
        return (f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn_out with block_table "
                "(torch 2.13 has)")
    if block_size % 256:
        return f"FlashAttention's paged KV needs block_size a multiple of 256, got {block_size}"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"FlashAttention needs a float16 or bfloat16 cache, got {dtype}"
    return None


def varlen_arguments(
    q: torch.Tensor, key_cache: torch.Tensor, meta: AttentionInputs, scale: float, sliding_window: int
) -> dict[str, Any]:
    """The kernel's keyword arguments for one step: one sequence of one query per token."""
    tokens = q.shape[0]
    pos = meta.positions[:tokens]
    seqused_k = (pos + 1).to(torch.int32)
    cu_seq_q = torch.arange(tokens + 1, dtype=torch.int32, device=q.device)
    cu_seq_k = torch.cat([seqused_k.new_zeros(1), seqused_k.cumsum(0, dtype=torch.int32)])
    block_table = meta.block_tables.index_select(0, meta.request_index[:tokens]).to(torch.int32)
    return dict(
        cu_seq_q=cu_seq_q, cu_seq_k=cu_seq_k, max_q=1, max_k=meta.block_tables.shape[1] * key_cache.shape[1],
        scale=scale, window_size=(sliding_window - 1, 0) if sliding_window > 0 else (-1, -1), enable_gqa=True,
        seqused_k=seqused_k, block_table=block_table,
    )


class VarlenAttention:
    """The ``varlen`` backend's function; ``kernel`` defaults to torch's ``varlen_attn_out``."""

    def __init__(self, kernel: Kernel | None = None):
        self.kernel = kernel

    def __call__(
        self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, meta: AttentionInputs, scale: float,
        sliding_window: int, softcap: float, sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        kernel = self.kernel or _torch_kernel()
        if kernel is None:
            reason = varlen_unavailable(q.device, key_cache.shape[1], key_cache.dtype)
            raise RuntimeError(f"attention backend 'varlen': {reason}")
        out = torch.empty(q.shape, dtype=key_cache.dtype, device=q.device)
        q = q.to(key_cache.dtype).contiguous()
        kernel(out, q, key_cache, value_cache, **varlen_arguments(q, key_cache, meta, scale, sliding_window))
        return out


def varlen_accepts(q: torch.Tensor, key_cache: torch.Tensor) -> str | None:
    """Why the kernel cannot take these tensors (dtype, head size), or None."""
    dim = q.shape[-1]
    if key_cache.dtype not in (torch.float16, torch.bfloat16):
        return f"attention backend 'varlen' needs a float16 or bfloat16 cache, got {key_cache.dtype}"
    if dim % 8 or dim > 256:
        return f"attention backend 'varlen' needs head_dim a multiple of 8 up to 256, got {dim}"
    return None


VARLEN = register_attention_backend(
    AttentionBackend(
        "varlen", VarlenAttention(), AttentionGraphSupport.UNIFORM_BATCH, softcap=False, sinks=False,
        available=varlen_unavailable, accepts=varlen_accepts,
        description="FlashAttention paged kernel (torch.nn.attention.varlen, torch 2.13), lengths read on the device",
    )
)
