"""Attention backends of ``pb_kv::paged_attention``: the math over the paged cache, kept apart from its bookkeeping.

The op (:mod:`.kv`) writes the step's K/V, then asks a backend for ``softmax(q k^T * scale) v`` of
each query token over its request's cached keys. A backend is an :class:`AttentionBackend`:
its function, what it supports (sliding window, soft-capping, sinks), how much of a batch a
FULL graph may hold (:class:`~piecewise_backend.AttentionGraphSupport`) and where it is available.

* ``reference`` gathers every token's whole block table (``max_model_len`` keys) in float32 and
  masks: the oracle every other backend is tested against. Cost grows with ``max_model_len``.
* ``bounded`` (the default off CUDA) walks each token's blocks a chunk at a time with a running
  (online) softmax, starting at the first block its sliding window can see. Run eagerly (NONE
  steps, PIECEWISE breaks) it reads on the host how many blocks the step's longest context spans
  and stops there; inside a capture (where the host may not read device values) it walks the
  static bound instead (``max_model_len``, or the window's span), holding one chunk per token.
* ``varlen`` (:mod:`.attention_cuda`) is FlashAttention's paged kernel on CUDA.

A user's own backend is registered with :func:`register_attention_backend` and chosen by name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from .context import _CONTEXT
from .modes import AttentionGraphSupport, CUDAGraphMode
from .platforms.simulated import _RecordingMode


class AttentionInputs(Protocol):
    """What a backend reads: the step's per-token and per-request metadata (``kv.PagedAttentionMetadata``)."""

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    request_index: torch.Tensor
    block_tables: torch.Tensor


#: ``fn(q, key_cache, value_cache, meta, scale, sliding_window, softcap, sinks) -> (tokens, heads, dim)``
AttentionFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, AttentionInputs, float, int, float, "torch.Tensor | None"], torch.Tensor
]


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    """One way to compute paged attention, and what it can do.

    ``available(device, block_size, dtype)`` returns None where the backend can serve a cache of
    that device, block size and dtype, else the reason; ``accepts(q, key_cache)`` the same per
    call (dtypes, head sizes). ``graph_support`` is what a FULL graph may hold with this backend.
    """

    name: str
    fn: AttentionFn
    graph_support: AttentionGraphSupport
    sliding_window: bool = True
    softcap: bool = True
    sinks: bool = True
    available: Callable[[torch.device, int, torch.dtype], str | None] = lambda device, block_size, dtype: None
    accepts: Callable[[torch.Tensor, torch.Tensor], str | None] = lambda q, key_cache: None
    description: str = ""

    def unsupported(self, sliding_window: int, softcap: float, sinks: torch.Tensor | None) -> str | None:
        """Why this backend cannot run a call with these features, or None."""
        missing = [
            what
            for what, used, has in (
                ("sliding windows", sliding_window > 0, self.sliding_window),
                ("logit soft-capping", softcap > 0, self.softcap),
                ("attention sinks", sinks is not None, self.sinks),
            )
            if used and not has
        ]
        return f"attention backend {self.name!r} does not support {' or '.join(missing)}" if missing else None


_BACKENDS: dict[str, AttentionBackend] = {}


def register_attention_backend(backend: AttentionBackend) -> AttentionBackend:
    """Make ``backend`` selectable by name (replacing one of the same name); returns it."""
    if not isinstance(backend, AttentionBackend):
        raise TypeError(f"register_attention_backend takes an AttentionBackend, got {type(backend).__name__}")
    _BACKENDS[backend.name] = backend
    return backend


def attention_backends() -> dict[str, AttentionBackend]:
    """The registered backends by name (a copy)."""
    return dict(_BACKENDS)


def get_attention_backend(name: str) -> AttentionBackend:
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; registered: {sorted(_BACKENDS)}")
    return _BACKENDS[name]


def select_attention_backends(
    name: str, device: torch.device | str, block_size: int, dtype: torch.dtype = torch.float32
) -> tuple[str, ...]:
    """The backends a cache on ``device`` uses, in order of preference: the op runs the first that
    supports a call's features. ``"auto"``: ``varlen`` where it is available (CUDA), then ``bounded``.
    A named backend is used alone, and must be available for a cache of ``block_size`` and ``dtype``."""
    device = torch.device(device)
    if name == "auto":
        preferred = ["varlen"] if device.type == "cuda" else []
        usable = [n for n in preferred if n in _BACKENDS and _BACKENDS[n].available(device, block_size, dtype) is None]
        return (*usable, "bounded")
    reason = get_attention_backend(name).available(device, block_size, dtype)
    if reason is not None:
        raise ValueError(
            f"attention backend {name!r} cannot serve a {dtype} cache on {device} with block_size={block_size}: "
            f"{reason}"
        )
    return (name,)


def capturing(device: torch.device | None = None) -> bool:
    """Whether the current op runs inside a graph capture, where reading device values on the host is
    illegal: the step's runtime mode is FULL, a CUDA stream is capturing (checked for a CUDA
    ``device``), or the simulated platform is recording."""
    ctx = _CONTEXT.get()
    if ctx is not None and ctx.runtime_mode == CUDAGraphMode.FULL:
        return True
    if device is not None and device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return True
    return any(isinstance(m, _RecordingMode) for m in _get_current_dispatch_mode_stack())


def _scores(grouped: torch.Tensor, keys: torch.Tensor, scale: float, softcap: float) -> torch.Tensor:
    scores = torch.einsum("tkgd,tlkd->tkgl", grouped, keys) * scale
    return torch.tanh(scores / softcap) * softcap if softcap > 0 else scores


def attend(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    positions: torch.Tensor,
    request_index: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sliding_window: int = -1,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The reference: causal attention of each query token over its request's cached keys, in float32.

    Gathers every token's whole block table (static shape: ``max_blocks_per_req * block_size``
    keys) and masks keys after the token's position (and outside ``sliding_window`` if > 0).
    ``softcap`` > 0 caps each score to ``tanh(s / softcap) * softcap`` before masking; ``sinks``
    (one logit per query head) joins each head's softmax denominator without a value.
    """
    tokens, q_heads, dim = q.shape
    kv_heads = key_cache.shape[2]
    blocks = block_tables.index_select(0, request_index[:tokens])  # (tokens, max_blocks)
    keys = key_cache[blocks].flatten(1, 2).float()  # (tokens, keys, kv_heads, dim)
    values = value_cache[blocks].flatten(1, 2).float()
    key_pos = torch.arange(keys.shape[1], device=q.device)
    pos = positions[:tokens, None]
    visible = key_pos[None, :] <= pos
    if sliding_window > 0:
        visible = visible & (key_pos[None, :] > pos - sliding_window)
    hidden = ~visible
    # Never multiply a masked-out value: a reused or scratch block may hold anything, NaN included.
    values = values.masked_fill(hidden[:, :, None, None], 0.0)
    grouped = q.reshape(tokens, kv_heads, q_heads // kv_heads, dim).float()
    scores = _scores(grouped, keys, scale, softcap).masked_fill(hidden[:, None, None, :], float("-inf"))
    return torch.einsum("tkgl,tlkd->tkgd", _probs(scores, sinks), values).reshape(tokens, q_heads, dim)


def _probs(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax of masked ``(tokens, kv_heads, group, keys)`` scores, with each head's sink in the denominator."""
    if sinks is None:
        return scores.softmax(-1)
    # The sink is one more logit per head whose value is zero: it only dilutes the others.
    sink = sinks.float().reshape(1, *scores.shape[1:3], 1).expand(scores.shape[0], -1, -1, 1)
    return torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]


def attend_blocks(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    positions: torch.Tensor,
    request_index: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sliding_window: int = -1,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    *,
    num_blocks: int,
    chunk_blocks: int,
) -> torch.Tensor:
    """Attention over ``num_blocks`` blocks per token, ``chunk_blocks`` at a time, with an online softmax.

    Token ``t`` reads blocks ``first[t] .. first[t] + num_blocks - 1`` of its request, where
    ``first[t]`` is the first block its sliding window reaches (0 without a window); keys past
    its position are masked, so any ``num_blocks`` covering the step's longest span is exact.
    Static shapes and no host read: graph-safe. Memory: one chunk per token at a time.
    """
    tokens, q_heads, dim = q.shape
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    group, width = q_heads // kv_heads, block_tables.shape[1]
    pos = positions[:tokens]
    rows = request_index[:tokens, None]
    first = (pos - sliding_window + 1).clamp(min=0) // block_size if sliding_window > 0 else torch.zeros_like(pos)
    grouped = q.reshape(tokens, kv_heads, group, dim).float()
    offsets = torch.arange(block_size, device=q.device)

    def chunk(start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Masked scores and values of blocks ``start .. stop - 1`` of each token's walk."""
        logical = first[:, None] + torch.arange(start, stop, device=q.device)
        blocks = block_tables[rows, logical.clamp(max=width - 1)]  # past the table: masked below (key_pos > pos)
        key_pos = (logical[:, :, None] * block_size + offsets).flatten(1)  # (tokens, chunk keys)
        hidden = key_pos > pos[:, None]
        if sliding_window > 0:
            hidden = hidden | (key_pos <= pos[:, None] - sliding_window)
        keys = key_cache[blocks].flatten(1, 2).float()
        # Never multiply a masked-out value: a reused or scratch block may hold anything, NaN included.
        values = value_cache[blocks].flatten(1, 2).float().masked_fill(hidden[:, :, None, None], 0.0)
        return _scores(grouped, keys, scale, softcap).masked_fill(hidden[:, None, None, :], float("-inf")), values

    if num_blocks <= chunk_blocks:  # one chunk: a plain softmax, fewer ops for a graph to replay
        scores, values = chunk(0, num_blocks)
        return torch.einsum("tkgl,tlkd->tkgd", _probs(scores, sinks), values).reshape(tokens, q_heads, dim)
    peak = torch.full((tokens, kv_heads, group), float("-inf"), device=q.device)
    total = torch.zeros(tokens, kv_heads, group, device=q.device)
    acc = torch.zeros(tokens, kv_heads, group, dim, device=q.device)
    for start in range(0, num_blocks, chunk_blocks):
        scores, values = chunk(start, min(start + chunk_blocks, num_blocks))
        new_peak = torch.maximum(peak, scores.amax(-1))
        shift = new_peak.masked_fill(new_peak == float("-inf"), 0.0)  # no key seen yet: exp(-inf - 0) = 0
        probs = torch.exp(scores - shift[..., None])
        rescale = torch.exp(peak - shift)
        total = total * rescale + probs.sum(-1)
        acc = acc * rescale[..., None] + torch.einsum("tkgl,tlkd->tkgd", probs, values)
        peak = new_peak
    if sinks is not None:  # every token sees its own key, so the peak is finite here
        total = total + torch.exp(sinks.float().reshape(1, kv_heads, group) - peak)
    return (acc / total[..., None]).reshape(tokens, q_heads, dim)


@dataclasses.dataclass(frozen=True)
class BoundedAttention:
    """The ``bounded`` backend's function: exact span eagerly, static span in chunks under capture.

    ``eager_chunk_keys`` and ``graph_chunk_keys`` (rounded down to whole blocks, at least one)
    bound how many keys per token one chunk gathers.
    """

    eager_chunk_keys: int = 1024
    graph_chunk_keys: int = 256

    def __call__(
        self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, meta: AttentionInputs, scale: float,
        sliding_window: int, softcap: float, sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        block_size, tables = key_cache.shape[1], meta.block_tables
        width = tables.shape[1]
        if q.shape[0] == 0:  # nothing to attend (and no longest context to read)
            return torch.zeros(q.shape, device=q.device)
        if capturing(q.device):
            span = width if sliding_window <= 0 else min(width, (sliding_window + block_size - 2) // block_size + 1)
            chunk = self.graph_chunk_keys
        else:  # eager: the host may read how far the step's longest context reaches (one device-to-host copy)
            pos = meta.positions[: q.shape[0]]
            last = pos // block_size
            first = torch.zeros_like(pos)
            if sliding_window > 0:
                first = (pos - sliding_window + 1).clamp(min=0) // block_size
            needed, span = (int(n) for n in torch.stack([last.max(), (last - first).max()]).cpu() + 1)
            tables = tables[:, : min(width, needed)]  # later columns are past every token's position
            chunk = self.eager_chunk_keys
        return attend_blocks(
            q, key_cache, value_cache, meta.positions, meta.request_index, tables, scale, sliding_window,
            softcap, sinks, num_blocks=span, chunk_blocks=max(1, chunk // block_size),
        )


def _reference(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, meta: AttentionInputs, scale: float,
    sliding_window: int, softcap: float, sinks: torch.Tensor | None,
) -> torch.Tensor:
    return attend(
        q, key_cache, value_cache, meta.positions, meta.request_index, meta.block_tables, scale, sliding_window,
        softcap, sinks,
    )


def describe(backends: tuple[str, ...]) -> str:
    """``"varlen (then bounded)"``: the names a cache uses, in order."""
    return backends[0] + (f" (then {', '.join(backends[1:])})" if len(backends) > 1 else "")


def _builtins() -> list[AttentionBackend]:
    return [
        AttentionBackend(
            "reference", _reference, AttentionGraphSupport.ALWAYS,
            description="whole block table per token in float32, masked: the oracle; cost grows with max_model_len",
        ),
        AttentionBackend(
            "bounded", BoundedAttention(), AttentionGraphSupport.ALWAYS,
            description="the blocks in use (eager) or the static bound a chunk at a time (captured), online softmax",
        ),
    ]


for _backend in _builtins():
    register_attention_backend(_backend)


def run_attention(backends: tuple[str, ...], *args: Any) -> torch.Tensor:
    """Run the first of ``backends`` that supports the call's features (``args`` as :data:`AttentionFn`)."""
    q, key_cache, sliding_window, softcap, sinks = args[0], args[1], args[5], args[6], args[7]
    reasons = []
    for name in backends:
        backend = get_attention_backend(name)
        reason = backend.unsupported(sliding_window, softcap, sinks) or backend.accepts(q, key_cache)
        if reason is None:
            return backend.fn(*args)
        reasons.append(reason)
    raise ValueError(
        f"pb_kv::paged_attention: no attention backend of {list(backends)} can run this call: {'; '.join(reasons)}"
    )
