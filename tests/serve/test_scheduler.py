"""The step planner (serve/scheduler.py) on a bare paged cache: token budget, decode first, chunked
prefill, preemption of the newest request, and the up-front refusal of a request that cannot fit."""

from __future__ import annotations

import pytest

from piecewise_backend import kv
from piecewise_backend.serve.sampling import GREEDY
from piecewise_backend.serve.scheduler import Request, Scheduler


def make(num_blocks: int = 16, block: int = 4, reqs: int = 4, budget: int = 8) -> Scheduler:
    cache = kv.PagedKVCache(1, 1, 4, num_blocks=num_blocks, block_size=block, max_model_len=64)
    return Scheduler(cache, reqs, budget)


def request(order: int, prompt_len: int, new: int = 8) -> Request:
    return Request(order, list(range(1, prompt_len + 1)), new, GREEDY, 0, frozenset(), order)


def run(s: Scheduler, produce: bool = True) -> list[tuple[int, int, int]]:
    """Plan a step and apply it as the serving loop does (one token for each chunk that ends its sequence)."""
    plan = s.schedule()
    for r, start, count in plan.chunks:
        r.computed = start + count
        if produce and r.computed == r.length:
            r.output.append(7)
    return [(r.order, start, count) for r, start, count in plan.chunks]


def test_a_long_prompt_is_prefilled_in_chunks_and_decode_tokens_go_first():
    s = make(budget=8)
    a, b = request(0, 3), request(1, 20)
    s.add(a)
    s.add(b)
    assert run(s) == [(0, 0, 3), (1, 0, 5)]  # a's whole prompt, b's first chunk
    assert run(s) == [(0, 3, 1), (1, 5, 7)]  # a's decode token first, then what the budget leaves
    assert run(s) == [(0, 4, 1), (1, 12, 7)]
    assert run(s) == [(0, 5, 1), (1, 19, 1)]  # b's last prompt token: its first output comes now
    assert b.output == [7] and all(len(r.output) for r in (a, b))


def test_every_step_stays_within_the_request_and_token_budgets():
    s = make(budget=6, reqs=2)
    for i, n in enumerate((9, 2, 4)):
        s.add(request(i, n, new=3))
    seen = []
    while s.has_unfinished():
        step = run(s)
        seen.append(step)
        assert sum(c for _, _, c in step) <= 6 and len(step) <= 2
        for r in list(s.running):
            if len(r.output) >= r.max_new_tokens:
                s.remove(r)
    assert seen[0] == [(0, 0, 6)]  # the third request waits for a free request row
    assert s.cache.num_free_blocks == 16 and s.cache.tables == {}


def test_when_blocks_run_out_the_newest_request_is_preempted_and_recomputed():
    s = make(num_blocks=4, block=4, budget=16)
    old, new = request(0, 7), request(1, 7)
    s.add(old)
    s.add(new)
    assert run(s) == [(0, 0, 7), (1, 0, 7)]  # 2 blocks each: the cache is full
    assert run(s) == [(0, 7, 1), (1, 7, 1)]  # position 7 still fits the second block
    plan = s.schedule()  # position 8 needs a third block for each: the newest gives its blocks up
    assert [r.order for r in plan.preempted] == [1] and [(r.order, st, c) for r, st, c in plan.chunks] == [(0, 8, 1)]
    assert new.computed == 0 and new.output == [7, 7] and list(s.waiting) == [new] and new.preemptions == 1
    old.computed = 9
    old.output.append(7)
    s.remove(old)  # finished: its blocks come back
    assert run(s) == [(1, 0, 9)]  # prompt and both tokens recomputed in one chunk, then it continues
    assert new.output == [7, 7, 7]


def test_a_request_preempted_for_itself_waits_instead_of_evicting_older_ones():
    s = make(num_blocks=3, block=4, budget=16)
    old, new = request(0, 7, new=4), request(1, 3, new=4)
    s.add(old)
    s.add(new)
    run(s)  # old holds 2 blocks, new 1: the cache is full
    new.computed, new.output = 4, [7, 7]  # new reaches position 4: one block more
    plan = s.schedule()
    assert [r.order for r in plan.preempted] == [1] and [(r.order, st, c) for r, st, c in plan.chunks] == [(0, 7, 1)]
    assert s.running == [old] and list(s.waiting) == [new]


def test_a_request_that_cannot_fit_even_alone_is_refused_up_front():
    s = make(num_blocks=3, block=4)
    with pytest.raises(ValueError, match=r"a request: 10 prompt tokens \+ 4 new need 4 KV blocks of 4 tokens \(13 tokens of K/V\), "
                                         r"but the cache has 3 blocks in all"):
        s.add(request(0, 10, new=4))
    s.add(request(1, 9, new=4))  # 12 tokens of K/V: exactly 3 blocks
    assert len(s.waiting) == 1


def test_a_planned_chunk_of_the_request_preempted_later_in_the_plan_is_taken_back():
    """The newest request's decode chunk is planned first; then an older, recomputing request needs
    blocks: the newest is preempted and its chunk's tokens return to the budget."""
    s = make(num_blocks=4, block=4, budget=8)
    old, new = request(0, 12, new=2), request(1, 8, new=4)
    new.output = [7]
    old.computed, new.computed = 4, 8
    s.cache.reserve(old.slot, 4)
    s.cache.reserve(new.slot, 8)
    s.running = [old, new]
    plan = s.schedule()
    assert [(r.order, st, c) for r, st, c in plan.chunks] == [(0, 4, 8)] and plan.preempted == [new]
    assert s.cache.tables == {old.slot: s.cache.tables[old.slot]} and len(s.cache.tables[old.slot]) == 3


def test_request_tokens_read_the_prompt_then_the_output_without_joining_them():
    r = request(0, 4)
    r.output += [10, 11, 12]
    whole = r.prompt + r.output
    for start in range(len(whole)):
        assert r.token(start) == whole[start]
        for count in range(1, len(whole) - start + 2):  # past the end: cut, as a slice
            assert r.tokens(start, count) == whole[start:start + count]


def test_a_decode_step_that_crosses_into_a_new_block_reserves_it():
    """A request in decode holds its blocks (nothing to reserve) until its next token starts a block."""
    s = make(num_blocks=16, block=4)
    r = request(0, 3)
    s.add(r)
    assert run(s) == [(0, 0, 3)] and len(s.cache.tables[0]) == 1
    assert run(s) == [(0, 3, 1)] and len(s.cache.tables[0]) == 1  # position 3: the first block's last slot
    assert run(s) == [(0, 4, 1)] and len(s.cache.tables[0]) == 2
