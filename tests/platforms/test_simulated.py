"""Fidelity of the simulated platform: it must fail where a real CUDA graph would (design.md 5)."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

import piecewise_backend as pb
from piecewise_backend.capture import capture_active
from piecewise_backend.platforms import get_platform
from piecewise_backend.platforms.simulated.checks import UnrecordableError
from piecewise_backend.platforms.simulated.platform import SimulatedGraph
from pbtest.helpers import SIM, double_into, raw_double, StepCounter, TwoBreakModel, run, segment_kinds

M = pb.CUDAGraphMode
D4 = pb.BatchDescriptor(4)


@pytest.fixture
def sim():
    return get_platform("simulated")


# ---------------------------------------------------------------- platform level


def test_platform_is_cached_and_named(sim):
    assert sim is get_platform("simulated")
    assert sim.name == "simulated"
    with pytest.raises(ValueError, match="unknown platform"):
        get_platform("tpu")


def test_segment_end_leaves_garbage_and_undoes_writes_until_replay(sim):
    x = torch.arange(4.0)
    pre = torch.ones(4)
    ints = torch.arange(4)
    rec = sim.begin()
    fresh = x * 2 + 1
    fresh_int = ints + 10
    pre.mul_(3).add_(x)
    view_write = pre[:2]
    view_write.add_(100)
    graph = rec.end()
    assert isinstance(graph, SimulatedGraph)
    # a capture does not execute
    assert torch.isnan(fresh).all()
    assert (fresh_int == -1).all()  # 0xFF bytes
    assert_close(pre, torch.ones(4))
    assert torch.utils._python_dispatch._get_current_dispatch_mode() is None
    graph.replay()
    assert_close(fresh, x * 2 + 1)
    assert_close(fresh_int, ints + 10)
    assert_close(pre, torch.tensor([103.0, 104.0, 5.0, 6.0]))
    # replay reads the current contents of pre-existing memory, at the same addresses
    x.fill_(1.0)
    graph.replay()
    assert_close(fresh, torch.full((4,), 3.0))
    assert_close(pre, torch.tensor([410.0, 413.0, 16.0, 19.0]))


def test_recorder_abort_restores_and_closes(sim):
    pre = torch.zeros(3)
    rec = sim.begin()
    pre.add_(7)
    rec.abort()
    assert_close(pre, torch.zeros(3))
    assert torch.utils._python_dispatch._get_current_dispatch_mode() is None
    pre.add_(1)  # no longer recorded nor undone
    assert_close(pre, torch.ones(3))


def test_allocations_are_not_replayed_but_keep_their_memory(sim):
    rec = sim.begin()
    buf = torch.empty(5)
    buf.fill_(2.0)
    graph = rec.end()
    ptr = buf.data_ptr()
    assert torch.isnan(buf).all()
    graph.replay()
    assert buf.data_ptr() == ptr
    assert_close(buf, torch.full((5,), 2.0))
    assert all("empty" not in str(op.func) for op in graph.ops)


def test_pool_bytes_are_the_memory_measure(sim):
    from piecewise_backend.platforms.simulated.pool import SimPool

    saved, sim.pool = sim.pool, SimPool()
    x = torch.ones(2)
    try:
        with sim.capture_scope():
            rec = sim.begin()
            kept = x + 1
            rec.end()
        assert sim.memory() == 512 and sim.owns(kept)  # one 512-byte block of the shared pool
        assert "MiB of simulated graph pool" in sim.describe(sim.memory())
    finally:
        sim.pool = saved


@pytest.mark.parametrize(
    "sync",
    [
        pytest.param(lambda t: t.sum().item(), id="item"),
        pytest.param(lambda t: torch.nonzero(t), id="nonzero"),
        pytest.param(lambda t: bool(t.sum() > 0), id="bool"),
        pytest.param(lambda t: t[t > 0], id="mask-index"),
    ],
)
def test_host_sync_during_segment_raises(sim, sync):
    t = torch.arange(4.0)
    rec = sim.begin()
    try:
        with pytest.raises(RuntimeError, match="capturing"):
            sync(t)
    finally:
        rec.abort()


# ---------------------------------------------------------------- recording inside ops


@torch.library.custom_op("pb_test::nested_double_plus_one", mutates_args=())
def nested_double_plus_one(x: torch.Tensor) -> torch.Tensor:
    return torch.ops.pb_test.double(x) + 1


def test_custom_ops_are_recorded_as_their_aten_ops_recursively(sim):
    x, out = torch.arange(4.0), torch.zeros(4)
    rec = sim.begin()
    double_into(x, out)  # mutating custom op
    fresh = nested_double_plus_one(x)  # custom op calling a custom op
    graph = rec.end()
    assert {op.func.namespace for op in graph.ops} == {"aten"}
    assert_close(out, torch.zeros(4))  # capture did not execute
    assert torch.isnan(fresh).all()
    graph.replay()
    assert_close(out, x * 2)
    assert_close(fresh, x * 2 + 1)
    x.fill_(1.0)
    graph.replay()
    assert_close(out, torch.full((4,), 2.0))
    assert_close(fresh, torch.full((4,), 3.0))


def test_custom_op_with_a_cpp_kernel_is_recorded_whole(sim):
    # A compiled kernel (here fbgemm's) replays without Python: recording it whole is faithful,
    # while expanding it would miss its raw writes.
    w = torch.randn(4, 8)
    rec = sim.begin()
    packed = torch.ops.quantized.embedding_bag_byte_prepack(w)
    graph = rec.end()
    assert [op.func.name() for op in graph.ops] == ["quantized::embedding_bag_byte_prepack"]
    w.mul_(2)
    graph.replay()
    assert torch.equal(packed, torch.ops.quantized.embedding_bag_byte_prepack(w))


def test_tensor_subclass_desugars_before_recording(sim):
    # A subclass (DTensor, here TwoTensor) must reach the recorder as the plain ops it runs.
    from torch.testing._internal.two_tensor import TwoTensor

    a, b = torch.arange(4.0), torch.ones(4)
    t = TwoTensor(a, b)
    rec = sim.begin()
    out = t * 2
    graph = rec.end()
    assert all(type(x) is torch.Tensor for op in graph.ops for x in op.args if isinstance(x, torch.Tensor))
    a.fill_(5.0)
    graph.replay()
    assert_close(out.a, torch.full((4,), 10.0))
    assert_close(out.b, torch.full((4,), 2.0))


def test_empty_holds_garbage_during_capture_too(sim):
    rec = sim.begin()
    buf = torch.empty(3)
    seen = buf.clone()
    rec.end()
    assert torch.isnan(seen).all()  # what a kernel reading unwritten graph memory would see


def test_item_of_host_scalar_made_from_python_data_is_allowed(sim):
    # torch.tensor(float) builds a host tensor (Dynamo does this for lifted float attributes).
    device_scalar = torch.ones(())
    rec = sim.begin()
    try:
        eps = torch.tensor(1e-6)
        assert eps.item() == pytest.approx(1e-6)
        with pytest.raises(RuntimeError, match="capturing"):
            device_scalar.item()
        with pytest.raises(RuntimeError, match="capturing"):
            (eps * 2).item()  # computed during the capture: device memory
    finally:
        rec.abort()


@torch.library.custom_op("pb_test::hidden_add_one", mutates_args=("out",))
def hidden_add_one(out: torch.Tensor) -> None:
    with torch._C._DisableTorchDispatch():  # a write the dispatcher never sees, as from raw pointers
        out.add_(1)


def test_hidden_write_to_declared_output_is_refused_and_undone(sim):
    pre = torch.zeros(4)
    rec = sim.begin()
    hidden_add_one(pre)
    with pytest.raises(UnrecordableError, match="did not reproduce 1 of the 1 tensors"):
        rec.end()
    assert_close(pre, torch.zeros(4))
    assert torch.utils._python_dispatch._get_current_dispatch_mode() is None


def test_refusal_names_the_op_whose_replay_read_hidden_work(sim):
    # aten.mul.out is recorded, but it reads a buffer only a hidden kernel wrote: the refusal names
    # it, rather than blaming Inductor, which never ran here.
    out = torch.zeros(4)
    rec = sim.begin()
    buf = torch.empty(4)
    raw_double(torch.ones(4), buf)
    torch.mul(buf, 2, out=out)
    with pytest.raises(UnrecordableError, match=r"written by aten\.mul\.out, whose replay gave other bytes"):
        rec.end()
    assert_close(out, torch.zeros(4))


@torch.library.custom_op("pb_test::hidden_fresh", mutates_args=())
def hidden_fresh(x: torch.Tensor) -> torch.Tensor:
    with torch._C._DisableTorchDispatch():
        return x + 1


def test_custom_op_result_made_behind_the_dispatcher_is_refused(sim):
    rec = sim.begin()
    try:
        with pytest.raises(UnrecordableError, match="no recorded ATen op produced"):
            hidden_fresh(torch.ones(2))
    finally:
        rec.abort()


# ---------------------------------------------------------------- through the wrappers


@pytest.mark.parametrize("breakable", [False, True])
def test_in_place_buffer_update_runs_once_per_call(breakable):
    m = StepCounter()
    cls = pb.BreakableCUDAGraphWrapper if breakable else pb.CUDAGraphWrapper
    w = cls(m, M.FULL, config=SIM)
    x = torch.zeros(4)
    out = run(w, M.FULL, D4, x)
    assert m.step.item() == 1  # capture itself did not count; the replay after it did
    assert_close(out, torch.full((4,), 1.0))
    out = run(w, M.FULL, D4, x)
    assert m.step.item() == 2
    assert_close(out, torch.full((4,), 2.0))


def host_sync_models():
    class Item(torch.nn.Module):
        def forward(self, x):
            return x * x.sum().item()

    class Nonzero(torch.nn.Module):
        def forward(self, x):
            return x[torch.nonzero(x > 0)[:, 0]].sum() + x

    return [Item(), Nonzero()]


@pytest.mark.parametrize("model", host_sync_models(), ids=["item", "nonzero"])
@pytest.mark.parametrize("mode", [M.FULL, M.PIECEWISE])
def test_host_sync_in_model_raises_and_leaves_no_entry(model, mode):
    w = pb.BreakableCUDAGraphWrapper(model, config=SIM)
    x = torch.arange(4.0)
    with pb.expect(captures=0):
        with pytest.raises(RuntimeError, match="capturing"):
            run(w, mode, D4, x)
    assert w.entries == {}
    assert not capture_active()
    assert torch.utils._python_dispatch._get_current_dispatch_mode() is None
    assert_close(run(w, M.NONE, None, x), model(x))  # eager still fine


def test_host_sync_failure_restores_earlier_writes():
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("acc", torch.zeros(4))

        def forward(self, x):
            self.acc.add_(x)
            return self.acc * self.acc.max().item()

    m = Model()
    w = pb.CUDAGraphWrapper(m, M.FULL, config=SIM)
    with pytest.raises(RuntimeError, match="capturing"):
        run(w, M.FULL, D4, torch.ones(4))
    assert_close(m.acc, torch.zeros(4))


def test_replay_in_grad_mode_with_multi_output_views():
    # Linear -> view -> unbind -> contiguous with parameters requiring grad: replaying a
    # fresh result into place must not trip autograd's view checks (a CUDA graph replay
    # never touches autograd).
    class QKV(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.proj = torch.nn.Linear(8, 24)

        def forward(self, x):
            q, k, v = self.proj(x).view(x.shape[0], 3, 8).unbind(1)
            return q.contiguous() * k.contiguous() + v.contiguous()

    m = QKV()
    assert torch.is_grad_enabled() and m.proj.weight.requires_grad
    w = pb.CUDAGraphWrapper(m, M.FULL, config=SIM)
    static = torch.randn(4, 8)
    assert_close(run(w, M.FULL, D4, static), m(static))
    static.copy_(torch.randn(4, 8))
    assert_close(run(w, M.FULL, D4, static), m(static))


def test_break_segments_are_simulated_graphs_with_recorded_ops():
    w = pb.BreakableCUDAGraphWrapper(TwoBreakModel(), config=SIM)
    run(w, M.PIECEWISE, pb.BatchDescriptor(8), torch.randn(8, 8))
    entry = w.entries[pb.BatchDescriptor(8)]
    assert segment_kinds(entry) == "G E G E G"
    graphs = [s for s in entry.segments if isinstance(s, SimulatedGraph)]
    assert all(len(g) >= 1 for g in graphs)  # each linear at least


def test_config_refuses_inductor_on_simulated():
    with pytest.raises(ValueError, match="compile_pieces"):
        pb.CompilationConfig(platform="simulated", compile_pieces="inductor")
    assert pb.CompilationConfig(platform="simulated", compile_pieces="eager").platform == "simulated"


def test_auto_platform_without_gpu_refuses_to_capture():
    if torch.cuda.is_available():
        pytest.skip("auto resolves to cuda on a GPU machine")  # only the CPU behaviour is tested here
    w = pb.CUDAGraphWrapper(lambda x: x + 1, M.FULL, config=pb.CompilationConfig())  # Inductor pieces
    x = torch.ones(2)
    assert_close(w(x), x + 1)  # eager without a context is fine
    with pytest.raises(RuntimeError, match="simulated"):
        run(w, M.FULL, D4, x)
    assert w.entries == {} and not capture_active()
    # eager pieces can run on the simulator: "auto" means it there
    w = pb.CUDAGraphWrapper(lambda x: x + 1, M.FULL, config=pb.CompilationConfig(compile_pieces="eager"))
    with pb.expect(captures=1):
        assert_close(run(w, M.FULL, D4, x), x + 1)
    assert list(w.entries) == [D4] and w.captured_on.name == "simulated"
