"""Attention backends of ``pb_kv::paged_attention``: the math over the paged cache, kept apart from its bookkeeping.

The op (:mod:`.kv`) writes the step's K/V, then asks a backend for ``softmax(q k^T * scale) v`` of
each query token over its request's cached keys. A backend is an :class:`AttentionBackend`:
its function, what it supports (sliding window, soft-capping, sinks, chunked attention, ALiBi), how much of a batch a
FULL graph may hold (:class:`~piecewise_backend.AttentionGraphSupport`) and where it is available.

* ``reference`` gathers every token's whole block table (``max_model_len`` keys) in float32 and
  masks: the oracle every other backend is tested against. Cost grows with ``max_model_len``.
* ``bounded`` (the default off CUDA) walks each token's blocks a chunk at a time with a running
  (online) softmax, starting at the first block its sliding window can see. Run eagerly (NONE
  steps, PIECEWISE breaks) it reads on the host how many blocks the step's longest context spans
  and stops there; inside a capture (where the host may not read device values) it walks the
  static bound instead (``max_model_len``, or the window's span), holding one chunk per token.
* ``varlen`` (:mod:`.cuda`) is FlashAttention's paged kernel on CUDA.

A user's own backend is registered with :func:`register_attention_backend` and chosen by name.
This module holds the registry, the choice and the ``bounded``/``reference`` functions; their math
(:func:`attend`, :func:`attend_blocks`, re-exported here) is in :mod:`.kernels`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import torch

from ..context import current_forward_context
from ..modes import AttentionGraphSupport, CUDAGraphMode
from ..platforms.simulated.platform import is_recording
from .kernels import attend, attend_blocks, visible_start


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
    chunked: bool = False  # takes ``chunk_size=`` (llama4's chunked attention) as a keyword
    alibi: bool = False  # takes ``alibi_slopes=`` (bloom/mpt/falcon's ALiBi bias) as a keyword
    available: Callable[[torch.device, int, torch.dtype], str | None] = lambda device, block_size, dtype: None
    accepts: Callable[[torch.Tensor, torch.Tensor], str | None] = lambda q, key_cache: None
    description: str = ""

    def unsupported(
        self, sliding_window: int, softcap: float, sinks: torch.Tensor | None, chunk_size: int = 0,
        alibi_slopes: torch.Tensor | None = None,
    ) -> str | None:
        """Why this backend cannot run a call with these features, or None."""
        missing = [
            what
            for what, used, has in (
                ("sliding windows", sliding_window > 0, self.sliding_window),
                ("logit soft-capping", softcap > 0, self.softcap),
                ("attention sinks", sinks is not None, self.sinks),
                ("chunked attention", chunk_size > 0, self.chunked),
                ("ALiBi slopes", alibi_slopes is not None, self.alibi),
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
    ctx = current_forward_context()
    if ctx is not None and ctx.runtime_mode == CUDAGraphMode.FULL:
        return True
    if device is not None and device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return True
    return is_recording()


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
        sliding_window: int, softcap: float, sinks: torch.Tensor | None, *, chunk_size: int = 0,
        alibi_slopes: torch.Tensor | None = None,
    ) -> torch.Tensor:
        block_size, tables = key_cache.shape[1], meta.block_tables
        width = tables.shape[1]
        if q.shape[0] == 0:  # nothing to attend (and no longest context to read)
            return torch.zeros(q.shape, device=q.device)
        if capturing(q.device):
            span = width
            for reach in (sliding_window, chunk_size):  # a token sees at most this many keys
                if reach > 0:
                    span = min(span, (reach + block_size - 2) // block_size + 1)
            chunk = self.graph_chunk_keys
        else:  # eager: the host may read how far the step's longest context reaches (one device-to-host copy)
            pos = meta.positions[: q.shape[0]]
            last = pos // block_size
            first = visible_start(pos, sliding_window, chunk_size) // block_size
            needed, span = (int(n) for n in torch.stack([last.max(), (last - first).max()]).cpu() + 1)
            tables = tables[:, : min(width, needed)]  # later columns are past every token's position
            chunk = self.eager_chunk_keys
        return attend_blocks(
            q, key_cache, value_cache, meta.positions, meta.request_index, tables, scale, sliding_window,
            softcap, sinks, num_blocks=span, chunk_blocks=max(1, chunk // block_size), chunk_size=chunk_size,
            alibi_slopes=alibi_slopes,
        )


def _reference(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, meta: AttentionInputs, scale: float,
    sliding_window: int, softcap: float, sinks: torch.Tensor | None, *, chunk_size: int = 0,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    return attend(
        q, key_cache, value_cache, meta.positions, meta.request_index, meta.block_tables, scale, sliding_window,
        softcap, sinks, chunk_size, alibi_slopes,
    )


def describe(backends: tuple[str, ...]) -> str:
    """``"varlen (then bounded)"``: the names a cache uses, in order."""
    return backends[0] + (f" (then {', '.join(backends[1:])})" if len(backends) > 1 else "")


def _builtins() -> list[AttentionBackend]:
    return [
        AttentionBackend(
            "reference", _reference, AttentionGraphSupport.ALWAYS, chunked=True, alibi=True,
            description="whole block table per token in float32, masked: the oracle; cost grows with max_model_len",
        ),
        AttentionBackend(
            "bounded", BoundedAttention(), AttentionGraphSupport.ALWAYS, chunked=True, alibi=True,
            description="the blocks in use (eager) or the static bound a chunk at a time (captured), online softmax",
        ),
    ]


for _backend in _builtins():
    register_attention_backend(_backend)


def run_attention(
    backends: tuple[str, ...], *args: Any, chunk_size: int = 0, alibi_slopes: torch.Tensor | None = None
) -> torch.Tensor:
    """Run the first of ``backends`` that supports the call's features (``args`` as :data:`AttentionFn`;
    ``chunk_size`` > 0 goes, as a keyword, only to backends that declare ``chunked``, ``alibi_slopes``
    only to those that declare ``alibi``)."""
    q, key_cache, sliding_window, softcap, sinks = args[0], args[1], args[5], args[6], args[7]
    keywords: dict[str, Any] = {}
    if chunk_size > 0:
        keywords["chunk_size"] = chunk_size
    if alibi_slopes is not None:
        keywords["alibi_slopes"] = alibi_slopes
    reasons = []
    for name in backends:
        backend = get_attention_backend(name)
        reason = backend.unsupported(sliding_window, softcap, sinks, chunk_size, alibi_slopes) or backend.accepts(q, key_cache)
        if reason is None:
            return backend.fn(*args, **keywords)
        reasons.append(reason)
    raise ValueError(
        f"pb_kv::paged_attention: no attention backend of {list(backends)} can run this call: {'; '.join(reasons)}"
    )
