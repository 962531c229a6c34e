"""kv.prefix_cache and PagedKVCache's shared blocks: chained keys, token-compared lookups, reference counts,
LRU eviction."""

from __future__ import annotations

import pytest

from piecewise_backend import kv
from piecewise_backend.kv import prefix_cache as pc


def make_cache(num_blocks: int = 6) -> kv.PagedKVCache:
    return kv.PagedKVCache(1, 1, 2, num_blocks=num_blocks, block_size=2, max_model_len=8)


def test_keys_chain_over_every_token_before_a_block_and_take_a_salt():
    a, b = pc.block_keys([1, 2, 3, 4, 5], 2), pc.block_keys([9, 2, 3, 4], 2)
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]  # same block tokens, another prefix: another key
    assert pc.block_keys([1, 2, 3, 4], 2) == a  # process-independent: blake2b, not hash()
    assert pc.block_keys([1, 2], 2, b"tenant")[0] != a[0]


def fill(cache: kv.PagedKVCache, request, tokens) -> list[bytes]:
    keys = pc.block_keys(tokens, cache.block_size)
    cache.reserve(request, len(tokens))
    assert cache.register(request, keys, 0, len(keys), tokens) == len(keys)
    return keys


def test_shared_blocks_are_reference_counted_kept_when_unreferenced_and_evicted_oldest_first():
    cache = make_cache(6)
    keys = fill(cache, "a", [1, 2, 3, 4])
    hit = cache.match(keys, [1, 2, 3, 4], 2)
    assert hit == cache.tables["a"]
    cache.attach("b", hit)
    cache.free("a")
    assert cache.num_free_blocks == 4  # b still holds both
    cache.free("b")
    assert cache.num_free_blocks == 6 and cache.prefix.num_evictable == 2  # cached, counted free
    other = fill(cache, "c", [7, 7, 8, 8, 9, 9])  # takes never-used blocks first (3 of 4)
    assert cache.match(keys, [1, 2, 3, 4], 2) == hit
    cache.reserve("d", 4)  # the last never-used block, then the least recently used cached one: a's tail
    assert cache.match(keys, [1, 2, 3, 4], 2) == hit[:1] and cache.prefix.num_cached == 4
    cache.free("c")
    cache.free("d")
    assert cache.num_free_blocks == 6 and cache.match(other, [7, 7, 8, 8, 9, 9], 3) != []
    assert cache.reset_prefix_cache() == 4 and cache.num_free_blocks == 6 and cache.allocator.num_free == 6


def test_a_colliding_key_is_a_miss_never_another_prompt_s_blocks():
    cache = make_cache()
    keys = fill(cache, "a", [1, 2, 3, 4])
    assert cache.match(keys, [1, 2, 3, 5], 2) == cache.tables["a"][:1]  # same keys, other tokens: the chain stops
    assert cache.match(keys, [0, 2, 3, 4], 2) == []


def test_reset_keeps_blocks_in_use_with_their_table_and_frees_them_on_release():
    cache = make_cache(4)
    keys = fill(cache, "a", [1, 2, 3, 4])
    cache.attach("b", cache.match(keys, [1, 2, 3, 4], 2))
    assert cache.reset_prefix_cache() == 0
    cache.free("a")
    assert cache.num_free_blocks == 2  # b holds them
    cache.free("b")
    assert cache.allocator.num_free == 4 and cache.prefix.num_cached == 0
    with pytest.raises(ValueError, match="holds KV blocks already"):
        cache.reserve("c", 2)
        cache.attach("c", [])
