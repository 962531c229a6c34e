"""Prefix caching's block pool: full prompt blocks keyed by a hash chained over every token before them.

A block's key is ``blake2b(parent key, salt, the block's token ids)``: the same on every rank and every
run (no Python ``hash``), and it names the whole prefix up to the block's end, so two requests share a
block exactly when they start with the same tokens. A collision cannot give wrong tokens: each cached
block keeps its own token ids, and a lookup follows the chain only while every block's tokens equal the
prompt's (and its parent is the block before it), so a block whose key collides is a miss, never a hit.

:class:`PrefixCache` holds the bookkeeping, not the K/V: which blocks are cached (key and tokens), how
many block tables reference each shared block, and the cached blocks no table references, kept in least
recently used order: they count as free, and :meth:`PrefixCache.evict` hands the oldest out when the
cache needs room. :class:`~.cache.PagedKVCache` uses it; the scheduler decides what is looked up and
registered (``serve.scheduler``).
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

#: the key of the chain's start (no parent)
ROOT = b""


def salt_bytes(salt: str | None) -> bytes:
    """What a request's salt puts into its keys: nothing for None, else a 16-byte digest of the str (a fixed
    length, so no salt and token ids can read as another's; ``""`` is a salt, not None)."""
    if salt is None:
        return b""
    return hashlib.blake2b(b"salt:" + salt.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def block_keys(tokens: Sequence[int], block_size: int, salt: bytes = b"") -> list[bytes]:
    """The chained key of every full block of ``tokens`` (a prompt), in order; ``salt`` (a tenant's,
    :func:`salt_bytes`) enters every key, so prompts with different salts share no block."""
    keys: list[bytes] = []
    parent = ROOT
    ids = np.asarray(tokens, dtype=np.int64)
    for i in range(len(tokens) // block_size):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(salt)
        h.update(ids[i * block_size:(i + 1) * block_size].tobytes())
        parent = h.digest()
        keys.append(parent)
    return keys


class PrefixCache:
    """Cached blocks by key, their reference counts, and the unreferenced ones in LRU order (module docstring)."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._by_key: dict[bytes, int] = {}
        self._entry: dict[int, tuple[bytes, bytes, tuple[int, ...]]] = {}  # block -> (key, parent key, tokens)
        #: references of every shared-capable block (cached, or cached once and still in use)
        self._refs: dict[int, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced: oldest first
        self.hits = 0  # prompt tokens found cached, over this cache's life
        self.queries = 0  # prompt tokens looked up

    @property
    def num_evictable(self) -> int:
        """Cached blocks no table references (free for a new use)."""
        return len(self._lru)

    @property
    def num_cached(self) -> int:
        return len(self._entry)

    def match(self, keys: Sequence[bytes], tokens: Sequence[int], limit: int) -> list[int]:
        """The longest chain of cached blocks for ``keys`` (:func:`block_keys` of ``tokens``), at most ``limit``
        blocks; each block's tokens are compared, so a collision stops the chain."""
        blocks: list[int] = []
        parent = ROOT
        bs = self.block_size
        for i, key in enumerate(keys[:limit]):
            b = self._by_key.get(key)
            if b is None:
                break
            _, up, held = self._entry[b]
            if up != parent or list(held) != list(tokens[i * bs:(i + 1) * bs]):
                break
            blocks.append(b)
            parent = key
        return blocks

    def count(self, looked_up: int, hit: int) -> None:
        """Note a lookup of ``looked_up`` prompt tokens of which ``hit`` were cached."""
        self.queries += looked_up
        self.hits += hit

    def evictable_among(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks`` are unreferenced now (taking them uses up free blocks)."""
        return sum(1 for b in blocks if b in self._lru)

    def acquire(self, blocks: Sequence[int]) -> None:
        """One more reference to each of ``blocks`` (cached ones :meth:`match` found)."""
        for b in blocks:
            self._refs[b] += 1
            self._lru.pop(b, None)

    def register(self, block: int, key: bytes, parent: bytes, tokens: Sequence[int]) -> bool:
        """Cache ``block`` (its K/V written, held by one table) under ``key``; False (nothing changes) when
        the key is cached already (another block holds the same prefix) or the block is."""
        if key in self._by_key or block in self._refs:
            return False
        self._by_key[key] = block
        self._entry[block] = (key, parent, tuple(tokens))
        self._refs[block] = 1
        return True

    def release(self, block: int) -> bool:
        """Drop one reference to ``block``; True when the caller must free it (a block never shared, or one
        :meth:`reset` uncached): a cached block no table references goes to the LRU instead."""
        refs = self._refs.get(block)
        if refs is None:
            return True
        if refs > 1:
            self._refs[block] = refs - 1
            return False
        if block in self._entry:
            self._refs[block] = 0
            self._lru[block] = None
            return False
        del self._refs[block]
        return True

    def evict(self) -> int:
        """Uncache the least recently used unreferenced block and hand it out (its caller's now)."""
        block, _ = self._lru.popitem(last=False)
        self._forget(block)
        del self._refs[block]
        return block

    def _forget(self, block: int) -> None:
        key = self._entry.pop(block)[0]
        del self._by_key[key]

    def reset(self) -> list[int]:
        """Uncache every block; returns the unreferenced ones (for the caller to free). Blocks in use stay with
        their tables and are freed when the last reference goes."""
        free = list(self._lru)
        self._lru.clear()
        for b in free:
            del self._refs[b]
        for b in list(self._entry):
            self._forget(b)
        return free
