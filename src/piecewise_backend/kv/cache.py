"""Paged KV cache: the blocks, each request's block table, and the step metadata a runner keeps.

* :class:`BlockAllocator` hands out fixed-size KV blocks; :class:`PagedKVCache` owns the per-layer
  K/V tensors and each request's block table, and turns a step's scheduled tokens into the
  per-token and per-request metadata tensors a :class:`~piecewise_backend.GraphRunner` keeps in
  persistent buffers (:meth:`PagedKVCache.static_inputs`, :meth:`PagedKVCache.step_inputs`).
* Prefix caching (:mod:`.prefix_cache`): full prompt blocks may be shared by several tables
  (reference-counted); :meth:`PagedKVCache.attach` starts a table with cached blocks,
  :meth:`PagedKVCache.register` caches a table's blocks once their K/V is written, and cached blocks no
  table holds count as free and are evicted, least recently used first, when blocks run out.
* ``pb_kv::paged_attention`` (:mod:`.kv_op`, re-exported here with its metadata, ``write_kv`` and
  ``current_metadata``) writes the step's K/V into the cache and attends each token to its
  request's cached prefix with the cache's attention backends (:mod:`.attention`: ``bounded`` on
  the CPU, ``varlen`` on CUDA where torch has it, ``reference`` on request). It runs inside a FULL
  graph (uniform decode) as well as eagerly at a break (mixed batches); importing this module
  registers it as a splitting op.

The op reads its metadata from the forward context (``attn_metadata``). Under a CUDA graph its
kernels keep the addresses they read at capture, so that metadata must be views of the runner's
persistent buffers (what :meth:`PagedKVCache.context_fn` builds from the runner's views), updated
in place every step: never tensors built per step.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ..attention.backends import (
    describe,
    get_attention_backend,
    select_attention_backends,
)
from ..modes import AttentionGraphSupport
from ..runner.graph_runner import StaticInput
from .prefix_cache import ROOT, PrefixCache
from .op import PAD_SLOT, PagedAttentionMetadata, current_metadata, paged_attention, write_kv  # noqa: F401

#: Names of the metadata inputs the cache adds to a runner (besides the model's own inputs).
POSITIONS, SLOT_MAPPING, REQUEST_INDEX, BLOCK_TABLES = "position_ids", "slot_mapping", "request_index", "block_tables"


class BlockAllocator:
    """A free list of ``num_blocks`` KV blocks (host side, O(1) per block).

    Exact: every id is either free or handed out, never both; :meth:`free` refuses an id that
    is not handed out (a double free, or an id this allocator never had), since taking it back
    would let one block serve two requests.
    """

    def __init__(self, num_blocks: int):
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
            raise ValueError(f"BlockAllocator.num_blocks must be a positive int, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"BlockAllocator.allocate takes a block count >= 0, got {n!r}")
        if n > len(self._free):
            raise RuntimeError(f"out of KV blocks: {n} needed, {len(self._free)} of {self.num_blocks} free")
        blocks = [self._free.popleft() for _ in range(n)]
        self._used.update(blocks)
        return blocks

    def free(self, blocks: Sequence[int]) -> None:
        """Take ``blocks`` back; all or nothing: ValueError, freeing none, if one is not handed out."""
        blocks = list(blocks)
        seen: set[int] = set()
        for b in blocks:
            is_id = isinstance(b, int) and not isinstance(b, bool)  # 1.0 and True hash like 1: check the type too
            if b in seen or not is_id or b not in self._used:
                why = "given twice in this call" if b in seen else (
                    "already free (double free)" if is_id and 0 <= b < self.num_blocks
                    else f"not a block id of this allocator (0..{self.num_blocks - 1})"
                )
                raise ValueError(f"BlockAllocator.free: block {b!r} is {why}; only ids allocate() handed out can be freed")
            seen.add(b)
        self._used.difference_update(blocks)
        self._free.extend(blocks)


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
        indexer_dim: int = 0,
    ):
        if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers < 0:
            raise ValueError(f"PagedKVCache.num_layers must be an int >= 0 (0: a model without attention), got {num_layers!r}")
        for name, value in dict(num_kv_heads=num_kv_heads, head_dim=head_dim,
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
        if not isinstance(indexer_dim, int) or isinstance(indexer_dim, bool) or indexer_dim < 0:
            raise ValueError(f"PagedKVCache.indexer_dim must be an int >= 0 (0: no indexed attention), got {indexer_dim!r}")
        #: per layer, one indexer key per token at its K/V slot (indexed attention, :mod:`.indexed`); empty when 0
        self.indexer_caches = [
            torch.zeros(shape[:2] + (indexer_dim,), dtype=dtype, device=device) for _ in range(num_layers if indexer_dim else 0)
        ]
        self.tables: dict[Hashable, list[int]] = {}
        #: the cached (shareable) blocks, their references and the evictable ones (:mod:`.prefix_cache`)
        self.prefix = PrefixCache(block_size)
        self._device = torch.device(device)
        self._noting: tuple[_NotingList, _NotingList] | None = None  # while the layers are checked (check_layers)
        # A host mirror of the block tables, one zero-padded row per request with a table: a step's
        # block tables are one gather of its requests' rows, not a nested list turned into a tensor.
        self._rows: dict[Hashable, int] = {}
        self._free_rows: list[int] = []
        self._mirror = np.zeros((0, self.max_blocks_per_req), dtype=np.int64)
        self._stage = _Stage(self._device)
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
        return self._device

    @property
    def memory_bytes(self) -> int:
        """Bytes of the K, V (and indexer key) tensors of every layer (the scratch block included)."""
        return sum(t.numel() * t.element_size() for t in (*self.key_caches, *self.value_caches, *self.indexer_caches))

    def reserve(self, request: Hashable, num_tokens: int) -> None:
        """Grow ``request``'s block table to hold ``num_tokens`` tokens (allocating on first use).

        All or nothing: when blocks run out nothing is allocated and the table is left as it was.
        """
        if request in self.tables and self._missing(request, num_tokens) == 0:  # a decode step's usual case
            return
        self._reserve_all([(request, num_tokens)])

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds: never used ones and cached ones no table references (evictable)."""
        return self.allocator.num_free + self.prefix.num_evictable

    @property
    def total_blocks(self) -> int:
        """Blocks of the cache in all."""
        return self.allocator.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks a request of ``num_tokens`` tokens holds."""
        return math.ceil(num_tokens / self.block_size)

    def blocks_needed(self, request: Hashable, num_tokens: int) -> int:
        """Blocks ``request`` must still get to hold ``num_tokens`` tokens (0 when it holds them;
        a scheduler compares it with :attr:`num_free_blocks` before a step, to preempt in time)."""
        return self._missing(request, num_tokens)

    def _missing(self, request: Hashable, num_tokens: int) -> int:
        if type(num_tokens) is not int or not 0 <= num_tokens <= self.max_model_len:  # one test on the hot path
            if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 0:
                raise ValueError(f"request {request!r}: num_tokens must be an int >= 0, got {num_tokens!r}")
            if num_tokens > self.max_model_len:
                raise ValueError(
                    f"request {request!r} needs {num_tokens} tokens, more than max_model_len={self.max_model_len}"
                )
        table = self.tables.get(request)
        missing = -(-num_tokens // self.block_size) - (0 if table is None else len(table))
        return missing if missing > 0 else 0

    def _reserve_all(self, needs: Sequence[tuple[Hashable, int]]) -> None:
        """Reserve every ``(request, num_tokens)`` or, raising, none (checked before allocating)."""
        missing = [self._missing(r, n) for r, n in needs]
        if sum(missing) > self.num_free_blocks:
            per = ", ".join(f"{r!r}: {m}" for (r, _), m in zip(needs, missing) if m)
            raise RuntimeError(
                f"out of KV blocks: {sum(missing)} needed ({per}), {self.num_free_blocks} of "
                f"{self.allocator.num_blocks} free; nothing was reserved"
            )
        for (request, _), m in zip(needs, missing):
            table = self.tables.get(request)
            if table is None:
                table = self.tables[request] = []
                self._rows[request] = self._new_row()
            if m:
                blocks = self._take(m)
                self._mirror[self._rows[request], len(table):len(table) + m] = blocks
                table.extend(blocks)

    def _take(self, n: int) -> list[int]:
        """``n`` blocks: never used ones first, then cached ones no table holds, least recently used first."""
        fresh = min(n, self.allocator.num_free)
        blocks = self.allocator.allocate(fresh)
        blocks.extend(self.prefix.evict() for _ in range(n - fresh))
        return blocks

    def _release(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each of ``blocks``: a block no other table holds is freed, or kept cached.
        Last block first: a chain's tail is evicted before its head, which more prompts share."""
        self.allocator.free([b for b in reversed(blocks) if self.prefix.release(b)])

    def attach(self, request: Hashable, blocks: Sequence[int]) -> None:
        """Start ``request``'s block table with cached ``blocks`` (:meth:`match`), one more reference each."""
        if request in self.tables:
            raise ValueError(f"attach: request {request!r} holds KV blocks already; cached blocks start a new table")
        self.prefix.acquire(blocks)
        table = self.tables[request] = list(blocks)
        row = self._rows[request] = self._new_row()
        self._mirror[row, :len(table)] = table

    def match(self, keys: Sequence[bytes], tokens: Sequence[int], limit: int) -> list[int]:
        """The cached blocks of the longest cached prefix of ``tokens`` (``keys``: their
        :func:`~.prefix_cache.block_keys`), at most ``limit``; :meth:`attach` takes them."""
        return self.prefix.match(keys, tokens, limit)

    def blocks_to_attach(self, blocks: Sequence[int]) -> int:
        """Free blocks attaching ``blocks`` uses up (the cached ones no table holds now)."""
        return self.prefix.evictable_among(blocks)

    def register(self, request: Hashable, keys: Sequence[bytes], first: int, end: int, tokens: Sequence[int]) -> int:
        """Cache ``request``'s blocks ``first .. end - 1`` (their K/V written) under ``keys[first:end]`` (``keys``:
        :func:`~.prefix_cache.block_keys` of ``tokens``, the prompt); returns how many were cached (a key
        cached already keeps its own block, this one stays the request's)."""
        table, bs = self.tables[request], self.block_size
        done = 0
        for i in range(first, end):
            parent = keys[i - 1] if i else ROOT
            done += self.prefix.register(table[i], keys[i], parent, tokens[i * bs:(i + 1) * bs])
        return done

    def reset_prefix_cache(self) -> int:
        """Uncache every block: those no table holds are freed (returned as a count); those in use stay with
        their tables until released (after a weight update the cached K/V would be stale)."""
        free = self.prefix.reset()
        self.allocator.free(free)
        return len(free)

    def _new_row(self) -> int:
        if not self._free_rows:  # grow the mirror (doubling): rows stay where they are
            old = self._mirror.shape[0]
            grown = np.zeros((max(8, 2 * old), self.max_blocks_per_req), dtype=np.int64)
            grown[:old] = self._mirror
            self._mirror = grown
            self._free_rows.extend(range(grown.shape[0] - 1, old - 1, -1))
        return self._free_rows.pop()

    def _release_row(self, request: Hashable) -> None:
        row = self._rows.pop(request)
        self._mirror[row] = 0
        self._free_rows.append(row)

    def free(self, request: Hashable) -> None:
        """Return ``request``'s blocks; KeyError naming the live requests when it has none."""
        if request not in self.tables:
            raise KeyError(f"request {request!r} holds no KV blocks; live requests: {list(self.tables)}")
        self._release(self.tables.pop(request))
        self._release_row(request)

    def truncate(self, request: Hashable, num_tokens: int) -> None:
        """Keep ``request``'s first ``num_tokens`` tokens: free the blocks past them (rollback).

        The slots past ``num_tokens`` in the last kept block keep stale K/V; they are never read
        before being written again, because a step writes every token's K/V before attending and a
        token attends only to positions up to its own. ``num_tokens=0`` keeps an empty table.
        """
        if request not in self.tables:
            raise KeyError(f"request {request!r} holds no KV blocks; live requests: {list(self.tables)}")
        table = self.tables[request]
        held = len(table) * self.block_size
        if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or not 0 <= num_tokens <= held:
            raise ValueError(
                f"truncate: request {request!r} holds blocks for {held} tokens; num_tokens must be an int in "
                f"0..{held}, got {num_tokens!r}"
            )
        keep = math.ceil(num_tokens / self.block_size)
        self._release(table[keep:])
        self._mirror[self._rows[request], keep:len(table)] = 0
        del table[keep:]

    def slot(self, request: Hashable, position: int) -> int:
        """Flat cache slot (block * block_size + offset) of ``request``'s token at ``position``."""
        table = self.tables[request]
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def static_inputs(self) -> list[StaticInput]:
        """The metadata inputs for a GraphRunner, with pads that never touch a real request.

        Padding tokens write K/V to the scratch slot and read (and discard) request row 0.
        ``request_index`` holds rows of ``block_tables`` (``request_row=True``): a micro-batching
        runner rebases it for each half, which gets only its own requests' block tables.
        """
        return [
            StaticInput(POSITIONS, pad=0),
            StaticInput(SLOT_MAPPING, pad=PAD_SLOT),
            StaticInput(REQUEST_INDEX, pad=0, request_row=True),
            StaticInput(BLOCK_TABLES, shape=(self.max_blocks_per_req,), pad=0, per="request"),
        ]

    def step_inputs(self, chunks: Sequence[tuple[Hashable, int, int]]) -> dict[str, torch.Tensor]:
        """Metadata of one step from ``(request, first position, number of tokens)`` per scheduled request.

        Tokens are laid out request after request, in ``chunks`` order; blocks are reserved as needed,
        for every chunk or (when blocks run out, or a chunk is invalid) for none. The tensors are the
        caller's own (:meth:`stage_step` returns views a later step overwrites).
        """
        _, views = self.stage_step(chunks)
        return {name: t.clone() for name, t in views.items()}

    def stage_step(
        self, chunks: Sequence[tuple[Hashable, int, int]], tokens: Sequence[int] | None = None
    ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        """:meth:`step_inputs` written into this cache's staging buffer: ``(input ids, metadata)``, views
        valid until the next call (a runner copies them into its own buffers); the ids are ``tokens``
        (one per token of the step) as a long tensor, None without ``tokens``.

        The serving hot path: one host buffer (pinned on CUDA, then one copy to the device) instead of
        a tensor built from Python lists per input, and the block tables gathered from a host mirror.
        """
        if not chunks:
            raise ValueError("a step needs one chunk per scheduled request, at least one; got requests []")
        decode = True
        needs = []
        for request, start, count in chunks:
            if start < 0 or count < 1:
                raise ValueError(f"request {request!r}: need start >= 0 and count >= 1, got start={start}, count={count}")
            if count != 1:
                decode = False
            needs.append((request, start + count))
        if len({c[0] for c in chunks}) != len(chunks):
            requests = [c[0] for c in chunks]
            raise ValueError(f"a step needs one chunk per scheduled request, at least one; got requests {requests}")
        if any(self._missing(r, n) for r, n in needs):  # the scheduler reserved them already: only eager use gets here
            self._reserve_all(needs)  # all or nothing
        n = len(chunks) if decode else sum(c[2] for c in chunks)
        if tokens is not None and len(tokens) != n:
            raise ValueError(f"stage_step: {len(tokens)} token ids for a step of {n} tokens")
        b, width, bs = len(chunks), self.max_blocks_per_req, self.block_size
        host, views = self._stage.layout(n, b, width)
        rows = [self._rows[c[0]] for c in chunks]
        if decode:  # one token per request: every per-token input in one write, from Python ints
            tables = self.tables
            flat = [start for _, start, _ in chunks]
            flat += [tables[r][p // bs] * bs + p % bs for r, p, _ in chunks]
            flat += range(n)
            if tokens is None:
                host[n:4 * n] = flat
            else:
                host[:4 * n] = [*tokens, *flat]
        else:
            if tokens is not None:
                host[:n] = tokens
            at = 0
            for row, (request, start, count) in enumerate(chunks):
                positions = np.arange(start, start + count, dtype=np.int64)
                host[n + at:n + at + count] = positions
                host[2 * n + at:2 * n + at + count] = self._mirror[rows[row], positions // bs] * bs + positions % bs
                host[3 * n + at:3 * n + at + count] = row
                at += count
        if b == 1:
            host[4 * n:4 * n + width] = self._mirror[rows[0]]
        else:
            self._mirror.take(rows, axis=0, out=host[4 * n:4 * n + b * width].reshape(b, width))
        self._stage.to_device(4 * n + b * width)
        ids, positions, slots, index, tables = views
        return (ids if tokens is not None else None), {
            POSITIONS: positions, SLOT_MAPPING: slots, REQUEST_INDEX: index, BLOCK_TABLES: tables,
        }

    def metadata(self, views: Mapping[str, torch.Tensor]) -> PagedAttentionMetadata:
        """The attention metadata over ``views`` (a runner's views, or :meth:`step_inputs` for eager use)."""
        keys, values = self._noting or (self.key_caches, self.value_caches)
        return PagedAttentionMetadata(
            views[POSITIONS], views[SLOT_MAPPING], views[REQUEST_INDEX], views[BLOCK_TABLES], keys,
            values, self.attention_backends, self.indexer_caches,
        )

    def check_layers(self) -> None:
        """Note, from now on, which layers attention reads and writes: steps' metadata index their caches
        through lists that record each layer (any op reading ``current_metadata()`` is seen, not only
        ``pb_kv::paged_attention``); :meth:`layers_unused` ends it."""
        used: set[int] = set()
        self._noting = (_NotingList(self.key_caches, used), _NotingList(self.value_caches, used))

    def layers_unused(self, full_replay: bool = False) -> list[int] | None:
        """The layers no attention op reached since :meth:`check_layers`; the noting ends. None, and the
        noting goes on, when none was reached and the last step was a FULL replay (``full_replay``: no
        Python ran, so nothing can be said yet)."""
        if self._noting is None:
            return []
        used = self._noting[0].used
        if not used and full_replay:
            return None
        self._noting = None
        return [i for i in range(len(self.key_caches)) if i not in used]

    def context_fn(self, views: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """A GraphRunner ``context_fn``: the step's forward-context attributes."""
        return {"attn_metadata": self.metadata(views)}


class _NotingList(list):
    """A list of a cache's per-layer tensors that records the layer of every ``[i]`` (:meth:`PagedKVCache.check_layers`)."""

    def __init__(self, items: list[torch.Tensor], used: set[int]):
        super().__init__(items)
        self.used = used

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, int):
            self.used.add(i % len(self) if len(self) else i)
        return super().__getitem__(i)


class _Stage:
    """A cache's staging buffer for one step's host inputs: ids, positions, slots, request rows and block
    tables, laid out one after the other in one int64 buffer (pinned on CUDA, with a device twin that
    one copy fills), and the tensor views of each layout, made once per ``(tokens, requests)``."""

    def __init__(self, device: torch.device):
        self.device = device
        self.size = 0
        self._views: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        self._grow(1024)

    def _grow(self, size: int) -> None:
        pin = self.device.type == "cuda"
        with torch.inference_mode(False):  # normal tensors wherever the buffer grows: one kind for Dynamo, copies anywhere
            self.host = torch.zeros(size, dtype=torch.long, pin_memory=pin)
            target = self.host if self.device.type == "cpu" else torch.zeros(size, dtype=torch.long, device=self.device)
        self.target = target
        self.array = self.host.numpy()  # shares the memory: numpy writes Python ints in bulk, cheaply
        self.size = size
        self._views.clear()

    def layout(self, n: int, b: int, width: int) -> tuple[np.ndarray, tuple[torch.Tensor, ...]]:
        """The host array to write a step of ``n`` tokens and ``b`` requests into, and its tensor views."""
        views = self._views.get((n, b))
        if views is None:
            used = 4 * n + b * width
            if used > self.size:
                self._grow(max(used, 2 * self.size))
            if len(self._views) > 1024:  # bounded: steps have at most max_num_batched_tokens tokens
                self._views.clear()
            t = self.target
            views = self._views[(n, b)] = (
                t[:n], t[n:2 * n], t[2 * n:3 * n], t[3 * n:4 * n], t[4 * n:used].view(b, width),
            )
        return self.array, views

    def to_device(self, used: int) -> None:
        """Copy what the step wrote to the device twin (nothing to do on the CPU). A blocking copy: the
        host buffer is written again by the next step, which must not race a copy still in flight."""
        if self.target is not self.host:
            self.target[:used].copy_(self.host[:used])
