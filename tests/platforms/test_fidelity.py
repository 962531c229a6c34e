"""The simulator shows what a GPU replay would do, inside custom ops too (design.md 5).

Each case says what a real CUDA graph does and why, and asserts the simulated platform
does the same. Each has a CUDA twin at the end of tests/gpu/test_cuda.py.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

import piecewise_backend as pb
from piecewise_backend.capture import capture_active
from piecewise_backend.platforms.simulated import checks as sim_checks
from piecewise_backend.platforms.simulated.checks import UnrecordableError
from pbtest.helpers import OP_CALLS, SIM, ContextScale, ContextScaleBreak, make_model, run, tiny_mlp

M = pb.CUDAGraphMode
D4 = pb.BatchDescriptor(4)


@pytest.fixture(autouse=True)
def _inference():
    with torch.inference_mode():
        yield


def scale(value: float) -> torch.Tensor:
    return torch.full((4,), value)


# ---------------------------------------------------------------- metadata read inside a custom op


def test_full_replay_reads_the_capture_time_metadata_tensor():
    # GPU: a FULL graph replays the kernels captured inside the custom op, reading the scale
    # tensor at its capture-time address; a *new* tensor passed in the context next step sits
    # elsewhere and is never read (the op's Python does not run again). So 2.0, not 3.0.
    w = pb.CUDAGraphWrapper(ContextScale(), M.FULL, config=SIM)
    x = torch.ones(4)
    captured = scale(2.0)  # kept alive: on a GPU its memory then still holds 2.0
    assert_close(run(w, M.FULL, D4, x, scale=captured), torch.full((4,), 2.0))
    calls = OP_CALLS["scale"]
    assert_close(run(w, M.FULL, D4, x, scale=scale(3.0)), torch.full((4,), 2.0))
    assert OP_CALLS["scale"] == calls  # the op's Python did not run on replay


def test_full_replay_sees_in_place_update_of_persistent_metadata_buffer():
    # GPU: the graph reads the buffer's address on every replay, so values written into the
    # same buffer before a step are what the kernels read: the correct way to feed metadata.
    w = pb.CUDAGraphWrapper(ContextScale(), M.FULL, config=SIM)
    x, buf = torch.ones(4), scale(2.0)
    assert_close(run(w, M.FULL, D4, x, scale=buf), torch.full((4,), 2.0))
    buf.fill_(3.0)
    assert_close(run(w, M.FULL, D4, x, scale=buf), torch.full((4,), 3.0))
    x.fill_(2.0)
    assert_close(run(w, M.FULL, D4, x, scale=buf), torch.full((4,), 6.0))


def test_piecewise_break_reads_this_steps_context():
    # GPU: a break point is not in any graph; it runs eagerly on every replay, with this
    # step's forward context, so a new metadata tensor is seen: that is what breaks are for.
    w = pb.BreakableCUDAGraphWrapper(ContextScaleBreak(), config=SIM)
    x = torch.zeros(4)
    assert_close(run(w, M.PIECEWISE, D4, x, scale=scale(2.0)), torch.full((4,), 4.0))
    assert_close(run(w, M.PIECEWISE, D4, x, scale=scale(3.0)), torch.full((4,), 6.0))


def test_break_under_full_is_captured_like_any_op():
    # GPU: under FULL, break points do not break; their kernels are inside the one graph, so a
    # new metadata tensor is not seen (same as a custom op), while the same buffer updated is.
    w = pb.BreakableCUDAGraphWrapper(ContextScaleBreak(), config=SIM)
    x, buf = torch.zeros(4), scale(2.0)
    assert_close(run(w, M.FULL, D4, x, scale=buf), torch.full((4,), 4.0))
    assert_close(run(w, M.FULL, D4, x, scale=scale(3.0)), torch.full((4,), 4.0))
    buf.fill_(5.0)
    assert_close(run(w, M.FULL, D4, x, scale=buf), torch.full((4,), 10.0))


def test_composite_implicit_op_is_recorded_inside():
    # GPU: an op defined only by a CompositeImplicitAutograd decomposition is its ATen ops;
    # under inference_mode it reaches a dispatch mode whole, yet a replay must not run its Python.
    calls = []

    def impl(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return x * pb.get_forward_context().scale

    lib = torch.library.Library("pb_fidelity", "FRAGMENT")
    lib.define("ctx_scale(Tensor x) -> Tensor")
    lib.impl("ctx_scale", impl, "CompositeImplicitAutograd")
    w = pb.CUDAGraphWrapper(lambda x: torch.ops.pb_fidelity.ctx_scale(x) + 0, M.FULL, config=SIM)
    x = torch.ones(4)
    assert_close(run(w, M.FULL, D4, x, scale=scale(2.0)), torch.full((4,), 2.0))
    assert_close(run(w, M.FULL, D4, x, scale=scale(3.0)), torch.full((4,), 2.0))
    assert len(calls) == 1


# ---------------------------------------------------------------- host syncs inside custom ops


@pytest.mark.parametrize("mode", [M.FULL, M.PIECEWISE])
def test_host_sync_inside_custom_op_raises(mode):
    # GPU: .item() inside a custom op copies device memory to the host while the stream is
    # capturing: "operation not permitted when stream is capturing", wherever the call sits.
    w = pb.BreakableCUDAGraphWrapper(lambda x: torch.ops.pb_test.sync_inside(x) + 1, config=SIM)
    x = torch.ones(4)
    with pytest.raises(RuntimeError, match="operation not permitted when stream is capturing"):
        run(w, mode, D4, x)
    assert w.entries == {} and not capture_active()
    assert_close(run(w, M.NONE, None, x), x * 4 + 1)  # eager is fine


# ---------------------------------------------------------------- unrecordable work is refused


def test_kernel_bypassing_the_dispatcher_is_refused():
    # GPU: such a kernel is captured like any other. The simulator cannot see it, so a replay
    # would skip it: it must refuse at capture time, naming the cause and the fix.
    def fn(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        torch.ops.pb_test.raw_double(x + 1, out)
        return out

    w = pb.CUDAGraphWrapper(fn, M.FULL, config=SIM)
    x = torch.ones(4)
    with pytest.raises(UnrecordableError, match="no recorded op writes the first of them") as info:
        run(w, M.FULL, D4, x)
    assert "CPU implementation made of torch ops" in str(info.value)  # the real cause and its fix
    assert w.entries == {} and not capture_active()


def test_inductor_pieces_are_refused_at_capture():
    # GPU: Inductor's Triton kernels are captured. On the CPU its fused C++ kernels bypass the
    # dispatcher: replays would silently differ from eager, so capture must refuse them. The
    # config check cannot see this: the model was compiled with the default backend config and
    # only the GraphRunner's config says simulated.
    torch._dynamo.reset()
    compiled = torch.compile(tiny_mlp(), backend="piecewise_breakable")
    config = pb.CompilationConfig(
        cudagraph_mode="PIECEWISE", capture_sizes=[4], platform="simulated", compile_pieces="eager"
    )
    runner = pb.GraphRunner(compiled, config, inputs=[pb.StaticInput("x", shape=(8,), dtype=torch.float32)])
    with pytest.raises(UnrecordableError, match="Inductor") as info:
        runner.capture(progress=False)
    assert "compile_pieces='eager'" in str(info.value)
    assert not capture_active()


def test_whole_graph_inductor_is_refused_at_capture(monkeypatch):
    torch._dynamo.reset()
    compiled = torch.compile(tiny_mlp())
    x = torch.randn(4, 8)
    compiled(x)
    w = pb.CUDAGraphWrapper(compiled, M.FULL, config=SIM)
    with pytest.raises(UnrecordableError, match="Inductor-generated code"):
        run(w, M.FULL, D4, x)
    assert w.entries == {} and not capture_active()
    # Without the caller check, the validation replay alone still refuses it.
    monkeypatch.setattr(sim_checks, "check_caller", lambda func: None)
    with pytest.raises(UnrecordableError, match="did not reproduce") as info:
        run(w, M.FULL, D4, x)
    assert "compile_pieces='eager'" in str(info.value)
    assert w.entries == {} and not capture_active()


# ---------------------------------------------------------------- host tensors


@pytest.mark.parametrize("mode", [M.PIECEWISE, M.FULL])
def test_dynamic_toy_model_reads_lifted_eps_on_the_host(mode):
    # GPU: with dynamic=True Dynamo lifts RMSNorm.eps into a 0-d CPU tensor made from a Python
    # float and calls .item() on it inside the graph; it lives on the host, so the capture works.
    torch._dynamo.reset()
    model = make_model(num_layers=1, attention="inplace")
    compiled = torch.compile(model, backend=pb.make_backend(SIM), dynamic=True)
    w = pb.BreakableCUDAGraphWrapper(compiled, config=SIM)
    ids = torch.randint(0, 128, (8,), generator=torch.Generator().manual_seed(0))
    d8 = pb.BatchDescriptor(8)
    assert_close(run(w, mode, d8, ids), model(ids))
    ids.copy_(torch.randint(0, 128, (8,), generator=torch.Generator().manual_seed(1)))
    assert_close(run(w, mode, d8, ids), model(ids))


def test_item_of_a_device_scalar_still_raises():
    # GPU: a 0-d device buffer made before the capture (not from Python data during it), or
    # one computed during it, needs a copy to the host: a sync.
    step = torch.zeros(())
    for fn in (lambda x: x * step.item(), lambda x: x * (x.sum() + step).item()):
        w = pb.CUDAGraphWrapper(fn, M.FULL, config=SIM)
        with pytest.raises(RuntimeError, match="capturing"):
            run(w, M.FULL, D4, torch.ones(4))
        assert w.entries == {}
