"""Simulated caching allocator over one shared graph pool (the simulated platform's memory).

What CUDA's caching allocator does with a private graph pool, on the CPU: while a capture is
open (segments and the eager breaks between them), every tensor an op creates is moved into a
block of a pool segment. A block is free again as soon as no tensor views it (its storage
died); the next allocation, in this capture or a later one, takes the best-fitting free block
(smallest that fits, lowest address first; split if larger, merged with free neighbours when
freed). New segments are reserved only when nothing fits. Entries keep weak views, so the
blocks of one capture are reused by the next and a stale output is overwritten, as on a GPU.

The pool owns its memory (one uint8 tensor per segment). Weak views made through
:meth:`SimPool.weak` are tracked, so a segment is never given back while one of them could
still read it (a real GPU would let it read freed memory; a CPU process would crash), not
even when the pool itself is dropped: its segments that some tensor still views outlive it.
"""

from __future__ import annotations

import bisect
import weakref
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from ...weak import mark_weak

BLOCK = 512  # bytes: allocation granularity (CUDA's caching allocator rounds to 512 too)
_CPU = torch.device("cpu")
# Segments of dropped pools that some tensor (weak view or pool block) still viewed.
_orphans: list[tuple[torch.Tensor, list[StorageWeakRef]]] = []


def _prune_orphans() -> None:
    _orphans[:] = [(seg, refs) for seg, refs in _orphans if any(not r.expired() for r in refs)]


def _orphan(segments: dict[int, torch.Tensor], views: dict[int, list[StorageWeakRef]], blocks: dict) -> None:
    """A pool was dropped: keep the memory of its segments that tensors still view."""
    _prune_orphans()
    for base, backing in segments.items():
        refs = [r for r in views.get(base, ()) if not r.expired()]
        refs += [b.live for b in blocks.values() if b.segment == base and b.live is not None and not b.live.expired()]
        if refs:
            _orphans.append((backing, refs))


class _Block:
    __slots__ = ("addr", "size", "segment", "live")

    def __init__(self, addr: int, size: int, segment: int):
        self.addr, self.size, self.segment, self.live = addr, size, segment, None

    @property
    def end(self) -> int:
        return self.addr + self.size


class SimPool:
    """A best-fit caching allocator over segments that it owns; sizes in bytes."""

    def __init__(self) -> None:
        self.segments: dict[int, torch.Tensor] = {}  # base address -> backing uint8 tensor
        self._bases: list[int] = []  # sorted segment bases
        self._blocks: dict[int, _Block] = {}  # every block (free or live) by address
        self._by_end: dict[int, _Block] = {}
        self._free: list[tuple[int, int]] = []  # sorted (size, addr) of free blocks
        self._freed: list[int] = []  # addresses whose storage died, not yet merged (callbacks)
        self._views: dict[int, list[StorageWeakRef]] = {}  # segment -> weak views made of it
        self.peak_reserved = 0
        weakref.finalize(self, _orphan, self.segments, self._views, self._blocks)

    # -- queries

    def reserved(self) -> int:
        """Bytes of all segments: what the pool holds from the system."""
        return sum(t.numel() for t in self.segments.values())

    def allocated(self) -> int:
        """Bytes of blocks some tensor still owns."""
        self._collect()
        return sum(b.size for b in self._blocks.values() if b.live is not None)

    def owns(self, t: torch.Tensor) -> bool:
        """True if ``t``'s memory lies in this pool (a capture-time tensor)."""
        if not isinstance(t, torch.Tensor) or t.device != _CPU or type(t) is not torch.Tensor:
            return False
        return self._segment_of(t.untyped_storage().data_ptr()) is not None

    def _segment_of(self, ptr: int) -> int | None:
        i = bisect.bisect_right(self._bases, ptr) - 1
        if i >= 0:
            base = self._bases[i]
            if ptr < base + self.segments[base].numel():
                return base
        return None

    # -- allocation

    def allocate(self, nbytes: int) -> torch.UntypedStorage:
        """A storage of ``nbytes`` on a pool block; the block is free again when the storage dies."""
        self._collect()
        size = max(BLOCK, -(-nbytes // BLOCK) * BLOCK)
        i = bisect.bisect_left(self._free, (size, -1))
        if i < len(self._free):
            _, addr = self._free.pop(i)
            block = self._blocks[addr]
            if block.size - size >= BLOCK:  # split: the rest stays free
                rest = _Block(addr + size, block.size - size, block.segment)
                block.size = size
                self._add(rest)
                bisect.insort(self._free, (rest.size, rest.addr))
                self._by_end[block.end] = block
        else:
            backing = torch.empty(size, dtype=torch.uint8)
            base = backing.data_ptr()
            self.segments[base] = backing
            bisect.insort(self._bases, base)
            block = _Block(base, size, base)
            self._add(block)
            self.peak_reserved = max(self.peak_reserved, self.reserved())
        storage = torch._C._construct_storage_from_data_pointer(block.addr, _CPU, nbytes)
        block.live = StorageWeakRef(storage)
        # The storage's Python object lives exactly as long as its C++ storage (PyTorch
        # preserves it), so this fires when the last tensor viewing the block dies.
        weakref.finalize(storage, self._freed.append, block.addr)
        return storage

    def _add(self, block: _Block) -> None:
        self._blocks[block.addr] = block
        self._by_end[block.end] = block

    def _collect(self) -> None:
        while self._freed:
            addr = self._freed.pop()
            block = self._blocks.get(addr)
            if block is not None and block.live is not None and block.live.expired():
                self._release(block)

    def _release(self, block: _Block) -> None:
        block.live = None
        nxt = self._blocks.get(block.end)
        if nxt is not None and nxt.live is None and nxt.segment == block.segment:
            self._free.remove((nxt.size, nxt.addr))
            del self._blocks[nxt.addr], self._by_end[nxt.end]
            del self._by_end[block.end]
            block.size += nxt.size
            self._by_end[block.end] = block
        prev = self._by_end.get(block.addr)
        if prev is not None and prev.live is None and prev.segment == block.segment:
            self._free.remove((prev.size, prev.addr))
            del self._blocks[block.addr], self._by_end[prev.end]
            prev.size += block.size
            self._by_end[prev.end] = prev
            block = prev
        bisect.insort(self._free, (block.size, block.addr))

    def release_cached(self) -> int:
        """Give back every wholly free segment no weak view can still read; returns the bytes."""
        self._collect()
        _prune_orphans()
        released = 0
        for base in list(self.segments):
            block = self._blocks[base]
            size = self.segments[base].numel()
            views = [w for w in self._views.get(base, ()) if not w.expired()]
            self._views[base] = views
            if block.live is None and block.size == size and not views:
                self._free.remove((block.size, base))
                del self._blocks[base], self._by_end[block.end], self.segments[base], self._views[base]
                self._bases.remove(base)
                released += size
        return released

    # -- tensors

    def adopt(self, t: torch.Tensor, moved: dict[int, torch.UntypedStorage]) -> torch.Tensor:
        """``t`` moved into the pool (same values, sizes, strides); ``moved`` maps old storages."""
        old = t.untyped_storage()
        key = old.data_ptr()
        storage = moved.get(key)
        if storage is None:
            storage = moved[key] = self.allocate(old.nbytes())
            storage.copy_(old)
        return _tensor_on(storage, t)

    def weak(self, t: torch.Tensor) -> torch.Tensor:
        """A weak view of the pool tensor ``t``: it keeps no block alive (see module docstring)."""
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        weak_storage = torch._C._construct_storage_from_data_pointer(ptr, _CPU, storage.nbytes())
        segment = self._segment_of(ptr)
        if segment is not None:
            views = self._views.setdefault(segment, [])
            if len(views) >= 256 and len(views) & (len(views) - 1) == 0:  # prune now and then
                views[:] = [w for w in views if not w.expired()]
            views.append(StorageWeakRef(weak_storage))
        return mark_weak(_tensor_on(weak_storage, t))


    def weaken_ops(self, ops: list[Any]) -> list[Any]:
        """Recorded ops (``args``, ``kwargs``, ``fresh``) with their pool tensors held weakly."""

        made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (tensor, its weak view)

        def weaken(x: Any) -> Any:
            if not self.owns(x):
                return x
            if id(x) not in made:
                made[id(x)] = (x, self.weak(x))
            return made[id(x)][1]

        for op in ops:
            op.args, op.kwargs = tree_map(weaken, op.args), tree_map(weaken, op.kwargs)
            op.fresh = [(i, weaken(t)) for i, t in op.fresh]
        return ops


def _tensor_on(storage: torch.UntypedStorage, like: torch.Tensor) -> torch.Tensor:
    with torch._C._DisableTorchDispatch(), torch.no_grad(), torch.inference_mode(like.is_inference()):
        out = torch.empty(0, dtype=like.dtype, device=_CPU)
        out.set_(storage, like.storage_offset(), like.size(), like.stride())
    return out


def _input_storages(args: tuple, kwargs: dict) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}


class PoolMode(TorchDispatchMode):
    """While active, tensors that ops create on the CPU are moved into ``pool``."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # Dynamo's tracing (fake tensors) is not an allocation

    def __init__(self, pool: SimPool):
        super().__init__()
        self.pool = pool
        self.paused = False  # the simulator's own work (a validation replay) is not the program's

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if any(t is not torch.Tensor for t in types):
            return NotImplemented  # subclasses (DTensor) desugar first; their plain parts come back here
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.paused:
            return out
        inputs = _input_storages(args, kwargs)
        moved: dict[int, torch.UntypedStorage] = {}

        def move(t: Any) -> Any:
            if (
                type(t) is torch.Tensor
                and t.device == _CPU
                and t.untyped_storage().nbytes()
                and t.untyped_storage().data_ptr() not in inputs
                and not self.pool.owns(t)
            ):
                return self.pool.adopt(t, moved)
            return t

        return tree_map(move, out)
