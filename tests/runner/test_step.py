"""The step function (runner/step.py) and capture planning over it (runner/orchestration.py, runner/lazy.py):
planning takes StepBuffers and a Step, never a runner."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.testing import assert_close

import piecewise_backend as pb
from piecewise_backend.runner import lazy as lazy_policy
from piecewise_backend.runner import orchestration
from piecewise_backend.runner.buffers import StepBuffers
from piecewise_backend.runner.step import ModelStep
from piecewise_backend.runner.ubatch_step import HalfLayout
from pbtest.helpers import SIM, TwoBreakModel

M = pb.CUDAGraphMode
BD = pb.BatchDescriptor


class Recorder(torch.nn.Module):
    """Returns ids * 2 and records the forward context of every call."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[dict[str, Any]] = []

    def forward(self, ids: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        ctx = pb.get_forward_context()
        self.seen.append(dict(mode=ctx.runtime_mode, desc=ctx.batch_descriptor, allow=getattr(ctx, "allow_capture", "-"),
                              slices=getattr(ctx, "ubatch_slices", None), tag=getattr(ctx, "tag", None)))
        return ids * 2


def step_on(model: Any, **kw) -> tuple[StepBuffers, ModelStep]:
    inputs = [pb.StaticInput("ids"), pb.StaticInput("blocks", shape=(2,), per="request")]
    buffers = StepBuffers(inputs, tokens=8, max_num_reqs=4, device=torch.device("cpu"))
    return buffers, ModelStep(model, buffers, model_args=["ids", "blocks"], model_kwargs=[], **kw)


@pytest.mark.parametrize("may_capture, context, allow", [
    (None, {}, "-"),  # the wrappers capture on first sight
    (False, {}, False),  # a closed or lazy runner's step
    (False, {"allow_capture": True}, True),  # a step's own context may still allow it
    (True, {"allow_capture": False}, True),  # a capture captures, whatever the context says
])
def test_the_step_says_whether_this_call_may_capture(may_capture, context, allow):
    model = Recorder()
    buffers, step = step_on(model, context_fn=lambda views: {"tag": int(views["ids"].shape[0])})
    out = step(buffers.views(4), M.NONE, BD(4), context=context, may_capture=may_capture)
    assert out.shape == (4,) and model.seen[-1]["allow"] == allow and model.seen[-1]["tag"] == 4


def test_a_micro_batched_call_is_one_call_of_the_model_with_each_half_s_views_and_context():
    model = Recorder()
    seen_views = []

    def context_fn(views):
        seen_views.append({k: tuple(v.shape) for k, v in views.items()})
        return {"half_tokens": int(views["ids"].shape[0])}

    buffers, step = step_on(model, context_fn=context_fn, uniform_decode_query_len=1)
    step(buffers.views(6), M.NONE, BD(6), context={"tag": "x"}, halves=HalfLayout((2, 4), 1))
    assert len(model.seen) == 1  # the wrapped model, called once (a UBatchWrapper runs the halves)
    first, second = model.seen[0]["slices"]
    assert (first.num_tokens, second.num_tokens) == (2, 4)
    assert seen_views == [{"ids": (2,), "blocks": (1, 2)}, {"ids": (4,), "blocks": (3, 2)}]  # request rows split at 1
    assert first.attrs == {"half_tokens": 2, "tag": "x"} and second.batch_descriptor == BD(4)


def test_capture_one_warms_up_then_captures_with_the_step_and_its_micro_batched_graph():
    calls = []

    class FakeStep:
        def __call__(self, views, mode, desc, *, context=None, may_capture=None, halves=None):
            calls.append((mode, desc, may_capture, halves, tuple(views["ids"].shape)))

        def capture_halves(self, desc):
            return HalfLayout((4, 4), 4) if desc.num_tokens == 8 else None

        def drop(self, mode, desc):
            return False

    buffers, _ = step_on(Recorder())
    orchestration.capture_one(buffers, FakeStep(), M.FULL, BD(8), None, num_warmups=2)
    layout = HalfLayout((4, 4), 4)
    assert calls == [
        (M.NONE, BD(8), True, None, (8,)), (M.NONE, BD(8), True, None, (8,)), (M.FULL, BD(8), True, None, (8,)),
        (M.NONE, BD(8), True, layout, (8,)), (M.NONE, BD(8), True, layout, (8,)), (M.FULL, BD(8), True, layout, (8,)),
    ]
    calls.clear()
    orchestration.capture_one(buffers, FakeStep(), M.PIECEWISE, BD(8), None, num_warmups=0)
    assert calls == [(M.PIECEWISE, BD(8), True, None, (8,))]  # only FULL graphs have a micro-batched twin


def test_capture_planning_needs_only_buffers_a_step_and_a_config():
    """capture_keys (up front and within a budget) and estimate_memory run a real capture without any GraphRunner."""
    config = SIM.replace(cudagraph_mode="PIECEWISE", capture_sizes=[4, 8])
    model = pb.wrap_model(TwoBreakModel(), config)
    inputs = [pb.StaticInput("x", shape=(8,), dtype=torch.float32)]
    buffers = StepBuffers(inputs, tokens=8, max_num_reqs=None, device=torch.device("cpu"))
    step = ModelStep(model, buffers, model_args=["x"], model_kwargs=[], context_fn=None)
    plan = [(M.PIECEWISE, [BD(8), BD(4)])]
    assert orchestration.estimate_memory(buffers, step, config, plan) > 0
    assert model.entries == {}  # the estimate's scratch entries are gone
    policy = lazy_policy.LazyCapture()
    keys = [(M.PIECEWISE, d) for d in plan[0][1]]
    seen, report = orchestration.capture_keys(buffers, step, config, policy, keys,
                                              orchestration.CaptureBudget(startup=True))
    assert report.graphs == 2 and seen == [(M.PIECEWISE, BD(8)), (M.PIECEWISE, BD(4))] and policy.captured == set(seen)
    assert [d.desc for d in report.per_descriptor] == [BD(8), BD(4)]
    assert set(model.entries) == {BD(8), BD(4)}
    x = torch.randn(4, 8)
    buffers.fill({"x": x}, 4)
    with pb.expect(captures=0, replays=1):
        out = step(buffers.views(4), M.PIECEWISE, BD(4), may_capture=False)
    assert_close(out, model.unwrap()(x))
    assert step.drop(M.PIECEWISE, BD(4)) and set(model.entries) == {BD(8)}
    lazy = lazy_policy.LazyCapture()
    captured, _ = orchestration.capture_keys(buffers, step, config, lazy, [(M.PIECEWISE, BD(4))],
                                             orchestration.CaptureBudget(seconds=60.0))
    assert captured == [(M.PIECEWISE, BD(4))]
    assert set(model.entries) == {BD(8), BD(4)} and lazy.captured == {(M.PIECEWISE, BD(4))}

