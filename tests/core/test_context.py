"""Forward context and BatchDescriptor (DESIGN 2, 4.1)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest
import torch

import piecewise_backend as pb

M = pb.CUDAGraphMode
BD = pb.BatchDescriptor


# ---------------------------------------------------------------- BatchDescriptor


def test_batch_descriptor_defaults_and_fields():
    d = BD(8)
    assert (d.num_tokens, d.num_reqs, d.uniform) == (8, None, False)
    d = BD(8, num_reqs=8, uniform=True)
    assert (d.num_tokens, d.num_reqs, d.uniform) == (8, 8, True)


def test_batch_descriptor_is_frozen():
    d = BD(8, 4, True)
    for field, value in [("num_tokens", 16), ("num_reqs", 1), ("uniform", False)]:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(d, field, value)
    assert d == BD(8, 4, True)


def test_batch_descriptor_is_hashable_by_value():
    table = {BD(8): "mixed", BD(8, num_reqs=8, uniform=True): "decode", BD(16): "mixed16"}
    assert len(table) == 3
    assert table[BD(8)] == "mixed"
    assert table[BD(8, 8, True)] == "decode"
    assert hash(BD(4, 2, True)) == hash(BD(4, 2, True))
    assert BD(8) != BD(8, 8, True)
    assert len({BD(4), BD(4), BD(4, None, False)}) == 1


@pytest.mark.parametrize("desc", [BD(8, 8, True), BD(8, 2, False), BD(8), BD(1, 1, True)])
def test_relax_for_mixed_batch(desc):
    relaxed = desc.relax_for_mixed_batch()
    assert isinstance(relaxed, BD)
    assert (relaxed.num_tokens, relaxed.num_reqs, relaxed.uniform) == (desc.num_tokens, None, False)
    assert relaxed == BD(desc.num_tokens)
    assert relaxed.relax_for_mixed_batch() == relaxed
    # the original is untouched (frozen)
    assert desc.num_tokens == relaxed.num_tokens


@pytest.mark.parametrize(
    "kwargs", [dict(num_tokens=0), dict(num_tokens=-3), dict(num_tokens=2.0), dict(num_tokens=4, num_reqs=0)]
)
def test_batch_descriptor_rejects_bad_counts(kwargs):
    with pytest.raises(ValueError, match="num_tokens|num_reqs"):
        BD(**kwargs)


# ---------------------------------------------------------------- set/get


def test_get_forward_context_outside_raises_clear_error():
    assert not pb.is_forward_context_available()
    with pytest.raises(RuntimeError, match="set_forward_context"):
        pb.get_forward_context()


def test_defaults_and_attrs_readable():
    meta = object()
    with pb.set_forward_context() as ctx:
        assert pb.is_forward_context_available()
        assert pb.get_forward_context() is ctx
        assert ctx.runtime_mode is M.NONE and ctx.batch_descriptor is None
    with pb.set_forward_context(M.PIECEWISE, BD(16), attn_metadata=meta, layer_count=3) as ctx:
        got = pb.get_forward_context()
        assert got.runtime_mode is M.PIECEWISE
        assert got.batch_descriptor == BD(16)
        assert got.attn_metadata is meta
        assert got.layer_count == 3
        with pytest.raises(AttributeError):
            got.not_set  # noqa: B018
    assert not pb.is_forward_context_available()


def test_current_forward_context_is_the_context_or_none_at_the_cost_of_a_contextvar_read():
    assert pb.current_forward_context() is None
    with pb.set_forward_context(M.PIECEWISE, BD(8)) as outer:
        assert pb.current_forward_context() is outer
        with pb.set_forward_context(M.FULL, BD(4, 4, True)) as inner:
            assert pb.current_forward_context() is inner
        assert pb.current_forward_context() is outer
    assert pb.current_forward_context() is None
    # no Python frame on the hot path: the ContextVar's own bound ``get``
    assert type(pb.current_forward_context).__name__ == "builtin_function_or_method"
    seen = []
    with pb.set_forward_context(M.FULL, BD(2)):
        thread = threading.Thread(target=lambda: seen.append(pb.current_forward_context()))
        thread.start()
        thread.join()
    assert seen == [None]  # another thread has its own (empty) context


@pytest.mark.parametrize("mode", [M.NONE, M.PIECEWISE, M.FULL])
def test_mode_index_and_mode_bit_follow_the_runtime_mode(mode):
    with pb.set_forward_context(mode, BD(4), mode_index=99, mode_bit=0, meta="m") as ctx:
        assert (ctx.mode_index, ctx.mode_bit) == (mode.value, 1 << mode.value)  # attrs cannot hide them
        assert pb.context.context_attributes(ctx) == {"mode_index": 99, "mode_bit": 0, "meta": "m"}
        ctx.runtime_mode = M.FULL
        assert (ctx.mode_index, ctx.mode_bit) == (M.FULL.value, 1 << M.FULL.value)


def test_runtime_mode_given_by_name():
    with pb.set_forward_context("full", BD(4, 4, True)) as ctx:
        assert ctx.runtime_mode is M.FULL


@pytest.mark.parametrize("mode", [M.FULL_AND_PIECEWISE, M.FULL_DECODE_ONLY, "FULL_AND_PIECEWISE"])
def test_rejects_configuration_modes_as_runtime_mode(mode):
    with pytest.raises(ValueError, match="runtime_mode"):
        with pb.set_forward_context(mode, BD(8)):
            pytest.fail("body must not run")
    assert not pb.is_forward_context_available()


def test_rejects_unknown_mode():
    with pytest.raises(ValueError):
        with pb.set_forward_context("SOMETIMES", BD(8)):
            pytest.fail("body must not run")


@pytest.mark.parametrize("mode", [M.PIECEWISE, M.FULL])
def test_graph_mode_without_descriptor_is_refused_by_a_capturing_wrapper(mode):
    sim = pb.CompilationConfig(platform="simulated", compile_pieces="eager")
    with pb.set_forward_context(mode) as ctx:
        assert ctx.batch_descriptor is None
        with pytest.raises(ValueError, match="batch_descriptor"):
            pb.BreakableCUDAGraphWrapper(lambda x: x + 1, config=sim)(torch.ones(2))


def test_descriptor_type_checked():
    with pytest.raises(TypeError, match="BatchDescriptor"):
        with pb.set_forward_context(M.PIECEWISE, 8):
            pytest.fail("body must not run")


def test_nesting_restores_outer_and_exceptions_restore_none():
    with pb.set_forward_context(M.PIECEWISE, BD(8), tag="outer"):
        with pb.set_forward_context(M.FULL, BD(4, 4, True), tag="inner"):
            assert pb.get_forward_context().tag == "inner"
        assert pb.get_forward_context().tag == "outer"
        assert pb.get_forward_context().runtime_mode is M.PIECEWISE
    assert not pb.is_forward_context_available()
    with pytest.raises(KeyError):
        with pb.set_forward_context(M.NONE, tag="x"):
            raise KeyError("boom")
    assert not pb.is_forward_context_available()


# ---------------------------------------------------------------- isolation


def test_isolated_across_threads():
    n = 4
    barrier = threading.Barrier(n + 1, timeout=10)
    seen: dict[int, tuple] = {}
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            seen_before = pb.is_forward_context_available()  # the main thread's context must not leak in
            with pb.set_forward_context(M.PIECEWISE, BD(i + 1), who=i):
                barrier.wait()  # every thread (and main) is inside its own context now
                barrier.wait()  # main has checked its own; read ours after everyone set theirs
                ctx = pb.get_forward_context()
                seen[i] = (seen_before, ctx.who, ctx.batch_descriptor)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            barrier.abort()

    with pb.set_forward_context(M.FULL, BD(99, 99, True), who="main"):
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        barrier.wait()
        assert pb.get_forward_context().who == "main"
        barrier.wait()
        for t in threads:
            t.join(10)
        assert pb.get_forward_context().who == "main"
    assert not errors, errors
    assert seen == {i: (False, i, BD(i + 1)) for i in range(n)}


def test_isolated_across_asyncio_tasks():
    async def step(i: int, both_inside: asyncio.Event, counter: list[int]):
        with pb.set_forward_context(M.PIECEWISE, BD(i + 1), who=i):
            counter[0] += 1
            if counter[0] == 2:
                both_inside.set()
            await both_inside.wait()  # interleave: the other task has set its own context meanwhile
            await asyncio.sleep(0)
            ctx = pb.get_forward_context()
            return ctx.who, ctx.batch_descriptor

    async def main():
        both_inside, counter = asyncio.Event(), [0]
        results = await asyncio.gather(step(0, both_inside, counter), step(1, both_inside, counter))
        # a task's context does not leak into the caller
        return results, pb.is_forward_context_available()

    results, leaked = asyncio.run(main())
    assert results == [(0, BD(1)), (1, BD(2))]
    assert not leaked


def test_asyncio_task_inherits_but_does_not_modify_parent_context():
    async def child():
        inherited = pb.get_forward_context().who
        with pb.set_forward_context(M.NONE, who="child"):
            await asyncio.sleep(0)
            inner = pb.get_forward_context().who
        return inherited, inner

    async def main():
        with pb.set_forward_context(M.PIECEWISE, BD(8), who="parent"):
            got = await asyncio.create_task(child())
            return got, pb.get_forward_context().who

    (inherited, inner), after = asyncio.run(main())
    assert (inherited, inner, after) == ("parent", "child", "parent")
