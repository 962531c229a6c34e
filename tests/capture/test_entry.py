"""GraphEntry replay (capture/entry.py): global state, fresh containers, inference-only outputs (issue 10 items 1, 6, 11, 16)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import piecewise_backend as pb
from pbtest.helpers import SIM, CountingMLP, NoGradAttention, TwoBreakModel, compile_model, run

M = pb.CUDAGraphMode
D8 = pb.BatchDescriptor(8)


def x8(seed: int = 0) -> torch.Tensor:
    return torch.randn(8, 8, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- 1: grad mode never leaks


@pytest.mark.parametrize("grad", [True, False])
def test_grad_mode_after_replay_is_the_callers(grad):
    # A CUDA graph replay runs kernels only, not the Python that set grad mode in the captured
    # region: the wrapper must leave grad mode as eager would (twin in tests/gpu/test_cuda.py).
    w = pb.BreakableCUDAGraphWrapper(NoGradAttention(), M.PIECEWISE, config=SIM)
    x = x8()
    with torch.set_grad_enabled(grad):
        run(w, M.PIECEWISE, D8, x)
        assert torch.is_grad_enabled() is True  # the capturing call ran the model's Python
        torch._C._set_grad_enabled(grad)
        for _ in range(2):
            run(w, M.PIECEWISE, D8, x)
            assert torch.is_grad_enabled() is grad


def test_compiled_no_grad_region_does_not_leak_grad_mode():
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q = torch.nn.Linear(8, 8)

        def forward(self, x):
            h = self.q(x).view(1, 1, 8, 8)
            with torch.no_grad():
                h = F.scaled_dot_product_attention(h, h, h)
            return self.q(h.view(8, 8))

    torch._dynamo.reset()
    model = Model()
    compiled, _ = compile_model(model, SIM)
    w = pb.BreakableCUDAGraphWrapper(compiled, M.PIECEWISE, config=SIM)
    x = x8()
    run(w, M.NONE, None, x)
    run(w, M.PIECEWISE, D8, x)
    assert torch.is_grad_enabled()
    out = run(w, M.PIECEWISE, D8, x)
    assert torch.is_grad_enabled()
    assert_close(out, model(x))
    torch._dynamo.reset()


# ---------------------------------------------------------------- 6: a fresh container every replay


@pytest.mark.parametrize("kind", ["list", "dict", "nested"])
def test_replay_returns_a_fresh_container(kind):
    # A replay's tensors are graph memory; the container around them is Python the caller may mutate.
    def f(x):
        if kind == "list":
            return [x * 2, x + 1]
        if kind == "dict":
            return {"a": x * 2, "b": x + 1}
        return (x * 2, [x + 1])

    w = pb.CUDAGraphWrapper(f, M.FULL, config=SIM)
    x = x8()
    o = run(w, M.FULL, D8, x)
    if kind == "list":
        o.append("junk")
    elif kind == "dict":
        o["a"] = "junk"
    else:
        o[1].clear()
    again = run(w, M.FULL, D8, x)
    assert again is not o
    assert_close(again, f(x))


# ---------------------------------------------------------------- 11: inference_mode capture, no_grad replay


def test_capture_under_inference_mode_replays_under_no_grad():
    # A CUDA graph's kernels write its inference tensors whatever the caller's mode; so must a replay.
    m = TwoBreakModel(fresh=False)  # breaks write into tensors allocated during the capture
    w = pb.BreakableCUDAGraphWrapper(m, M.PIECEWISE, config=SIM)
    with torch.inference_mode():
        static = x8()
        run(w, M.PIECEWISE, D8, static)
    with torch.no_grad():
        other = x8(4)
        out = run(w, M.PIECEWISE, D8, other)  # raised "Inplace update to inference tensor outside InferenceMode"
        assert_close(out, m(other))
        assert torch.is_inference_mode_enabled() is False


# ---------------------------------------------------------------- 16: replays are inference-only


def test_backward_through_a_replay_says_replays_are_inference_only():
    m = CountingMLP()
    w = pb.CUDAGraphWrapper(m, M.FULL, config=SIM)
    x = x8()
    run(w, M.FULL, D8, x)  # captured with grad enabled: the model's parameters require grad
    out = run(w, M.FULL, D8, x)
    assert_close(out, m(x))
    with pytest.raises(RuntimeError, match="replays are inference-only"):
        out.sum().backward()
    assert all(p.grad is None for p in m.parameters())
    with torch.no_grad():  # the serving path pays nothing and gets a plain tensor
        plain = run(w, M.FULL, D8, x)
    assert plain.grad_fn is None and not plain.requires_grad


class TwoNoGradAttentions(torch.nn.Module):
    """Each break runs in the grad mode the model set before it: on, then off, then on again."""

    def __init__(self):
        super().__init__()
        self.modes = []

        @pb.eager_break
        def attention(h):
            self.modes.append(torch.is_grad_enabled())
            torch._C._set_grad_enabled(False)
            return h * 2

        self.attention = attention

    def forward(self, x):
        h = self.attention(x + 1)
        torch._C._set_grad_enabled(True)  # skipped by a replay
        h = self.attention(h)
        torch._C._set_grad_enabled(True)
        return h - 1


def test_each_break_replays_in_the_grad_mode_it_ran_in():
    m = TwoNoGradAttentions()
    w = pb.BreakableCUDAGraphWrapper(m, M.PIECEWISE, config=SIM)
    x = x8()
    with torch.enable_grad():
        run(w, M.PIECEWISE, D8, x)
        m.modes.clear()
        run(w, M.PIECEWISE, D8, x)
        assert m.modes == [True, True]  # eager: the second break runs after the model re-enabled grad
        assert torch.is_grad_enabled()


def test_quickstart_pattern_capture_under_inference_mode_serve_under_no_grad():
    from pbtest.helpers import make_model

    torch.manual_seed(0)
    model = make_model(2, "break")
    config = SIM.replace(capture_sizes=[1, 2, 4, 8])
    runner = pb.GraphRunner(model, config, [pb.StaticInput("ids")])
    with torch.inference_mode():
        runner.capture(progress=False)
    with torch.no_grad():
        for n, uniform in ((5, False), (4, True)):
            ids = torch.randint(0, 100, (n,), generator=torch.Generator().manual_seed(n))
            assert_close(runner.run(ids=ids, uniform_decode=uniform), model(ids))
            assert runner.last_mode is (M.FULL if uniform else M.PIECEWISE)
            assert torch.is_grad_enabled() is False and torch.is_inference_mode_enabled() is False


@pb.eager_break
def plain_attention(h: torch.Tensor) -> torch.Tensor:
    return h * 2


def test_grad_mode_set_by_a_segment_around_a_break_does_not_leak():
    # the switches sit in graph segments (skipped on replay); the break only runs in the mode they set
    def model(x):
        torch._C._set_grad_enabled(False)
        h = plain_attention(x + 1)
        torch._C._set_grad_enabled(True)
        return h - 1

    w = pb.BreakableCUDAGraphWrapper(model, M.PIECEWISE, config=SIM)
    x = x8()
    with torch.enable_grad():
        for _ in range(3):
            assert_close(run(w, M.PIECEWISE, D8, x), (x + 1) * 2 - 1)
            assert torch.is_grad_enabled()
