"""Paged KV cache and the reference paged attention op (kv/cache.py)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode

import piecewise_backend as pb
from piecewise_backend import attention, kv
from pbtest.helpers import SIM, PagedTinyLM, compile_model, paged_cache

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 8, 4
SCALE = DIM**-0.5


def make_cache(
    num_blocks: int = 32, max_model_len: int = 32, layers: int = 1, device: str = "cpu", attention_backend: str = "auto"
) -> kv.PagedKVCache:
    return kv.PagedKVCache(
        layers, KV_HEADS, DIM, num_blocks=num_blocks, block_size=BLOCK, max_model_len=max_model_len, device=device,
        attention_backend=attention_backend,
    )


def fragment(cache: kv.PagedKVCache) -> None:
    """Leave the free list out of order, so requests get non-contiguous blocks."""
    for r in range(4):
        cache.reserve(("frag", r), 2 * BLOCK)
    for r in (2, 0, 3, 1):
        cache.free(("frag", r))


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = -1) -> torch.Tensor:
    """SDPA over one whole request: (len, heads, dim) -> (len, heads, dim), causal, GQA by repetition."""
    n = q.shape[0]
    k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
    i = torch.arange(n)
    mask = i[None, :] <= i[:, None]
    if window > 0:
        mask &= i[None, :] > i[:, None] - window
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=SCALE)
    return out.transpose(0, 1)


def plain_reference(q, k, v, window: int = -1, softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention over one whole request written out by hand, with soft-capping and sinks."""
    n = q.shape[0]
    k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) * SCALE
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    i = torch.arange(n)
    mask = i[None, :] <= i[:, None]
    if window > 0:
        mask &= i[None, :] > i[:, None] - window
    weights = torch.where(mask, scores.exp(), 0.0)
    denominator = weights.sum(-1, keepdim=True)
    if sinks is not None:
        denominator = denominator + sinks.exp()[:, None, None]
    return torch.einsum("hqk,khd->qhd", weights / denominator, v)


def run_op(cache: kv.PagedKVCache, meta: dict[str, torch.Tensor], q, k, v, window: int = -1, **extra) -> torch.Tensor:
    out = torch.empty_like(q)
    with pb.set_forward_context(attn_metadata=cache.metadata(meta)):
        torch.ops.pb_kv.paged_attention(q, k, v, out, 0, SCALE, window, **extra)
    return out


def pad_step(meta: dict[str, torch.Tensor], n: int) -> dict[str, torch.Tensor]:
    """Append ``n`` padding tokens with the pads the cache gives a runner."""
    pads = {i.name: i.pad for i in make_cache().static_inputs()}
    out = dict(meta)
    for name in (kv.POSITIONS, kv.SLOT_MAPPING, kv.REQUEST_INDEX):
        out[name] = torch.cat([meta[name], torch.full((n,), pads[name], dtype=torch.long)])
    return out


def test_allocator_hands_out_and_takes_back_blocks():
    alloc = kv.BlockAllocator(3)
    a = alloc.allocate(2)
    assert len(set(a)) == 2 and alloc.num_free == 1
    with pytest.raises(RuntimeError, match=r"out of KV blocks: 2 needed, 1 of 3 free"):
        alloc.allocate(2)
    alloc.free(a)
    assert sorted(alloc.allocate(3)) == [0, 1, 2]
    with pytest.raises(ValueError, match="num_blocks must be a positive int, got 0"):
        kv.BlockAllocator(0)


def test_cache_reserves_slots_and_frees_blocks():
    cache = make_cache(num_blocks=4, max_model_len=12)
    assert cache.max_blocks_per_req == 3
    assert cache.key_caches[0].shape == (5, BLOCK, KV_HEADS, DIM)  # + the scratch block
    cache.reserve("a", 5)
    assert len(cache.tables["a"]) == 2
    table = cache.tables["a"]
    assert cache.slot("a", 4) == table[1] * BLOCK
    cache.reserve("a", 8)  # still two blocks
    assert cache.tables["a"] == table
    with pytest.raises(ValueError, match=r"needs 13 tokens, more than max_model_len=12"):
        cache.reserve("b", 13)
    cache.free("a")
    assert cache.allocator.num_free == 4
    with pytest.raises(KeyError, match=r"request 'a' holds no KV blocks"):
        cache.free("a")
    with pytest.raises(ValueError, match="head_dim must be a positive int"):
        kv.PagedKVCache(1, 2, 0, num_blocks=4, max_model_len=8)


def test_cache_says_what_a_request_still_needs_before_reserving():
    """What a scheduler asks before a step (to preempt in time, not fail mid-step)."""
    cache = make_cache(num_blocks=4, max_model_len=16)
    assert cache.blocks_for(9) == 3 and cache.blocks_for(0) == 0
    assert cache.blocks_needed("a", 5) == 2 and cache.num_free_blocks == 4
    cache.reserve("a", 5)
    assert cache.blocks_needed("a", 8) == 0 and cache.blocks_needed("a", 9) == 1
    assert cache.num_free_blocks == 2 and "a" in cache.tables  # asking reserved nothing more
    with pytest.raises(ValueError, match="needs 17 tokens, more than max_model_len=16"):
        cache.blocks_needed("a", 17)


def test_allocator_refuses_double_and_foreign_frees():
    """Taking back a block twice would put it twice in the free list: two requests would share it."""
    alloc = kv.BlockAllocator(3)
    a = alloc.allocate(2)
    alloc.free(a[:1])
    with pytest.raises(ValueError, match=rf"block {a[0]} is already free \(double free\)"):
        alloc.free(a[:1])
    with pytest.raises(ValueError, match=r"block 7 is not a block id of this allocator \(0..2\)"):
        alloc.free([7])
    for foreign in (-1, 1.0, True, "1"):  # 1.0 and True hash like 1, a live id
        with pytest.raises(ValueError, match="not a block id of this allocator"):
            alloc.free([foreign])
    with pytest.raises(ValueError, match=rf"block {a[1]} is given twice in this call"):
        alloc.free([a[1], a[1]])
    with pytest.raises(ValueError, match="already free"):  # all or nothing: the good id stays handed out
        alloc.free([a[1], a[0]])
    assert alloc.num_free == 2
    alloc.free([a[1]])
    assert alloc.num_free == 3 and sorted(alloc.allocate(3)) == [0, 1, 2]  # each block handed out once
    with pytest.raises(ValueError, match="block count >= 0, got -1"):
        alloc.allocate(-1)


def test_cache_free_and_truncate_never_return_a_block_twice():
    cache = make_cache(num_blocks=4, max_model_len=16)
    cache.reserve("a", 10)  # 3 blocks of 4
    table = list(cache.tables["a"])
    cache.truncate("a", 5)  # keeps positions 0..4: 2 blocks
    assert cache.tables["a"] == table[:2] and cache.allocator.num_free == 2
    cache.truncate("a", 8)  # nothing past 8 tokens is held: no change
    assert cache.tables["a"] == table[:2] and cache.allocator.num_free == 2
    with pytest.raises(ValueError, match=r"holds blocks for 8 tokens; num_tokens must be an int in 0..8, got 9"):
        cache.truncate("a", 9)
    with pytest.raises(KeyError, match="request 'z' holds no KV blocks"):
        cache.truncate("z", 0)
    cache.truncate("a", 0)
    assert cache.tables["a"] == [] and cache.allocator.num_free == 4
    cache.free("a")
    assert cache.allocator.num_free == 4  # the empty table freed nothing twice
    cache.reserve("b", 16)
    assert sorted(cache.tables["b"]) == [0, 1, 2, 3]


def test_step_inputs_reserve_all_or_nothing():
    """When blocks run out, or a later chunk is invalid, no chunk of the step keeps new blocks."""
    cache = make_cache(num_blocks=3, max_model_len=12)
    cache.reserve("a", 4)
    held = list(cache.tables["a"])
    with pytest.raises(RuntimeError, match=r"out of KV blocks: 3 needed \('a': 1, 'b': 2\), 2 of 3 free; nothing was reserved"):
        cache.step_inputs([("a", 4, 1), ("b", 0, 8)])
    with pytest.raises(ValueError, match="needs 13 tokens, more than max_model_len=12"):
        cache.step_inputs([("a", 4, 1), ("c", 0, 13)])
    with pytest.raises(ValueError, match="need start >= 0 and count >= 1"):
        cache.step_inputs([("a", 4, 1), ("c", 0, 0)])
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        cache.reserve("d", 12)
    assert cache.tables == {"a": held} and cache.allocator.num_free == 2  # no empty table for b, c or d
    meta = cache.step_inputs([("a", 4, 1), ("b", 0, 4)])  # what fits still runs
    assert meta[kv.POSITIONS].tolist() == [4, 0, 1, 2, 3] and cache.allocator.num_free == 0


def test_rollback_frees_slots_without_touching_other_requests():
    """A request rolled back to fewer tokens: another request's K/V stays bit-exact when a new
    request reuses the freed block, and attention of the rolled-back request never reads the
    rejected tokens' stale K/V (its later tokens overwrite the slots first)."""
    g = torch.Generator().manual_seed(0)
    cache = make_cache(num_blocks=5, max_model_len=16)  # a, b: 2 blocks each; c gets the last free one and a's
    seqs = {r: [torch.randn(n, h, DIM, generator=g) for h in (HEADS, KV_HEADS, KV_HEADS)] for r, n in (("a", 7), ("b", 6))}
    meta = cache.step_inputs([("a", 0, 7), ("b", 0, 6)])
    run_op(cache, meta, *(torch.cat([seqs["a"][i], seqs["b"][i]]) for i in range(3)))
    b_slots = [cache.slot("b", p) for p in range(6)]
    b_kv = [c.flatten(0, 1)[b_slots].clone() for c in (cache.key_caches[0], cache.value_caches[0])]
    freed = cache.tables["a"][1]
    cache.truncate("a", 3)  # positions 3..6 rejected: a's second block goes back
    meta = cache.step_inputs([("c", 0, 8)])  # c takes the freed block and writes garbage into it
    assert freed in cache.tables["c"]
    nan = [torch.full((8, h, DIM), float("nan")) for h in (HEADS, KV_HEADS, KV_HEADS)]
    run_op(cache, meta, *nan)
    for cached, before in zip((cache.key_caches[0], cache.value_caches[0]), b_kv):
        assert torch.equal(cached.flatten(0, 1)[b_slots], before)
    cache.free("c")  # a's next block is one c filled with NaN: a must never read its stale slots
    # a continues from position 3 with new tokens: exact attention over its 3 kept + 2 new tokens
    new = [torch.randn(2, h, DIM, generator=g) for h in (HEADS, KV_HEADS, KV_HEADS)]
    out = run_op(cache, cache.step_inputs([("a", 3, 2)]), *new)
    full = [torch.cat([seqs["a"][i][:3], new[i]]) for i in range(3)]
    assert_close(out, reference(*full)[3:], atol=1e-5, rtol=1e-5)
    assert cache.key_caches[0][cache.tables["a"][1]].isnan().any()  # the stale NaN was there, and masked out


def test_static_inputs_pad_safely():
    pads = {i.name: (i.pad, i.per) for i in make_cache().static_inputs()}
    assert pads[kv.SLOT_MAPPING] == (kv.PAD_SLOT, "token")
    assert pads[kv.BLOCK_TABLES] == (0, "request")


def test_step_inputs_layout():
    cache = make_cache()
    meta = cache.step_inputs([("a", 0, 3), ("b", 6, 1)])
    assert meta[kv.POSITIONS].tolist() == [0, 1, 2, 6]
    assert meta[kv.REQUEST_INDEX].tolist() == [0, 0, 0, 1]
    a, b = cache.tables["a"], cache.tables["b"]
    assert len(b) == 2  # position 6 lives in the second block
    assert meta[kv.SLOT_MAPPING].tolist() == [a[0] * BLOCK, a[0] * BLOCK + 1, a[0] * BLOCK + 2, b[1] * BLOCK + 2]
    assert meta[kv.BLOCK_TABLES].shape == (2, cache.max_blocks_per_req)
    assert meta[kv.BLOCK_TABLES][1].tolist()[:2] == b and meta[kv.BLOCK_TABLES][1, 2:].eq(0).all()
    with pytest.raises(ValueError, match=r"one chunk per scheduled request, at least one; got requests \['a', 'a'\]"):
        cache.step_inputs([("a", 3, 1), ("a", 4, 1)])
    with pytest.raises(ValueError, match="got requests \\[\\]"):
        cache.step_inputs([])


def expected_inputs(cache: kv.PagedKVCache, chunks) -> dict[str, list]:
    """What a step's metadata must hold, from the cache's block tables (lists) alone."""
    width = cache.max_blocks_per_req
    return {
        kv.POSITIONS: [p for _, s, n in chunks for p in range(s, s + n)],
        kv.SLOT_MAPPING: [cache.slot(r, p) for r, s, n in chunks for p in range(s, s + n)],
        kv.REQUEST_INDEX: [i for i, (_, _, n) in enumerate(chunks) for _ in range(n)],
        kv.BLOCK_TABLES: [cache.tables[r] + [0] * (width - len(cache.tables[r])) for r, _, _ in chunks],
    }


def test_stage_step_writes_every_layout_into_one_buffer_the_next_step_reuses():
    """Decode steps and mixed steps staged into the cache's buffer hold what the block tables say, through
    truncation, frees and a freed table row taken by a new request; step_inputs' tensors are the caller's own."""
    cache = make_cache(num_blocks=32, max_model_len=32)
    fragment(cache)
    steps = [
        [("a", 0, 5), ("b", 0, 2)],  # prefill chunks (b's two tokens)
        [("a", 5, 1), ("b", 2, 1)],  # a decode step crossing into a's second block
        [("b", 3, 6), ("a", 6, 1), ("c", 0, 9)],  # mixed, a new request
    ]
    for chunks in steps:
        tokens = list(range(100, 100 + sum(n for _, _, n in chunks)))
        ids, meta = cache.stage_step(chunks, tokens)
        assert ids.tolist() == tokens
        assert {k: t.tolist() for k, t in meta.items()} == expected_inputs(cache, chunks)
    again_ids, again = cache.stage_step([("a", 7, 1), ("c", 9, 1), ("b", 9, 1)])
    assert again_ids is None and {k: t.tolist() for k, t in again.items()} == expected_inputs(
        cache, [("a", 7, 1), ("c", 9, 1), ("b", 9, 1)])
    base = again[kv.POSITIONS].untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == base for t in again.values())  # one buffer, one copy to a device
    cache.truncate("c", 3)  # c keeps one block: its mirrored row must be zero past it
    cache.free("a")
    cache.reserve("d", 4)  # may take a's table row: no stale block of a's in its padding
    chunks = [("c", 3, 1), ("d", 0, 4), ("b", 10, 1)]
    fresh, want = cache.step_inputs(chunks), expected_inputs(cache, chunks)
    assert {k: t.tolist() for k, t in fresh.items()} == want
    cache.stage_step([("b", 11, 1), ("c", 4, 1), ("d", 4, 1)])  # overwrites the staging buffer
    assert {k: t.tolist() for k, t in fresh.items()} == want  # step_inputs' tensors are copies
    with pytest.raises(ValueError, match="stage_step: 2 token ids for a step of 1 tokens"):
        cache.stage_step([("b", 11, 1)], [1, 2])


def test_stage_step_grows_its_buffer_and_mirror_for_many_requests_and_tokens():
    cache = make_cache(num_blocks=200, max_model_len=32)
    chunks = [(("r", i), 0, 29) for i in range(20)]  # 20 table rows, 580 tokens: past the first sizes
    ids, meta = cache.stage_step(chunks, [7] * 580)
    assert ids.tolist() == [7] * 580 and {k: t.tolist() for k, t in meta.items()} == expected_inputs(cache, chunks)


@pytest.mark.parametrize("window", [-1, 3])
def test_paged_attention_matches_sdpa_on_ragged_chunked_batches(window):
    """Two steps of a random ragged batch (some prompts split across steps) vs SDPA per request."""
    g = torch.Generator().manual_seed(0)
    lens, first = [5, 11, 1, 7, 9], [3, 11, 0, 2, 4]  # tokens per request, of which in step 1
    seqs = [tuple(torch.randn(n, h, DIM, generator=g) for h in (HEADS, KV_HEADS, KV_HEADS)) for n in lens]
    cache = make_cache()
    fragment(cache)
    got: list[list[torch.Tensor]] = [[] for _ in lens]
    for step in range(2):
        rows = [(r, 0, first[r]) if step == 0 else (r, first[r], lens[r] - first[r]) for r in range(len(lens))]
        rows = [row for row in rows if row[2] > 0]
        meta = cache.step_inputs(rows)
        q, k, v = (torch.cat([seqs[r][i][s : s + n] for r, s, n in rows]) for i in range(3))
        if step == 1:  # padding tokens with garbage K/V: they must change nothing but the scratch block
            meta = pad_step(meta, 3)
            q, k, v = (torch.cat([t, torch.full((3, *t.shape[1:]), float("nan"))]) for t in (q, k, v))
            before = [c[:-1].clone() for c in (cache.key_caches[0], cache.value_caches[0])]
        out = run_op(cache, meta, q, k, v, window)
        offset = 0
        for r, _, n in rows:
            got[r].append(out[offset : offset + n])
            offset += n
    for r, (q, k, v) in enumerate(seqs):
        assert_close(torch.cat(got[r]), reference(q, k, v, window), atol=1e-5, rtol=1e-5)
    # The padding rows wrote only scratch; real rows wrote exactly their own (new) slots.
    real = meta[kv.SLOT_MAPPING][:-3]
    for cached, old in zip((cache.key_caches[0], cache.value_caches[0]), before):
        flat, old_flat = cached[:-1].flatten(0, 1), old.flatten(0, 1)
        untouched = torch.ones(flat.shape[0], dtype=torch.bool)
        untouched[real] = False
        assert torch.equal(flat[untouched], old_flat[untouched])
        assert cached[-1].isnan().any()  # the garbage did land in scratch


@pytest.mark.parametrize("window", [-1, 3])
@pytest.mark.parametrize("softcap, with_sinks", [(0.0, True), (0.5, False), (0.5, True)])
def test_paged_attention_softcap_and_sinks_match_plain_reference(window, softcap, with_sinks):
    """Soft-capping (scores -> tanh(s/cap)*cap) and per-head sink logits, over a prefill then a decode step."""
    g = torch.Generator().manual_seed(3)
    lens = [6, 9, 1]
    seqs = [tuple(torch.randn(n, h, DIM, generator=g) * 2 for h in (HEADS, KV_HEADS, KV_HEADS)) for n in lens]
    sinks = torch.randn(HEADS, generator=g) if with_sinks else None
    cache = make_cache()
    fragment(cache)
    got: list[list[torch.Tensor]] = [[] for _ in lens]
    for rows in ([(r, 0, n - 1) for r, n in enumerate(lens) if n > 1], [(r, n - 1, 1) for r, n in enumerate(lens)]):
        q, k, v = (torch.cat([seqs[r][i][s : s + n] for r, s, n in rows]) for i in range(3))
        meta = pad_step(cache.step_inputs(rows), 2)
        q, k, v = (torch.cat([t, torch.full((2, *t.shape[1:]), float("nan"))]) for t in (q, k, v))
        out = run_op(cache, meta, q, k, v, window, softcap=softcap, sinks=sinks)
        offset = 0
        for r, _, n in rows:
            got[r].append(out[offset : offset + n])
            offset += n
    for r, (q, k, v) in enumerate(seqs):
        expected = plain_reference(q, k, v, window, softcap, sinks)
        assert_close(torch.cat(got[r]), expected, atol=1e-5, rtol=1e-5)
        if (softcap or with_sinks) and len(q) > 1:  # the feature changed the result: ignoring it would fail
            assert not torch.allclose(expected, plain_reference(q, k, v, window), atol=1e-3)


def test_paged_attention_refuses_bad_softcap_and_sinks():
    cache = make_cache()
    meta = cache.step_inputs([("a", 0, 2)])
    q, k = torch.zeros(2, HEADS, DIM), torch.zeros(2, KV_HEADS, DIM)
    with pytest.raises(ValueError, match=r"softcap must be a finite float >= 0 \(0 = off\), got -1.0"):
        run_op(cache, meta, q, k, k, softcap=-1.0)
    with pytest.raises(ValueError, match=r"sinks must hold one logit per query head, shape \(4,\); got \(2,\)"):
        run_op(cache, meta, q, k, k, sinks=torch.zeros(KV_HEADS))


def alibi_sdpa(q, k, v, slopes: torch.Tensor) -> torch.Tensor:
    """SDPA over one whole request with ALiBi as a float mask: ``slope * (key_pos - query_pos)``, causal."""
    n = q.shape[0]
    k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
    i = torch.arange(n, dtype=torch.float32)
    bias = slopes[:, None, None] * (i[None, :] - i[:, None])[None]
    bias = bias.masked_fill(i[None, None, :] > i[None, :, None], float("-inf"))
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=bias)
    return out.transpose(0, 1)


@pytest.mark.parametrize("backend", ["reference", "bounded"])
def test_paged_attention_alibi_matches_sdpa_with_a_bias(backend):
    """ALiBi slopes through the op, a chunked prefill then a decode step, vs SDPA with the bias as a float mask."""
    g = torch.Generator().manual_seed(4)
    lens = [7, 10, 1]
    seqs = [tuple(torch.randn(n, h, DIM, generator=g) for h in (HEADS, KV_HEADS, KV_HEADS)) for n in lens]
    slopes = torch.tensor([1.0, 0.5, 0.25, 0.125])
    cache = make_cache(attention_backend=backend)
    fragment(cache)
    got: list[list[torch.Tensor]] = [[] for _ in lens]
    for rows in ([(r, 0, n - 1) for r, n in enumerate(lens) if n > 1], [(r, n - 1, 1) for r, n in enumerate(lens)]):
        q, k, v = (torch.cat([seqs[r][i][s : s + n] for r, s, n in rows]) for i in range(3))
        out = run_op(cache, cache.step_inputs(rows), q, k, v, alibi_slopes=slopes)
        offset = 0
        for r, _, n in rows:
            got[r].append(out[offset : offset + n])
            offset += n
    for r, (q, k, v) in enumerate(seqs):
        assert_close(torch.cat(got[r]), alibi_sdpa(q, k, v, slopes), atol=1e-5, rtol=1e-5)
    q, k, v = seqs[1]
    assert not torch.allclose(alibi_sdpa(q, k, v, slopes), reference(q, k, v), atol=1e-3)


def test_paged_attention_refuses_alibi_slopes_of_another_shape():
    cache = make_cache()
    meta = cache.step_inputs([("a", 0, 2)])
    q, k = torch.zeros(2, HEADS, DIM), torch.zeros(2, KV_HEADS, DIM)
    with pytest.raises(ValueError, match=r"alibi_slopes must hold one slope per query head, shape \(4,\); got \(2,\)"):
        run_op(cache, meta, q, k, k, alibi_slopes=torch.zeros(KV_HEADS))


class OpLog(TorchDispatchMode):
    """Records every ATen op run under it."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append((func, args))
        return func(*args, **(kwargs or {}))


def test_op_body_has_no_host_sync_and_static_shapes():
    """What a CUDA capture forbids: reading device values on the host, or shapes that depend on them."""
    cache = make_cache()
    meta = pad_step(cache.step_inputs([("a", 0, 5), ("b", 0, 2)]), 1)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(8, h, DIM, generator=g) for h in (HEADS, KV_HEADS, KV_HEADS))
    with OpLog() as log:
        kv.write_kv(k, v, cache.key_caches[0], cache.value_caches[0], meta[kv.SLOT_MAPPING])
        attention.attend(q, cache.key_caches[0], cache.value_caches[0], meta[kv.POSITIONS], meta[kv.REQUEST_INDEX],
                  meta[kv.BLOCK_TABLES], SCALE, sliding_window=3)
    names = {op._schema.name for op, _ in log.ops}
    assert {"aten::index_copy_", "aten::_softmax", "aten::bmm"} <= names, names  # the log saw the body
    host = {"aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::masked_select", "aten::is_nonzero"}
    assert not names & host, names & host
    for op, args in log.ops:
        if op._schema.name in ("aten::index", "aten::index_put", "aten::index_put_"):  # long indices only: no mask
            assert all(i is None or i.dtype == torch.long for i in args[1]), args[1]
        else:
            assert torch.Tag.dynamic_output_shape not in op.tags, op


def test_op_outside_a_context_names_what_it_needs():
    q = torch.zeros(1, HEADS, DIM)
    with pytest.raises(RuntimeError, match="needs a PagedAttentionMetadata as `attn_metadata`"):
        torch.ops.pb_kv.paged_attention(q, q[:, :KV_HEADS], q[:, :KV_HEADS], torch.empty_like(q), 0, SCALE, -1)


def test_op_checks_layer_and_head_shapes():
    cache = make_cache()
    meta = cache.step_inputs([("a", 0, 2)])
    q, k = torch.zeros(2, HEADS, DIM), torch.zeros(2, KV_HEADS, DIM)
    with pb.set_forward_context(attn_metadata=cache.metadata(meta)):
        with pytest.raises(ValueError, match="layer 1 out of range; the cache has 1 layers"):
            torch.ops.pb_kv.paged_attention(q, k, k, torch.empty_like(q), 1, SCALE, -1)
        with pytest.raises(ValueError, match=r"k has \(kv_heads, head_dim\) \(4, 8\), the cache holds \(2, 8\)"):
            torch.ops.pb_kv.paged_attention(q, q, q, torch.empty_like(q), 0, SCALE, -1)


class PagedAttnModel(torch.nn.Module):
    """x (tokens, hidden) -> qkv -> paged attention per layer -> projection."""

    def __init__(self, layers: int = 2):
        super().__init__()
        torch.manual_seed(0)
        hidden = HEADS * DIM
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(hidden, (HEADS + 2 * KV_HEADS) * DIM) for _ in range(layers))
        self.proj = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        for i, (qkv, proj) in enumerate(zip(self.qkv, self.proj)):
            q, k, v = qkv(x).split([HEADS * DIM, KV_HEADS * DIM, KV_HEADS * DIM], dim=-1)
            out = torch.empty(n, HEADS, DIM, device=x.device)
            torch.ops.pb_kv.paged_attention(q.reshape(n, HEADS, DIM), k.reshape(n, KV_HEADS, DIM),
                                            v.reshape(n, KV_HEADS, DIM), out, i, SCALE, -1)
            x = x + proj(out.reshape(n, HEADS * DIM))
        return x


@pytest.mark.parametrize("backend", ["auto", "one_block_chunks", "reference"])
@pytest.mark.parametrize("platform", ["simulated", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_full_graph_replays_later_decode_steps_from_persistent_buffers(platform, backend, monkeypatch):
    """Capture one FULL decode graph, then replay it for later steps whose metadata changed in place.

    A real CUDA graph replays the kernels on the capture-time addresses: the op must read every
    per-step value from the persistent buffers, and new blocks must show up through them. With
    one-block chunks, the captured online softmax runs over several chunks (the static bound).
    """
    monkeypatch.setitem(attention.backends._BACKENDS, "one_block_chunks", attention.AttentionBackend(
        "one_block_chunks", attention.BoundedAttention(graph_chunk_keys=BLOCK), pb.AttentionGraphSupport.ALWAYS))
    device = "cuda" if platform == "cuda" else "cpu"
    model = PagedAttnModel().to(device)
    cache = make_cache(layers=2, device=device, attention_backend=backend)
    ref_cache = make_cache(layers=2, device=device, attention_backend="reference")
    fragment(cache), fragment(ref_cache)
    g = torch.Generator().manual_seed(1)
    prompts = {"a": 3, "b": 6}  # prefilled eagerly; then 4 decode steps of 2 tokens (b crosses a block edge)
    pads = {i.name: i.pad for i in cache.static_inputs()}
    names = (kv.POSITIONS, kv.SLOT_MAPPING, kv.REQUEST_INDEX)
    buffers = {name: torch.full((2,), pads[name], dtype=torch.long, device=device) for name in names}
    buffers[kv.BLOCK_TABLES] = torch.zeros(4, cache.max_blocks_per_req, dtype=torch.long, device=device)  # max_num_reqs rows
    x_static = torch.zeros(2, HEADS * DIM, device=device)
    with torch.no_grad():
        for c in (cache, ref_cache):
            meta = c.step_inputs([(r, 0, n) for r, n in prompts.items()])
            with pb.set_forward_context(attn_metadata=c.metadata(meta)):
                model(torch.randn(sum(prompts.values()), HEADS * DIM, generator=torch.Generator().manual_seed(0)).to(device))
        config = SIM if platform == "simulated" else pb.CompilationConfig(platform="cuda")
        wrapper = pb.CUDAGraphWrapper(model, pb.CUDAGraphMode.FULL, config=config)
        desc = pb.BatchDescriptor(2, num_reqs=2, uniform=True)
        for step in range(4):
            chunks = [(r, n + step, 1) for r, n in prompts.items()]
            x = torch.randn(2, HEADS * DIM, generator=g).to(device)
            meta = cache.step_inputs(chunks)
            for name, t in meta.items():
                buffers[name][: t.shape[0]].copy_(t)  # in place: the graph keeps these addresses
            x_static.copy_(x)
            with pb.expect(captures=int(step == 0), replays=1):
                with pb.set_forward_context(pb.CUDAGraphMode.FULL, desc, attn_metadata=cache.metadata(buffers)):
                    out = wrapper(x_static).clone()
            with pb.set_forward_context(attn_metadata=ref_cache.metadata(ref_cache.step_inputs(chunks))):
                expected = model(x)
            assert_close(out, expected)
        assert len(cache.tables["b"]) == 3  # a block was added mid-decode, seen through the buffers
        for c, rc in zip(cache.key_caches + cache.value_caches, ref_cache.key_caches + ref_cache.value_caches):
            assert_close(c[:-1], rc[:-1])


def test_is_a_splitting_op_and_splits_the_graph():
    assert "pb_kv::paged_attention" in pb.registered_splitting_ops()
    compiled, backend = compile_model(PagedAttnModel(), pb.CompilationConfig(compile_pieces="eager"))
    cache = make_cache(layers=2)
    meta = cache.step_inputs([("a", 0, 5)])
    x = torch.randn(5, HEADS * DIM)
    with torch.no_grad(), pb.set_forward_context(attn_metadata=cache.metadata(meta)):
        compiled(x)
    assert [p.is_splitting for p in backend.splits[0].pieces] == [False, True, False, True, False]


# --- micro-batching: each half sees only its own requests' block tables -----------------------


def _ubatch_runner(mode: str, max_num_reqs: int, **kw) -> tuple[pb.GraphRunner, PagedTinyLM, kv.PagedKVCache]:
    model = PagedTinyLM().eval()
    cache = paged_cache(model)
    config = pb.CompilationConfig(
        platform="simulated", compile_pieces="eager", cudagraph_mode=mode, capture_sizes=[2, 4, 8],
        use_ubatching=True, dbo_decode_token_threshold=2, **kw,
    )
    runner = pb.GraphRunner(
        torch.compile(model, backend=pb.make_backend(config)), config,
        [pb.StaticInput("input_ids"), *cache.static_inputs()], model_args=["input_ids"], context_fn=cache.context_fn,
        max_num_reqs=max_num_reqs,
    )
    return runner, model, cache


def _eager(model: PagedTinyLM, cache: kv.PagedKVCache, chunks: list, ids: torch.Tensor) -> torch.Tensor:
    with pb.set_forward_context(attn_metadata=cache.metadata(cache.step_inputs(chunks))):
        return model(ids)


@pytest.mark.parametrize("max_num_reqs", [4, 8], ids=["max_num_reqs=running", "spare-rows"])
@pytest.mark.parametrize("mode", ["FULL", "NONE"])
def test_micro_batched_decode_steps_match_eager_for_both_halves(mode, max_num_reqs):
    """A decode step of 4 requests split 2 + 2: the second half's tokens read their own block tables.

    Before request_index was rebased per half, tokens 2 and 3 read the first half's rows (logits
    off by ~0.8), or past the end of the second half's rows when max_num_reqs is the running count.
    """
    runner, model, cache = _ubatch_runner(mode, max_num_reqs)
    ref_cache = paged_cache(model)
    lens = [3, 2, 4, 1]
    with torch.inference_mode():
        runner.capture(progress=False)
        chunks, ids = [(r, 0, n) for r, n in enumerate(lens)], torch.arange(sum(lens)) % 64
        runner.run(input_ids=ids, query_lens=lens, **cache.step_inputs(chunks))  # 10 tokens: eager, not split
        _eager(model, ref_cache, chunks, ids)
        for step in range(2):
            chunks, ids = [(r, n + step, 1) for r, n in enumerate(lens)], torch.tensor([1, 2, 3, 4]) + step
            out = runner.run(input_ids=ids, uniform_decode=True, num_reqs=4, **cache.step_inputs(chunks))
            assert runner.last_ubatched and runner.last_mode == pb.CUDAGraphMode[mode]
            assert_close(out, _eager(model, ref_cache, chunks, ids), atol=1e-5, rtol=1e-5)
    for c, rc in zip(cache.key_caches, ref_cache.key_caches):
        assert_close(c[:-1], rc[:-1])


def test_debug_checks_refuse_request_rows_outside_the_step_or_the_half():
    runner, _, cache = _ubatch_runner("NONE", 4, debug_checks=True)
    meta = cache.step_inputs([(r, 0, 1) for r in range(4)])
    ids = torch.tensor([1, 2, 3, 4])
    with torch.inference_mode():
        bad = dict(meta, request_index=torch.tensor([0, 1, 2, 4]))
        with pytest.raises(IndexError, match=r"'request_index' \(request_row=True\) holds request row 4 at token 3 "
                                             r"\(the step has 4 requests\); valid rows are 0..3"):
            runner.run(input_ids=ids, uniform_decode=True, num_reqs=4, **bad)
        crossing = dict(meta, request_index=torch.tensor([0, 2, 2, 3]))  # token 1 is in the first half
        with pytest.raises(IndexError, match=r"request row 2 at token 1 \(micro-batch 0: tokens 0..1, requests 0..1\); "
                                             r"valid rows are 0..1"):
            runner.run(input_ids=ids, uniform_decode=True, num_reqs=4, **crossing)
        out = runner.run(input_ids=ids, uniform_decode=True, num_reqs=4, **meta)  # the right rows pass
    assert runner.last_ubatched and out.shape == (4, 64)


@pytest.mark.parametrize("ubatching", [False, True], ids=["plain", "micro-batched"])
def test_a_cache_swapped_after_capture_is_refused_on_full_replays(ubatching):
    """context_fn hands the attention a reallocated cache: PIECEWISE steps would read the new one, a
    FULL replay the captured one (silently wrong before). Every FULL replay compares context_fn's
    tensors with the capture's; after clear_graphs() and capture() the new cache serves."""
    model = PagedTinyLM().eval()
    cache, ref_cache = paged_cache(model), paged_cache(model)
    config = pb.CompilationConfig(platform="simulated", compile_pieces="eager", capture_sizes=[2, 4, 8],
                                  use_ubatching=ubatching, dbo_decode_token_threshold=2,
                                  cudagraph_mode="FULL_DECODE_ONLY" if ubatching else "FULL_AND_PIECEWISE")
    runner = pb.GraphRunner(torch.compile(model, backend=pb.make_backend(config)), config,
                            [pb.StaticInput("input_ids"), *cache.static_inputs()], model_args=["input_ids"],
                            context_fn=cache.context_fn, max_num_reqs=4)
    lens = [3, 2]

    def decode(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunks, ids = [(r, n + step, 1) for r, n in enumerate(lens)], torch.tensor([7, 9]) + step
        out = runner.run(input_ids=ids, uniform_decode=True, num_reqs=2, **cache.step_inputs(chunks))
        assert runner.last_mode == pb.CUDAGraphMode.FULL and runner.last_ubatched == ubatching
        return out, _eager(model, ref_cache, chunks, ids)

    with torch.inference_mode():
        runner.capture(progress=False)
        chunks, ids = [(r, 0, n) for r, n in enumerate(lens)], torch.arange(5)
        runner.run(input_ids=ids, query_lens=lens, **cache.step_inputs(chunks))
        _eager(model, ref_cache, chunks, ids)
        assert_close(*decode(0))
        cache.key_caches = [c.clone() for c in cache.key_caches]  # e.g. the cache grown or moved
        where = "micro-batch 0: attn_metadata.key_caches[0]" if ubatching else "attn_metadata.key_caches[0]"
        with pytest.raises(ValueError, match=rf"context_fn's '{re.escape(where)}' is not the tensor the FULL graph of "
                                             r"BatchDescriptor\(num_tokens=2.* captured .*clear_graphs\(\) and capture\(\)"):
            decode(1)
        runner.clear_graphs()
        runner.capture(progress=False)
        assert_close(*decode(1))
