"""Indexed (sparse) attention ops (kv/indexed.py) against a dense reference of the same math."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

import piecewise_backend as pb
from piecewise_backend import kv

HEADS, KV_HEADS, DIM, BLOCK, INDEX_HEADS, INDEX_DIM, TOPK = 4, 2, 8, 4, 3, 8, 5
SCALE = DIM**-0.5


def make_cache(max_model_len: int = 32) -> kv.PagedKVCache:
    cache = kv.PagedKVCache(
        1, KV_HEADS, DIM, num_blocks=32, block_size=BLOCK, max_model_len=max_model_len, indexer_dim=INDEX_DIM
    )
    for r in range(4):  # a free list out of order: requests get non-contiguous blocks
        cache.reserve(("frag", r), 2 * BLOCK)
    for r in (2, 0, 3, 1):
        cache.free(("frag", r))
    return cache


def dense(q, k, v, iq, ik, w):
    """One whole request, written out: index scores over the causal prefix, top-k, attention over the chosen."""
    n = q.shape[0]
    scores = torch.relu(torch.einsum("thd,ld->thl", iq, ik) * INDEX_DIM**-0.5)
    index = torch.einsum("th,thl->tl", w, scores)
    causal = torch.arange(n)[None, :] <= torch.arange(n)[:, None]
    index = index.masked_fill(~causal, float("-inf"))
    chosen = torch.zeros(n, n, dtype=torch.bool)
    chosen.scatter_(1, index.topk(min(TOPK, n), dim=-1).indices, True)
    keep = chosen & causal
    kk, vv = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
    att = (torch.einsum("qhd,khd->hqk", q, kk) * SCALE).masked_fill(~keep, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", att, vv), keep


def run_steps(cache, requests, chunks_per_step):
    """Feed each request's tokens in the given chunks (chunked prefill, then decode); the ops' outputs per token."""
    outs = {r: [] for r in requests}
    for chunks in chunks_per_step:
        inputs = cache.step_inputs([(r, start, n) for r, start, n in chunks])
        rows = [(r, start, n) for r, start, n in chunks]
        q, k, v, iq, ik, w = (
            torch.cat([requests[r][x][s:s + n] for r, s, n in rows]) for x in ("q", "k", "v", "iq", "ik", "w")
        )
        selected = torch.empty(q.shape[0], TOPK, dtype=torch.long)
        out = torch.empty_like(q)
        with pb.set_forward_context(attn_metadata=cache.metadata(inputs)):
            torch.ops.pb_kv.indexer_topk(iq, ik, w, selected, 0, INDEX_DIM**-0.5)
            torch.ops.pb_kv.indexed_attention(q, k, v, out, selected, 0, SCALE)
        at = 0
        for r, s, n in rows:
            outs[r].append(out[at:at + n])
            at += n
    return {r: torch.cat(o) for r, o in outs.items()}


def request(n: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    # positive index queries and keys: no score is cut to 0 by the relu, so no two keys tie for a place
    return {"q": r(n, HEADS, DIM), "k": r(n, KV_HEADS, DIM), "v": r(n, KV_HEADS, DIM),
            "iq": r(n, INDEX_HEADS, INDEX_DIM).abs(), "ik": r(n, INDEX_DIM).abs(), "w": r(n, INDEX_HEADS)}


def test_chunked_prefill_and_decode_of_two_requests_match_the_dense_selection():
    cache = make_cache()
    reqs = {"a": request(14, 0), "b": request(11, 1)}
    steps = [[("a", 0, 6), ("b", 0, 9)], [("a", 6, 5), ("b", 9, 1)], [("b", 10, 1), ("a", 11, 1)], [("a", 12, 2)]]
    got = run_steps(cache, reqs, steps)
    for name, length in (("a", 14), ("b", 11)):
        want, keep = dense(*(reqs[name][x] for x in ("q", "k", "v", "iq", "ik", "w")))
        assert_close(got[name], want, rtol=1e-4, atol=1e-5)
        assert (keep.sum(-1) < torch.arange(1, length + 1)).any()  # the selection really dropped tokens


def test_a_prefix_shorter_than_topk_pads_with_minus_one():
    cache = make_cache()
    r = request(3, 2)
    inputs = cache.step_inputs([("x", 0, 3)])
    selected = torch.empty(3, TOPK, dtype=torch.long)
    with pb.set_forward_context(attn_metadata=cache.metadata(inputs)):
        torch.ops.pb_kv.indexer_topk(r["iq"], r["ik"], r["w"], selected, 0, 1.0)
    assert (selected[:, 3:] == -1).all() and (selected[0, 1:] == -1).all()
    assert sorted(selected[2, :3].tolist()) == [0, 1, 2]


def test_captured_selection_walks_the_padded_context_and_agrees():
    """Under capture the indexer scores the whole (masked) table: the same picks as the eager, bounded walk."""
    from piecewise_backend.attention import backends

    cache = make_cache(max_model_len=64)
    r = request(10, 3)
    inputs = cache.step_inputs([("x", 0, 10)])
    picks = []
    for captured in (False, True):
        sel = torch.empty(10, TOPK, dtype=torch.long)
        mode = pb.CUDAGraphMode.FULL if captured else pb.CUDAGraphMode.NONE
        with pb.set_forward_context(runtime_mode=mode, attn_metadata=cache.metadata(inputs)):
            assert backends.capturing() is captured
            torch.ops.pb_kv.indexer_topk(r["iq"], r["ik"], r["w"], sel, 0, 1.0)
        picks.append(sel.sort(-1).values)
    assert torch.equal(*picks)


def test_errors_name_the_bad_value():
    cache = kv.PagedKVCache(1, KV_HEADS, DIM, num_blocks=4, block_size=BLOCK, max_model_len=16)
    inputs = cache.step_inputs([("x", 0, 2)])
    with pb.set_forward_context(attn_metadata=cache.metadata(inputs)), pytest.raises(ValueError, match="indexer_dim > 0"):
        torch.ops.pb_kv.indexer_topk(torch.zeros(2, 3, 8), torch.zeros(2, 8), torch.zeros(2, 3), torch.empty(2, 4, dtype=torch.long), 0, 1.0)
    with pytest.raises(ValueError, match="indexer_dim must be an int >= 0"):
        kv.PagedKVCache(1, KV_HEADS, DIM, num_blocks=4, block_size=BLOCK, max_model_len=16, indexer_dim=-1)


def test_the_indexer_cache_counts_in_memory_and_shares_the_blocks():
    with_index = make_cache()
    plain = kv.PagedKVCache(1, KV_HEADS, DIM, num_blocks=32, block_size=BLOCK, max_model_len=32)
    assert with_index.memory_bytes - plain.memory_bytes == 33 * BLOCK * INDEX_DIM * 4
    assert with_index.indexer_caches[0].shape == (33, BLOCK, INDEX_DIM) and plain.indexer_caches == []
