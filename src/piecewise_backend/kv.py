"""Paged KV cache and the paged attention op, graph-safe on any device.

* :class:`BlockAllocator` hands out fixed-size KV blocks; :class:`PagedKVCache` owns the per-layer
  K/V tensors and each request's block table, and turns a step's scheduled tokens into the
  per-token and per-request metadata tensors a :class:`~piecewise_backend.GraphRunner` keeps in
  persistent buffers (:meth:`PagedKVCache.static_inputs`, :meth:`PagedKVCache.step_inputs`).
* ``pb_kv::paged_attention`` writes the step's K/V into the cache and attends each token to its
  request's cached prefix with the cache's attention backends (:mod:`.attention`: ``bounded`` on
  the CPU, ``varlen`` on CUDA where torch has it, ``reference`` on request). It runs inside a FULL
  graph (uniform decode) as well as eagerly at a break (mixed batches); it is registered as a
  splitting op on import.

The op reads its metadata from the forward context (``attn_metadata``). Under a CUDA graph its
kernels keep the addresses they read at capture, so that metadata must be views of the runner's
persistent buffers (what :meth:`PagedKVCache.context_fn` builds from the runner's views), updated
in place every step: never tensors built per step.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch

from . import attention_cuda  # noqa: F401  (registers the varlen backend)
from .attention import attend  # noqa: F401  (the reference, documented here before attention.py existed)
from .attention import describe, get_attention_backend, run_attention, select_attention_backends
from .context import _CONTEXT
from .modes import AttentionGraphSupport
from .ops import register_splitting_op
from .runner import StaticInput

#: Slot of a padding token: its K/V go to the scratch block and are never read.
PAD_SLOT = -1
#: Names of the metadata inputs the cache adds to a runner (besides the model's own inputs).
POSITIONS, SLOT_MAPPING, REQUEST_INDEX, BLOCK_TABLES = "position_ids", "slot_mapping", "request_index", "block_tables"


class BlockAllocator:
    """A free list of ``num_blocks`` KV blocks (host side, O(1) per block)."""

    def __init__(self, num_blocks: int):
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"BlockAllocator.num_blocks must be a positive int, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"out of KV blocks: {n} needed, {len(self._free)} of {self.num_blocks} free")
        return [self._free.popleft() for _ in range(n)]

    def free(self, blocks: Sequence[int]) -> None:
        self._free.extend(blocks)


@dataclasses.dataclass
class PagedAttentionMetadata:
    """One step's attention inputs: views of the runner's persistent buffers, and the cache tensors.

    Only tensors and lists of tensors (no cache object): a graph keeps what it read at capture,
    and the runner refuses context objects whose state it cannot see.
    """

    positions: torch.Tensor  # (tokens,) long: position of each token in its request
    slot_mapping: torch.Tensor  # (tokens,) long: cache slot to write each token's K/V to, PAD_SLOT for padding
    request_index: torch.Tensor  # (tokens,) long: row of ``block_tables`` of each token's request
    block_tables: torch.Tensor  # (requests, max_blocks_per_req) long: blocks of each request, 0-padded
    key_caches: list[torch.Tensor]  # per layer, PagedKVCache.key_caches
    value_caches: list[torch.Tensor]
    attention_backends: tuple[str, ...] = ("bounded",)  # names, in order: the op runs the first that can


class PagedKVCache:
    """Per-layer K/V tensors of shape ``(num_blocks + 1, block_size, num_kv_heads, head_dim)``.

    Block ``num_blocks`` (the last) is scratch: padding tokens write there, and no block table
    points to it. Requests are any hashable ids; each owns a block table grown on demand.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        num_blocks: int,
        block_size: int = 16,
        max_model_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        attention_backend: str = "auto",
    ):
        for name, value in dict(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                block_size=block_size, max_model_len=max_model_len).items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"PagedKVCache.{name} must be a positive int, got {value!r}")
        self.allocator = BlockAllocator(num_blocks)
        self.block_size = block_size
        self.max_blocks_per_req = math.ceil(max_model_len / block_size)
        self.max_model_len = max_model_len
        shape = (num_blocks + 1, block_size, num_kv_heads, head_dim)
        self.key_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.value_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.tables: dict[Hashable, list[int]] = {}
        #: The attention backends the op runs for this cache, in order (see :mod:`.attention`).
        self.attention_backends = select_attention_backends(attention_backend, device, block_size, dtype)

    @property
    def attention_backend(self) -> str:
        """The attention backend(s) in words, e.g. ``"varlen (then bounded)"``."""
        return describe(self.attention_backends)

    @property
    def attention_graph_support(self) -> AttentionGraphSupport:
        """What a FULL graph may hold: the least of this cache's backends (any layer may fall back)."""
        return min(get_attention_backend(n).graph_support for n in self.attention_backends)

    @property
    def device(self) -> torch.device:
        return self.key_caches[0].device

    def reserve(self, request: Hashable, num_tokens: int) -> None:
        """Grow ``request``'s block table to hold ``num_tokens`` tokens (allocating on first use)."""
        if num_tokens > self.max_model_len:
            raise ValueError(f"request {request!r} needs {num_tokens} tokens, more than max_model_len={self.max_model_len}")
        table = self.tables.setdefault(request, [])
        missing = math.ceil(num_tokens / self.block_size) - len(table)
        if missing > 0:
            table += self.allocator.allocate(missing)

    def free(self, request: Hashable) -> None:
        """Return ``request``'s blocks; KeyError naming the live requests when it has none."""
        if request not in self.tables:
            raise KeyError(f"request {request!r} holds no KV blocks; live requests: {list(self.tables)}")
        self.allocator.free(self.tables.pop(request))

    def slot(self, request: Hashable, position: int) -> int:
        """Flat cache slot (block * block_size + offset) of ``request``'s token at ``position``."""
        table = self.tables[request]
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def static_inputs(self) -> list[StaticInput]:
        """The metadata inputs for a GraphRunner, with pads that never touch a real request.

        Padding tokens write K/V to the scratch slot and read (and discard) request row 0.
        """
        return [
            StaticInput(POSITIONS, pad=0),
            StaticInput(SLOT_MAPPING, pad=PAD_SLOT),
            StaticInput(REQUEST_INDEX, pad=0),
            StaticInput(BLOCK_TABLES, shape=(self.max_blocks_per_req,), pad=0, per="request"),
        ]

    def step_inputs(self, chunks: Sequence[tuple[Hashable, int, int]]) -> dict[str, torch.Tensor]:
        """Metadata of one step from ``(request, first position, number of tokens)`` per scheduled request.

        Tokens are laid out request after request, in ``chunks`` order; blocks are reserved as needed.
        """
        requests = [c[0] for c in chunks]
        if not requests or len(set(requests)) != len(requests):
            raise ValueError(f"a step needs one chunk per scheduled request, at least one; got requests {requests}")
        positions: list[int] = []
        slots: list[int] = []
        request_index: list[int] = []
        rows: list[list[int]] = []
        for row, (request, start, count) in enumerate(chunks):
            if start < 0 or count < 1:
                raise ValueError(f"request {request!r}: need start >= 0 and count >= 1, got start={start}, count={count}")
            self.reserve(request, start + count)
            positions += range(start, start + count)
            slots += (self.slot(request, p) for p in range(start, start + count))
            request_index += [row] * count
            table = self.tables[request]
            rows.append(table + [0] * (self.max_blocks_per_req - len(table)))
        t = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)  # noqa: E731
        return {POSITIONS: t(positions), SLOT_MAPPING: t(slots), REQUEST_INDEX: t(request_index), BLOCK_TABLES: t(rows)}

    def metadata(self, views: Mapping[str, torch.Tensor]) -> PagedAttentionMetadata:
        """The attention metadata over ``views`` (a runner's views, or :meth:`step_inputs` for eager use)."""
        return PagedAttentionMetadata(
            views[POSITIONS], views[SLOT_MAPPING], views[REQUEST_INDEX], views[BLOCK_TABLES], self.key_caches,
            self.value_caches, self.attention_backends,
        )

    def context_fn(self, views: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """A GraphRunner ``context_fn``: the step's forward-context attributes."""
        return {"attn_metadata": self.metadata(views)}


def write_kv(k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store ``k``/``v`` (tokens, kv_heads, head_dim) at their slots; PAD_SLOT rows go to the scratch block."""
    blocks, block_size, heads, dim = key_cache.shape
    slots = slot_mapping[: k.shape[0]]
    slots = torch.where(slots >= 0, slots, (blocks - 1) * block_size)
    key_cache.view(-1, heads, dim).index_copy_(0, slots, k.to(key_cache.dtype))
    value_cache.view(-1, heads, dim).index_copy_(0, slots, v.to(value_cache.dtype))


def current_metadata() -> PagedAttentionMetadata:
    ctx = _CONTEXT.get()
    meta = getattr(ctx, "attn_metadata", None)
    if not isinstance(meta, PagedAttentionMetadata):
        raise RuntimeError(
            "pb_kv::paged_attention needs a PagedAttentionMetadata as `attn_metadata` in the forward context "
            f"(got {type(meta).__name__}); run the model through a GraphRunner with "
            "context_fn=cache.context_fn, or under pb.set_forward_context(attn_metadata=cache.metadata(...))"
        )
    return meta


@torch.library.custom_op("pb_kv::paged_attention", mutates_args=("out",))
def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    layer: int,
    scale: float,
    sliding_window: int,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> None:
    """Write ``k``/``v`` of layer ``layer`` into the cache, then ``out = attention(q, cached prefix)``.

    ``q``/``out``: (tokens, heads, head_dim); ``k``/``v``: (tokens, kv_heads, head_dim).
    ``softcap`` > 0 soft-caps the scores (``tanh(s / softcap) * softcap``, gemma2-style); ``sinks``
    (``(heads,)``, gpt-oss-style) is a per-head logit added to the softmax denominator only.
    """
    meta = current_metadata()
    if not 0 <= layer < len(meta.key_caches):
        raise ValueError(f"pb_kv::paged_attention: layer {layer} out of range; the cache has {len(meta.key_caches)} layers")
    key_cache, value_cache = meta.key_caches[layer], meta.value_caches[layer]
    if k.shape[1:] != key_cache.shape[2:] or q.shape[1] % k.shape[1]:
        raise ValueError(
            f"pb_kv::paged_attention: k has (kv_heads, head_dim) {tuple(k.shape[1:])}, the cache holds "
            f"{tuple(key_cache.shape[2:])}; q has {q.shape[1]} heads (must be a multiple of kv_heads)"
        )
    if meta.slot_mapping.shape[0] < q.shape[0]:
        raise ValueError(f"pb_kv::paged_attention: {q.shape[0]} tokens but metadata for {meta.slot_mapping.shape[0]}")
    if softcap < 0 or not math.isfinite(softcap):
        raise ValueError(f"pb_kv::paged_attention: softcap must be a finite float >= 0 (0 = off), got {softcap}")
    if sinks is not None and sinks.shape != (q.shape[1],):
        raise ValueError(
            f"pb_kv::paged_attention: sinks must hold one logit per query head, shape ({q.shape[1]},); "
            f"got {tuple(sinks.shape)}"
        )
    write_kv(k, v, key_cache, value_cache, meta.slot_mapping)
    backends = meta.attention_backends
    result = run_attention(backends, q, key_cache, value_cache, meta, scale, sliding_window, softcap, sinks)
    out.copy_(result)


register_splitting_op(paged_attention)
