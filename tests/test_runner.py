"""GraphRunner: capture orchestration (DESIGN.md 4.6) and stepping (4.7), on the simulated platform."""

from __future__ import annotations

import gc
from unittest import mock

import pytest
import torch
from torch.testing import assert_close

import piecewise_backend as pb
from piecewise_backend.platforms import cuda as cuda_platform
from tests.helpers import SIM, make_model, token_ids, torch_threads

M = pb.CUDAGraphMode
BD = pb.BatchDescriptor
SIZES = [1, 2, 4, 8]


_REAL_COLLECT = gc.collect


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with torch_threads(1):
        yield


@pytest.fixture(autouse=True)
def _cheap_gc(request, monkeypatch):
    # capture() collects once; with Dynamo, pytest and hypothesis loaded a full collection costs
    # up to a second on a shared machine. Only the test about gc needs the real one.
    if "collects" not in request.fixturenames:
        monkeypatch.setattr(gc, "collect", lambda *a: 0)


@pytest.fixture
def collects(monkeypatch):
    calls = []
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append(a) or _REAL_COLLECT(*a))
    return calls


def cfg(mode=M.FULL_AND_PIECEWISE, **kw) -> pb.CompilationConfig:
    return SIM.replace(cudagraph_mode=mode, capture_sizes=SIZES, **kw)


@pb.eager_break
def _halve(h: torch.Tensor) -> torch.Tensor:
    return h * 0.5 + 1  # a fresh tensor, read by the next segment


class LoggingModel(torch.nn.Module):
    """linear -> break -> linear; logs what each Python-level call saw in its forward context."""

    def __init__(self, dim: int = 8):
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2 = torch.nn.Linear(dim, dim), torch.nn.Linear(dim, dim)
        self.log: list[dict] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if pb.is_forward_context_available():
            ctx = pb.get_forward_context()
            self.log.append(
                dict(
                    mode=ctx.runtime_mode,
                    desc=ctx.batch_descriptor,
                    tokens=x.shape[0],
                    frozen=gc.get_freeze_count(),
                    gc_outside=cuda_platform.gc_managed_outside,
                    tag=getattr(ctx, "tag", None),
                )
            )
        return self.l2(_halve(torch.relu(self.l1(x))))


class TableModel(torch.nn.Module):
    """``forward(ids, table)``: table is (tokens, width), any width; zero columns change nothing."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(32, 8)
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        h = _halve(self.emb(ids))
        return self.lin(h) * (table.sum(-1, keepdim=True) + 1)


def x_input():
    return [pb.StaticInput("x", shape=(8,), dtype=torch.float32)]


def rand(n: int, *shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, *shape, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- capture orchestration


@pytest.mark.parametrize("num_warmups", [0, 2])
def test_capture_warms_up_and_captures_every_descriptor_largest_first(num_warmups, collects):
    assert gc.get_freeze_count() == 0

    model = LoggingModel()
    runner = pb.GraphRunner(model, cfg(num_warmups=num_warmups), x_input())
    with torch.no_grad():
        with pb.expect(captures=8):
            report = runner.capture(progress=False)
    assert gc.get_freeze_count() == 0
    assert len(collects) == 1  # once for the whole capture, not per graph or segment

    pw = [BD(8), BD(4), BD(2), BD(1)]
    full = [BD(8, 8, True), BD(4, 4, True), BD(2, 2, True), BD(1, 1, True)]
    expected = [
        (m, d) for m, descs in ((M.PIECEWISE, pw), (M.FULL, full)) for d in descs for m in [M.NONE] * num_warmups + [m]
    ]
    assert [(e["mode"], e["desc"]) for e in model.log] == expected
    assert all(e["tokens"] == e["desc"].num_tokens for e in model.log)
    assert all(e["frozen"] > 0 for e in model.log), "gc must be frozen for the whole capture, warmups included"
    assert all(e["gc_outside"] for e in model.log)
    assert cuda_platform.gc_managed_outside is False

    outer, inner = runner.model, runner.model.runnable
    assert isinstance(outer, pb.CUDAGraphWrapper) and isinstance(inner, pb.BreakableCUDAGraphWrapper)
    assert set(outer.entries) == set(full)
    assert set(inner.entries) == set(pw)
    assert report is runner.report
    assert report.graphs == len(outer.entries) + len(inner.entries) == 8
    assert report.seconds > 0
    assert "ATen ops" in report.stats


def test_capture_disables_capture_after_startup():
    model = LoggingModel()
    runner = pb.GraphRunner(model, cfg(), x_input())
    with torch.no_grad():
        runner.capture(progress=False)
        outer, inner = runner.model, runner.model.runnable
        x3 = rand(3, 8)
        ref = model(x3)
        # captured sizes keep working through the runner, replaying without capturing
        with pb.expect(captures=0, replays=1):
            out = runner.run(x=x3)
        assert runner.last_mode is M.PIECEWISE
        assert_close(out, ref)
        with pb.expect(captures=0, replays=1):
            out = runner.run(x=x3, uniform_decode=True, num_reqs=3)
        assert runner.last_mode is M.FULL
        assert_close(out, ref)

        # a new descriptor under the runner's closed capture raises (called directly here)
        before = (set(outer.entries), set(inner.entries))
        for mode, desc in ((M.FULL, BD(3, 3, True)), (M.PIECEWISE, BD(3))):
            with pytest.raises(pb.CaptureDisabledError, match=r"BatchDescriptor\(num_tokens=3"):
                with pb.set_forward_context(mode, desc, allow_capture=False):
                    runner.model(x3)
        assert (set(outer.entries), set(inner.entries)) == before

        # a descriptor with no graph now raises through run() instead of capturing mid-serving
        inner.clear_graphs()
        with pytest.raises(pb.CaptureDisabledError, match=r"BatchDescriptor\(num_tokens=4"):
            runner.run(x=x3)
        assert inner.entries == {}
        outer.entries.pop(BD(4, 4, True))
        with pytest.raises(pb.CaptureDisabledError, match="FULL"):
            runner.run(x=x3, uniform_decode=True)
        assert BD(4, 4, True) not in outer.entries
        # steps that still have graphs are unaffected
        x8 = rand(8, 8, seed=1)
        assert_close(runner.run(x=x8, uniform_decode=True), model(x8))
        assert runner.last_mode is M.FULL


def test_global_capture_switch_makes_unseen_descriptors_raise():
    model = LoggingModel()
    runner = pb.GraphRunner(model, cfg(), x_input())
    with torch.no_grad():
        runner.capture(progress=False)
        pb.set_capture_enabled(False)
        assert not pb.capture_enabled()
        before = (set(runner.model.entries), set(runner.model.runnable.entries))
        for mode, desc in ((M.FULL, BD(3, 3, True)), (M.PIECEWISE, BD(3))):
            with pytest.raises(pb.CaptureDisabledError, match="BatchDescriptor"):
                with pb.set_forward_context(mode, desc):
                    runner.model(rand(3, 8))
        assert (set(runner.model.entries), set(runner.model.runnable.entries)) == before
        x = rand(2, 8)
        assert_close(runner.run(x=x), model(x))


def test_closing_one_runner_does_not_stop_another_from_capturing():
    first = pb.GraphRunner(LoggingModel(), cfg(M.PIECEWISE), x_input())
    second = pb.GraphRunner(LoggingModel(), cfg(M.PIECEWISE), x_input())
    with torch.no_grad():
        first.capture(progress=False)
        with pb.expect(captures=4):
            second.capture(progress=False)
    assert len(second.model.entries) == 4


def test_capture_can_leave_capture_enabled():
    model = LoggingModel()
    runner = pb.GraphRunner(model, cfg(M.PIECEWISE), x_input())
    with torch.no_grad():
        runner.capture(progress=False, disable_after=False)
        runner.model.clear_graphs()
        x = rand(3, 8)
        with pb.expect(captures=1):
            out = runner.run(x=x)
        assert_close(out, model(x))
    assert list(runner.model.entries) == [BD(4)]


# ---------------------------------------------------------------- stepping: toy model


@pytest.fixture(scope="module")
def toy_runner():
    model = make_model(2, "break")
    runner = pb.GraphRunner(model, cfg(), [pb.StaticInput("input_ids")])
    with torch.no_grad(), mock.patch.object(gc, "collect", lambda *a: 0):
        runner.capture(progress=False)
    return model, runner


@pytest.mark.parametrize("n", [1, 3, 5, 8])
def test_run_mixed_step_replays_piecewise(toy_runner, n):
    model, runner = toy_runner
    ids = token_ids(n, seed=n)
    with torch.no_grad():
        ref = model(ids)
        with pb.expect(captures=0, replays=1, eager_PIECEWISE=1):
            out = runner.run(input_ids=ids)
    assert runner.last_mode is M.PIECEWISE
    assert out.shape == (n, 128)
    assert_close(out, ref)


@pytest.mark.parametrize("n", [1, 3, 5, 8])
def test_run_uniform_decode_step_replays_full(toy_runner, n):
    model, runner = toy_runner
    ids = token_ids(n, seed=10 + n)
    with torch.no_grad():
        ref = model(ids)
        with pb.expect(captures=0, replays=1):
            out = runner.run(input_ids=ids, uniform_decode=True, num_reqs=n)
    assert runner.last_mode is M.FULL
    assert out.shape == (n, 128)
    assert_close(out, ref)


@pytest.mark.parametrize("uniform", [False, True])
def test_run_above_largest_size_is_eager(toy_runner, uniform):
    model, runner = toy_runner
    ids = token_ids(11, seed=3)
    with torch.no_grad():
        ref = model(ids)
        with pb.expect(captures=0, replays=0):
            out = runner.run(input_ids=ids, uniform_decode=uniform)
    assert runner.last_mode is M.NONE
    assert_close(out, ref)


def test_run_alternating_steps_do_not_disturb_each_other(toy_runner):
    model, runner = toy_runner
    steps = [(4, True), (3, False), (8, False), (2, True), (9, False), (4, True)]
    with torch.no_grad():
        for i, (n, uniform) in enumerate(steps):
            ids = token_ids(n, seed=100 + i)
            out = runner.run(input_ids=ids, uniform_decode=uniform)
            assert_close(out, model(ids), msg=lambda m: f"step {i} ({n}, uniform={uniform}): {m}")


# ---------------------------------------------------------------- stepping: static buffer shapes


@pytest.fixture
def table_runner():
    model = TableModel()
    inputs = [pb.StaticInput("ids", pad=5), pb.StaticInput("table", shape=(4,), dtype=torch.float32)]
    seen = []
    runner = pb.GraphRunner(model, cfg(), inputs, context_fn=lambda views: seen.append(views) or {})
    with torch.no_grad():
        runner.capture(progress=False)
    seen.clear()
    return model, runner, seen


def test_wider_non_token_dim_runs_eagerly(table_runner):
    model, runner, _ = table_runner
    ids, table = torch.tensor([1, 2, 3]), rand(3, 6)
    with torch.no_grad():
        with pb.expect(replays=0, captures=0):
            out = runner.run(ids=ids, table=table)
        assert runner.last_mode is M.NONE
        assert_close(out, model(ids, table))
        assert runner.buffers["table"].shape == (8, 4)


def test_narrower_non_token_dim_is_padded_into_the_buffers(table_runner):
    model, runner, seen = table_runner
    ids, table = torch.tensor([1, 2, 3]), rand(3, 2)
    with torch.no_grad():
        with pb.expect(replays=1, captures=0):
            out = runner.run(ids=ids, table=table)
        assert runner.last_mode is M.PIECEWISE
        assert_close(out, model(ids, table))
    # the step's views are padded to 4 rows and 4 columns: pad values, data in the corner
    (views,) = seen
    assert views["ids"].tolist() == [1, 2, 3, 5]
    assert views["table"].shape == (4, 4)
    assert_close(views["table"][:3, :2], table)
    assert views["table"][3].eq(0).all() and views["table"][:, 2:].eq(0).all()


def test_stale_buffer_data_does_not_leak_into_smaller_steps(table_runner):
    model, runner, seen = table_runner
    with torch.no_grad():
        runner.run(ids=torch.arange(8), table=rand(8, 4, seed=1))
        ids, table = torch.tensor([4, 5]), rand(2, 3, seed=2)
        out = runner.run(ids=ids, table=table, uniform_decode=True)
        assert runner.last_mode is M.FULL
        assert_close(out, model(ids, table))
    assert seen[-1]["table"][:, 3].eq(0).all()


def test_bad_inputs_raise_naming_them(table_runner):
    _, runner, _ = table_runner
    ids, table = torch.tensor([1, 2, 3]), rand(3, 4)
    with pytest.raises(ValueError, match=r"missing inputs \['table'\]"):
        runner.run(ids=ids)
    with pytest.raises(ValueError, match=r"unknown inputs \['mask'\]"):
        runner.run(ids=ids, table=table, mask=table)
    with pytest.raises(ValueError, match=r"token count.*'ids': 3.*'table': 2"):
        runner.run(ids=ids, table=table[:2])
    with pytest.raises(ValueError, match="num_tokens"):
        runner.run(ids=ids, table=table, uniform_decode=True, num_reqs=2)


def test_context_reaches_the_model_on_eager_steps():
    model = LoggingModel()
    runner = pb.GraphRunner(model, cfg(), x_input(), context_fn=lambda views: {"tag": ("fn", views["x"].shape[0])})
    with torch.no_grad():
        runner.run(x=rand(9, 8))
        assert model.log[-1]["tag"] == ("fn", 9) and model.log[-1]["mode"] is M.NONE
        runner.run(x=rand(9, 8), context={"tag": "override"})
        assert model.log[-1]["tag"] == "override"


# ---------------------------------------------------------------- construction


def test_runner_resolves_mode_for_attention_support():
    model = LoggingModel()
    r = pb.GraphRunner(model, cfg(M.FULL), x_input(), attention_support=pb.AttentionGraphSupport.UNIFORM_BATCH)
    assert r.mode is M.FULL_AND_PIECEWISE
    assert isinstance(r.model, pb.CUDAGraphWrapper) and isinstance(r.model.runnable, pb.BreakableCUDAGraphWrapper)
    r = pb.GraphRunner(model, cfg(), x_input(), attention_support=pb.AttentionGraphSupport.NEVER)
    assert r.mode is M.PIECEWISE and isinstance(r.model, pb.BreakableCUDAGraphWrapper)
    r = pb.GraphRunner(model, cfg(), x_input(), attention_support=pb.AttentionGraphSupport.NEVER, attention_split=False)
    assert r.mode is M.NONE and r.model is model
    with torch.no_grad():
        x = rand(3, 8)
        assert_close(r.run(x=x, uniform_decode=True), model(x))
    assert r.last_mode is M.NONE
    with pytest.raises(ValueError, match="NEVER"):
        pb.GraphRunner(model, cfg(M.FULL), x_input(), attention_support=pb.AttentionGraphSupport.NEVER)


def test_drafter_runner_only_dispatches_piecewise():
    model = LoggingModel()
    r = pb.GraphRunner(model, cfg(M.FULL), x_input(), drafter=True)
    assert isinstance(r.model, pb.BreakableCUDAGraphWrapper) and r.model.runnable is model
    with torch.no_grad():
        report = r.capture(progress=False)
        assert report.graphs == 4
        x = rand(3, 8)
        with pb.expect(captures=0, replays=1):
            out = r.run(x=x, uniform_decode=True, num_reqs=3)
        assert r.last_mode is M.PIECEWISE
        assert_close(out, model(x))


def test_runner_construction_errors():
    model = LoggingModel()
    with pytest.raises(ValueError, match="at least one StaticInput"):
        pb.GraphRunner(model, cfg(), [])
    with pytest.raises(ValueError, match="unique"):
        pb.GraphRunner(model, cfg(), x_input() * 2)
    with pytest.raises(ValueError, match=r"model_args \['y'\]"):
        pb.GraphRunner(model, cfg(), x_input(), model_args=["y"])
    with pytest.raises(ValueError, match="identifier"):
        pb.StaticInput("not a name")
    with pytest.raises(ValueError, match="positive ints"):
        pb.StaticInput("x", shape=(0,))


def test_padding_rows_hold_the_pad_value_not_the_previous_step():
    model = LoggingModel()
    inputs = [pb.StaticInput("x", shape=(8,), dtype=torch.float32, pad=-3.0)]
    runner = pb.GraphRunner(model, cfg(), inputs)
    runner.capture(progress=False)
    big, small = rand(8, 8, seed=1), rand(3, 8, seed=2)
    runner.run(x=big)
    assert runner.last_mode is M.PIECEWISE
    out = runner.run(x=small)  # 3 tokens run at a captured size > 3: rows 3.. are padding
    padded = runner.dispatcher.pad(3)
    assert padded > 3
    buf = runner.buffers["x"]
    assert torch.equal(buf[:3], small)
    assert torch.equal(buf[3:padded], torch.full((padded - 3, 8), -3.0))
    assert_close(out, model(small))
