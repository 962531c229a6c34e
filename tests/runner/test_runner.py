"""GraphRunner: capture orchestration (design.md 4.6) and stepping (4.7), on the simulated platform."""

from __future__ import annotations

import gc
from unittest import mock

import pytest
import torch
from torch.testing import assert_close

import piecewise_backend as pb
from piecewise_backend.capture import gc_managed
from piecewise_backend.inputs import is_persistent
from pbtest.helpers import SIM, make_model, token_ids, torch_threads

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
                    gc_outside=gc_managed(),
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
    assert gc_managed() is False

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


def test_runner_says_what_it_does_not_do_of_its_config(caplog, monkeypatch):
    """Every downgrade is visible: .mode plus one sentence per dropped feature in .downgrades."""
    model = LoggingModel()
    assert pb.GraphRunner(model, cfg(), x_input()).downgrades == ()
    with caplog.at_level("WARNING", logger="piecewise_backend"):
        r = pb.GraphRunner(model, cfg(use_ubatching=True), x_input())
    assert r.mode is M.FULL_DECODE_ONLY
    assert r.downgrades == ("use_ubatching with use_breakable=True: cudagraph_mode FULL_AND_PIECEWISE -> FULL_DECODE_ONLY "
                            "(no breakable wrapper captures PIECEWISE graphs; use_breakable=False keeps per-piece graphs)",)
    assert "FULL_AND_PIECEWISE -> FULL_DECODE_ONLY" in caplog.text
    r = pb.GraphRunner(model, cfg(M.FULL), x_input(), attention_support=pb.AttentionGraphSupport.UNIFORM_BATCH)
    assert r.downgrades == ("attention support UNIFORM_BATCH: cudagraph_mode FULL -> FULL_AND_PIECEWISE",)
    r = pb.GraphRunner(model, cfg(M.FULL, use_ubatching=True, dbo_prefill_token_threshold=4), x_input())
    assert r.mode is M.FULL and r.downgrades == (
        "use_ubatching: micro-batched steps with a prompt of 4+ tokens (FULL) run eagerly in two threads, without a "
        "graph (only uniform decode steps dispatched FULL replay micro-batched graphs)",)
    r = pb.GraphRunner(model, cfg(use_ubatching=True), x_input(), drafter=True)
    assert r.downgrades == ("use_ubatching: a drafter's steps are never micro-batched",)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # "auto" on a machine without a GPU
    r = pb.GraphRunner(model, cfg(platform="auto", compile_pieces="inductor"), x_input())
    assert r.mode is M.NONE and r.downgrades == ("platform 'auto' finds no GPU: cudagraph_mode FULL_AND_PIECEWISE -> NONE",)


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
    with pytest.raises(ValueError, match="at least one per='token' StaticInput"):
        pb.GraphRunner(model, cfg(), [])
    with pytest.raises(ValueError, match="at least one per='token' StaticInput.*'r'"):
        pb.GraphRunner(model, cfg(), [pb.StaticInput("r", per="request")], max_num_reqs=2)
    with pytest.raises(ValueError, match="unique"):
        pb.GraphRunner(model, cfg(), x_input() * 2)
    with pytest.raises(ValueError, match=r"model_args \['y'\]"):
        pb.GraphRunner(model, cfg(), x_input(), model_args=["y"])
    with pytest.raises(ValueError, match="identifier"):
        pb.StaticInput("not a name")
    with pytest.raises(ValueError, match="positive ints"):
        pb.StaticInput("x", shape=(0,))
    with pytest.raises(ValueError, match=r"request_row inputs \['r'\] hold rows of per-request inputs, but this runner has none"):
        pb.GraphRunner(model, cfg(), [*x_input(), pb.StaticInput("r", request_row=True)])


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


# ---------------------------------------------------------------- per-request inputs, keywords, context


class ReqModel(torch.nn.Module):
    """``forward(ids, req_of_token, *, scale)``: token rows scaled by their request's ``scale`` row.

    Logs the shapes it saw; ``scale`` is per request, so it always has ``max_num_reqs`` rows.
    """

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(32, 8)
        self.shapes: list[tuple] = []

    def forward(self, ids: torch.Tensor, req_of_token: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
        self.shapes.append((ids.shape[0], tuple(scale.shape)))
        return _halve(self.emb(ids)) * scale[req_of_token]


def req_inputs() -> list[pb.StaticInput]:
    return [
        pb.StaticInput("ids"),
        pb.StaticInput("req_of_token"),
        pb.StaticInput("scale", shape=(8,), dtype=torch.float32, pad=-7.0, per="request"),
    ]


def test_per_request_inputs_keep_max_num_reqs_rows_in_every_mode():
    model = ReqModel()
    seen = []
    runner = pb.GraphRunner(
        model, cfg(), req_inputs(), model_args=["ids", "req_of_token"], model_kwargs=["scale"], max_num_reqs=3,
        context_fn=lambda v: seen.append({k: t.clone() for k, t in v.items()}) or {},
    )
    assert runner.buffers["scale"].shape == (3, 8) and runner.buffers["ids"].shape == (8,)
    assert all(is_persistent(b) for b in runner.buffers.values())  # read in place, never staged
    with torch.no_grad():
        runner.capture(progress=False)
        # capture ran with the same padded views and context_fn as a step: request rows all pad
        assert {s[1] for s in model.shapes} == {(3, 8)}
        assert seen and all(v["scale"].eq(-7.0).all() for v in seen)
        seen.clear()
        scale = rand(2, 8)
        steps = [  # (ids, request of each token, uniform decode, expected mode)
            (torch.tensor([1, 2, 3, 4, 5]), torch.tensor([0, 0, 1, 1, 1]), False, M.PIECEWISE),
            (torch.tensor([6, 7]), torch.tensor([0, 1]), True, M.FULL),
            (torch.arange(11), torch.arange(11) % 2, False, M.NONE),
        ]
        for ids, req, uniform, mode in steps:
            with pb.expect(captures=0):
                out = runner.run(ids=ids, req_of_token=req, scale=scale, uniform_decode=uniform)
            assert runner.last_mode is mode
            assert_close(out, (model.emb(ids) * 0.5 + 1) * scale[req])
            views = seen.pop()
            assert views["scale"].shape == (3, 8), "per-request views always have max_num_reqs rows"
            assert_close(views["scale"][:2], scale)
            assert views["scale"][2].eq(-7.0).all(), "rows past the step's requests hold pad"


def test_per_request_errors_name_the_counts():
    with pytest.raises(ValueError, match=r"per='request' inputs \['scale'\] need GraphRunner\(max_num_reqs"):
        pb.GraphRunner(ReqModel(), cfg(), req_inputs())
    with pytest.raises(ValueError, match="max_num_reqs must be a positive int, got 0"):
        pb.GraphRunner(ReqModel(), cfg(), req_inputs(), max_num_reqs=0)
    runner = pb.GraphRunner(
        ReqModel(), cfg(), req_inputs(), model_args=["ids", "req_of_token"], model_kwargs=["scale"], max_num_reqs=2
    )
    ids = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match="3 rows, above max_num_reqs=2"):
        runner.run(ids=ids, req_of_token=ids, scale=rand(3, 8))
    with pytest.raises(ValueError, match="num_reqs=1 but the per-request inputs have 2 rows"):
        runner.run(ids=ids, req_of_token=ids, scale=rand(2, 8), num_reqs=1)


def test_model_kwargs_bind_by_name():
    class Positions(torch.nn.Module):
        def forward(self, ids, attention_mask=None, position_ids=None):
            assert attention_mask is None
            return ids * 10 + position_ids

    inputs = [pb.StaticInput("ids"), pb.StaticInput("position_ids")]
    runner = pb.GraphRunner(Positions(), cfg(M.NONE), inputs, model_args=["ids"], model_kwargs=["position_ids"])
    out = runner.run(ids=torch.tensor([1, 2]), position_ids=torch.tensor([3, 4]))
    assert out.tolist() == [13, 24]
    only_kw = pb.GraphRunner(Positions(), cfg(M.NONE), inputs, model_kwargs=["ids", "position_ids"])
    assert only_kw.model_args == []
    assert only_kw.run(ids=torch.tensor([1]), position_ids=torch.tensor([5])).tolist() == [15]
    with pytest.raises(ValueError, match=r"\['ids'\] are in both model_args and model_kwargs"):
        pb.GraphRunner(Positions(), cfg(), inputs, model_args=["ids"], model_kwargs=["ids", "position_ids"])
    with pytest.raises(TypeError, match="model_args must be a list of input names, got 'ids'"):
        pb.GraphRunner(Positions(), cfg(), inputs, model_args="ids")
    with pytest.raises(ValueError, match=r"model_kwargs \['mask'\] are not among the inputs"):
        pb.GraphRunner(Positions(), cfg(), inputs, model_kwargs=["mask"])


class _Cache:
    """Stands in for a transformers DynamicCache: state a graph cannot see change."""

    def __init__(self):
        self.layers = [torch.zeros(2)]


def test_opaque_objects_are_refused_as_inputs_and_context():
    model = LoggingModel()
    runner = pb.GraphRunner(model, cfg(), x_input())
    with pytest.raises(TypeError, match=r"input 'x' must be a torch.Tensor of shape \(tokens, 8\), got _Cache"):
        runner.run(x=_Cache())
    with pytest.raises(TypeError, match=r"context 'past\[0\]' is a _Cache"):
        runner.run(x=rand(3, 8), context={"past": [_Cache()]})
    # plain values, tensors and dataclasses of them are fine
    meta = pb.BatchDescriptor(3)
    with torch.no_grad():
        runner.run(x=rand(3, 8), context={"tag": "ok", "meta": meta, "t": torch.ones(1)})
    assert model.log[-1]["tag"] == "ok"
    # context_fn is the engine's own: it runs at capture as on every step, and may return its objects
    engine = pb.GraphRunner(LoggingModel(), cfg(), x_input(), context_fn=lambda v: {"cache": _Cache()})
    with torch.no_grad():
        engine.capture(progress=False)
        engine.run(x=rand(3, 8))
    # a runner that never replays graphs passes whatever the model takes
    eager = pb.GraphRunner(LoggingModel(), cfg(M.NONE), x_input())
    eager.run(x=rand(3, 8), context={"cache": _Cache()})


def test_full_step_refuses_context_tensors_outside_the_buffers():
    class ReadsScale(torch.nn.Module):
        def forward(self, x):
            return x * pb.get_forward_context().scale

    inputs = x_input() + [pb.StaticInput("s", dtype=torch.float32, per="request")]
    runner = pb.GraphRunner(
        ReadsScale(), cfg(M.FULL), inputs, model_args=["x"], max_num_reqs=8, context_fn=lambda v: {"scale": v["s"][0]}
    )
    x = rand(2, 8)
    with torch.no_grad():
        runner.capture(progress=False)
        with pytest.raises(ValueError, match="context 'scale' is a tensor outside the runner's buffers on a FULL step"):
            runner.run(x=x, s=torch.tensor([2.0, 2.0]), context={"scale": torch.tensor(3.0)}, uniform_decode=True)
        # the same per-step value through a StaticInput and context_fn reaches the FULL graph
        for scale in (2.0, 5.0):
            out = runner.run(x=x, s=torch.tensor([scale, scale]), uniform_decode=True)
            assert runner.last_mode is M.FULL
            assert_close(out, x * scale)


def test_context_fn_applies_during_capture_like_a_step():
    model = LoggingModel()
    runner = pb.GraphRunner(model, cfg(M.PIECEWISE), x_input(), context_fn=lambda v: {"tag": ("fn", v["x"].shape[0])})
    with torch.no_grad():
        runner.capture(progress=False)
    assert [e["tag"] for e in model.log] == [("fn", n) for n in (8, 8, 4, 4, 2, 2, 1, 1)]


# ---------------------------------------------------------------- padding never touches real state


class SlotWriter(torch.nn.Module):
    """Writes each token's value into ``cache[slot]`` through a break; slot -1 (padding) is skipped."""

    def __init__(self):
        super().__init__()
        self.cache = torch.zeros(4)

    def forward(self, vals: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        _write_slots(self.cache, vals, slots)
        return vals * 2


@pb.eager_break
def _write_slots(cache: torch.Tensor, vals: torch.Tensor, slots: torch.Tensor) -> None:
    keep = slots >= 0  # a host sync: fine in a break, which runs eagerly on replay
    cache[slots[keep]] = vals[keep]


def test_capture_after_steps_never_replays_a_previous_steps_slots():
    model = SlotWriter()
    inputs = [pb.StaticInput("vals", dtype=torch.float32), pb.StaticInput("slots", pad=-1)]
    runner = pb.GraphRunner(model, cfg(M.PIECEWISE), inputs)
    with torch.no_grad():
        runner.capture(progress=False, disable_after=False)
        runner.run(vals=torch.tensor([5.0, 6.0, 7.0]), slots=torch.tensor([0, 1, 2]))
        assert model.cache.tolist() == [5.0, 6.0, 7.0, 0.0]
        # padding rows of a step hold pad: slot 3 is never written by padding tokens
        runner.run(vals=torch.tensor([9.0]), slots=torch.tensor([0]))
        assert model.cache.tolist() == [9.0, 6.0, 7.0, 0.0]
        runner.clear_graphs()
        runner.capture(progress=False)  # warm-ups and captures run on pad, not on the last step's slots
        assert model.cache.tolist() == [9.0, 6.0, 7.0, 0.0]


# ---------------------------------------------------------------- issue 10: recapture, gc, dtypes, widths


def test_runner_captures_again_after_clear_graphs():
    model = LoggingModel()
    runner = pb.GraphRunner(model, cfg(), x_input())
    with torch.no_grad():
        first = runner.capture(progress=False)
        runner.clear_graphs()
        assert runner.model.entries == {} and runner.model.runnable.entries == {}
        with pb.expect(captures=8):
            second = runner.capture(progress=False)
        assert second.graphs == first.graphs == 8
        assert runner.capture_closed  # closed again after the second capture
        x = rand(3, 8)
        with pb.expect(captures=0, replays=1):
            assert_close(runner.run(x=x), model(x))
        # the wrapper's own clear_graphs() works the same way
        runner.model.runnable.clear_graphs()
        with pb.expect(captures=4):
            runner.capture(progress=False)


def test_runner_with_per_piece_wrappers_captures_again_after_clear_graphs():
    config = cfg(M.PIECEWISE, use_breakable=False).replace(capture_sizes=[2, 4])
    model = make_model(1, "inplace")
    runner = pb.GraphRunner(torch.compile(model, backend=pb.make_backend(config)), config, [pb.StaticInput("input_ids")])
    with torch.no_grad():
        with pb.expect(captures=4):  # 2 compiled pieces x 2 sizes
            runner.capture(progress=False)
        runner.clear_graphs()
        with pb.expect(captures=4):
            runner.capture(progress=False)
        ids = token_ids(3, seed=4)
        with pb.expect(captures=0):
            assert_close(runner.run(input_ids=ids), model(ids))


def test_capture_keeps_the_applications_gc_freeze():
    mine = [[i] for i in range(3)]  # tracked objects the application froze
    gc.freeze()
    try:
        enabled = gc.isenabled()
        model = LoggingModel()
        with torch.no_grad():
            pb.GraphRunner(model, cfg(M.PIECEWISE), x_input()).capture(progress=False)
        alive = {id(o) for o in gc.get_objects()}  # generations 0-2: frozen objects are not listed
        assert not any(id(o) in alive for o in mine), "capture() thawed the application's frozen objects"
        assert gc.get_freeze_count() > 0 and gc.isenabled() is enabled
        assert all(e["gc_outside"] for e in model.log)
    finally:
        gc.unfreeze()


class DtypeWidth(torch.nn.Module):
    """Returns what it was given: the dtype and width the model saw are visible in the output."""

    def forward(self, table: torch.Tensor) -> torch.Tensor:
        return _halve(table) * 2


@pytest.mark.parametrize("n", [3, 11])  # 3: a graph step; 11: above the largest size, eager
def test_dtype_and_narrow_width_are_the_same_in_graph_and_eager_steps(n):
    spec = pb.StaticInput("table", shape=(4,), dtype=torch.float32, pad=0.0)
    runner = pb.GraphRunner(DtypeWidth(), cfg(M.PIECEWISE), [spec])
    table = rand(n, 2).double()
    with torch.no_grad():
        runner.capture(progress=False)
        out = runner.run(table=table)
    assert runner.last_mode is (M.PIECEWISE if n == 3 else M.NONE)
    assert out.dtype == torch.float32 and out.shape == (n, 4)
    expected = torch.cat([table.float() + 2, torch.full((n, 2), 2.0)], dim=1)
    assert_close(out, expected)


def test_wrong_rank_or_non_tensor_step_inputs_raise():
    runner = pb.GraphRunner(LoggingModel(), cfg(), x_input())
    with pytest.raises(ValueError, match=r"input 'x' has shape \(\), its StaticInput wants \(tokens, 8\)"):
        runner.run(x=torch.tensor(1.0))
    with pytest.raises(TypeError, match="input 'x' must be a torch.Tensor of shape \\(tokens, 8\\), got list"):
        runner.run(x=[[1.0] * 8])
    with pytest.raises(TypeError, match="context must be a dict"):
        runner.run(x=rand(2, 8), context=["tag"])


def test_runner_config_none_is_the_default_config_and_other_types_raise():
    runner = pb.GraphRunner(LoggingModel(), None, x_input())
    assert runner.config.replace(cudagraph_mode=pb.CompilationConfig().cudagraph_mode) == pb.CompilationConfig()
    x = rand(2, 8)
    with torch.no_grad():
        assert_close(runner.run(x=x), runner.model(x) if runner.mode is M.NONE else x)
    with pytest.raises(TypeError, match="config must be a CompilationConfig or None, got dict"):
        pb.GraphRunner(LoggingModel(), {"cudagraph_mode": "NONE"}, x_input())
    with pytest.raises(TypeError, match="inputs must be StaticInputs, got 'x'"):
        pb.GraphRunner(LoggingModel(), None, ["x"])


def test_host_read_in_a_splitting_op_under_full_names_the_mode_the_key_and_the_fix():
    """A splitting op that reads the host runs eagerly between PIECEWISE segments but inline in a
    FULL graph: the FULL capture's error names the mode, the descriptor, the op and the fix
    (declare its graph support), not "move it out of the captured region". The fix works."""
    from pbtest.helpers import HostReading

    config = SIM.replace(splitting_ops=["pb_test::host_scale"], capture_sizes=[2, 4])
    model = HostReading()
    runner = pb.GraphRunner(torch.compile(model, backend=pb.make_backend(config)), config, [pb.StaticInput("input_ids")])
    with torch.inference_mode(), pytest.raises(RuntimeError) as info:
        runner.capture()
    message = str(info.value)
    for part in ("capturing BatchDescriptor(num_tokens=4, num_reqs=4, uniform=True) in mode FULL",
                 "inside the break point submod_1 (pb_test::host_scale)", "aten.item.default needs the host",
                 "attention_support=AttentionGraphSupport.NEVER"):
        assert part in message, message
    assert "move it out of the captured region" not in message
    runner = pb.GraphRunner(torch.compile(model, backend=pb.make_backend(config)), config,
                            [pb.StaticInput("input_ids")], attention_support=pb.AttentionGraphSupport.NEVER)
    ids = torch.tensor([3, 5, 7])
    with torch.inference_mode():
        runner.capture()
        assert_close(runner.run(input_ids=ids, uniform_decode=True), model(ids))
        assert runner.last_mode == M.PIECEWISE


def test_host_read_outside_splitting_ops_keeps_its_fix_and_gains_the_mode_and_key():
    from pbtest.helpers import HostReading

    config = SIM.replace(splitting_ops=["pb_test::host_scale"], capture_sizes=[2])
    compiled = torch.compile(HostReading(outside=True), backend=pb.make_backend(config))
    runner = pb.GraphRunner(compiled, config, [pb.StaticInput("input_ids")], attention_support=pb.AttentionGraphSupport.NEVER)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="move it out of the captured region") as info:
        runner.capture()
    assert any("while capturing BatchDescriptor(num_tokens=2, num_reqs=None, uniform=False) in mode PIECEWISE" in n
               for n in info.value.__notes__), info.value.__notes__


def test_a_context_tensor_seen_in_another_layout_is_not_the_captured_one():
    """Same memory, shape and dtype but other strides (a transposed view): a FULL graph would read it in the
    captured layout, so the replay check refuses it."""
    from piecewise_backend.runner.full_context import check_captured_context, context_tensors

    t = torch.zeros(4, 4)
    captured = context_tensors({"meta": {"table": t}})
    check_captured_context(captured, context_tensors({"meta": {"table": t}}), "desc")  # the same tensor passes
    with pytest.raises(ValueError, match=r"meta\['table'\]\" is not the tensor .* strides \[4, 1\]; now: .* strides \[1, 4\]"):
        check_captured_context(captured, context_tensors({"meta": {"table": t.t()}}), "desc")
