"""CUDA's capture rules on the simulator (platforms/simulated/rules.py): host reads, sync-free ops, random ops.

Each simulated test says what a GPU does; the CUDA twins at the end assert it on a real graph.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import piecewise_backend as pb
from piecewise_backend.capture import capture_active
from piecewise_backend.platforms import get_platform, warmup_scope
from pbtest.helpers import SIM, run

M = pb.CUDAGraphMode
D4 = pb.BatchDescriptor(4)


@torch.library.custom_op("pb_rules::tolist_scale", mutates_args=())
def tolist_scale(x: torch.Tensor) -> torch.Tensor:
    """A host read hidden inside a custom op."""
    return x * sum(x.tolist())


@tolist_scale.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


# Host reads around the dispatcher (tolist, numpy, printing: refused only since issue 18) and through it.
HOST_READS = [
    pytest.param(lambda x: x * x.sum().tolist(), id="tolist"),
    pytest.param(lambda x: x * float(x.cpu().numpy().sum()), id="numpy"),
    pytest.param(lambda x: x * float(np.asarray(x.cpu()).sum()), id="asarray"),
    pytest.param(lambda x: x * len(repr(x)), id="repr"),
    pytest.param(lambda x: x * len(str(x)), id="str"),
    pytest.param(lambda x: x * len(f"{x}"), id="format"),
    pytest.param(lambda x: x * x.untyped_storage()[0], id="storage"),
    pytest.param(lambda x: x * torch.allclose(x, x * 2), id="allclose"),
    pytest.param(lambda x: torch.ops.pb_rules.tolist_scale(x) + 1, id="inside-custom-op"),
]


def sim_full(fn):
    return pb.CUDAGraphWrapper(fn, M.FULL, config=SIM)


# ---------------------------------------------------------------- host reads (issue 18, item 8)


@pytest.mark.parametrize("fn", HOST_READS)
@pytest.mark.parametrize("mode", [M.FULL, M.PIECEWISE])
def test_host_read_raises_like_a_capturing_stream(fn, mode):
    # GPU: copying device memory to the host while the stream captures fails with "operation not
    # permitted when stream is capturing", whichever Python call asks for it.
    w = pb.BreakableCUDAGraphWrapper(fn, config=SIM)
    x = torch.ones(4)
    with pytest.raises(RuntimeError, match="operation not permitted when stream is capturing"):
        run(w, mode, D4, x)
    assert w.entries == {} and not capture_active()
    assert_close(run(w, M.NONE, None, x), fn(x))  # eager is fine


# Composite ATen ops whose parts sync; under inference_mode they reach the recorder whole.
COMPOSITE_SYNCS = [
    pytest.param(lambda x: x * len(torch.nonzero(x, as_tuple=True)[0]), id="nonzero-as-tuple"),
    pytest.param(lambda x: torch.combinations(x, 2).sum() + x, id="combinations"),
    pytest.param(lambda x: torch.repeat_interleave(x, (x > 0).long()).sum() + x, id="repeat_interleave"),
]


@pytest.mark.parametrize("fn", COMPOSITE_SYNCS)
def test_sync_inside_a_composite_op_raises_under_inference_mode(fn):
    # GPU: an op defined by its decomposition runs its parts; one of them syncs, so the capture fails.
    w = sim_full(fn)
    x = torch.arange(4.0)
    with torch.inference_mode():
        with pytest.raises(RuntimeError, match="capturing"):
            run(w, M.FULL, D4, x)
        assert w.entries == {}
        assert_close(run(w, M.NONE, None, x), fn(x))


def test_tolist_is_not_baked_into_the_replay():
    # GPU: the capture raises, so no replay can reuse the value read at capture time (today's bug
    # was a replay returning 8.0 where eager returns 16.0).
    def model(x: torch.Tensor) -> torch.Tensor:
        return x * x.sum().tolist()

    w = sim_full(model)
    with pytest.raises(RuntimeError, match="Tensor.tolist"):
        run(w, M.FULL, D4, torch.ones(4))
    x = torch.full((4,), 2.0)
    assert_close(run(w, M.NONE, None, x), torch.full((4,), 16.0))


def test_compiled_model_host_read_raises():
    # GPU: Dynamo breaks the graph at .tolist(); the eager code between the pieces runs inside the
    # capture and its read fails there.
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: x * x.sum().tolist(), backend=pb.make_backend(SIM))
    w = sim_full(compiled)
    x = torch.ones(4)
    compiled(x)  # compiled before the capture, as GraphRunner's warm-up does
    with pytest.raises(RuntimeError, match="capturing"):
        run(w, M.FULL, D4, x)
    assert w.entries == {}


def test_host_read_rules_hold_only_while_this_thread_records():
    # GPU: a host tensor (made from Python data, or read by another thread that is not capturing)
    # is read without a sync; outside a capture every read works. The CPU cannot tell a host
    # tensor from a device one, so another thread's reads count as host reads.
    sim = get_platform("simulated")
    t = torch.arange(3.0)
    rec = sim.begin()
    try:
        assert torch.tensor(2.0).tolist() == 2.0  # a host scalar made from Python data
        other: list[list[float]] = []
        thread = threading.Thread(target=lambda: other.append(t.tolist()))
        thread.start()
        thread.join()
        assert other == [[0.0, 1.0, 2.0]]
        with pytest.raises(RuntimeError, match="capturing"):
            t.tolist()
    finally:
        rec.abort()
    assert "tolist" not in torch.Tensor.__dict__ and torch.Tensor.__repr__.__module__ == "torch._tensor"
    assert t.tolist() == [0.0, 1.0, 2.0] and "tensor([0., 1., 2.])" == repr(t)


# ---------------------------------------------------------------- sync-free ops (issue 18, item 9)


@pytest.mark.parametrize("grad", [torch.no_grad, torch.inference_mode])
def test_repeat_interleave_with_output_size_is_captured(grad):
    # GPU: with output_size the kernel never reads the repeats on the host: the capture works and
    # each replay expands this step's repeats. Without it CUDA sums them on the host: a sync.
    x, repeats = torch.arange(4.0), torch.tensor([1, 2, 0, 1])
    with grad():
        w = sim_full(lambda x, r: torch.repeat_interleave(x, r, output_size=4) * 1)
        assert_close(run(w, M.FULL, D4, x, repeats), torch.tensor([0.0, 1.0, 1.0, 3.0]))
        repeats.copy_(torch.tensor([0, 0, 4, 0]))
        assert_close(run(w, M.FULL, D4, x, repeats), torch.full((4,), 2.0))
        unsized = sim_full(lambda x, r: torch.repeat_interleave(x, r) * 1)
        with pytest.raises(RuntimeError, match="capturing"):
            run(unsized, M.FULL, D4, x, repeats)


def test_one_hot_with_num_classes_is_captured():
    # GPU: CUDA's one_hot with num_classes is zeros + scatter, no host check of the values; each
    # replay encodes this step's indices. Without num_classes CUDA reads max() on the host.
    idx = torch.tensor([0, 2, 1, 2])
    with torch.inference_mode():
        w = sim_full(lambda i: F.one_hot(i, num_classes=3) * 1)
        assert_close(run(w, M.FULL, D4, idx), F.one_hot(idx, 3))
        idx.copy_(torch.tensor([1, 1, 0, 2]))
        assert_close(run(w, M.FULL, D4, idx), F.one_hot(idx, 3))
        unsized = sim_full(lambda i: F.one_hot(i) * 1)
        with pytest.raises(RuntimeError, match="capturing"):
            run(unsized, M.FULL, D4, idx)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_embedding_bag_is_captured(mode):
    # GPU: embedding_bag is ordinary kernels: captured, and each replay reads this step's indices.
    # (Its CPU kernel returns a view of a longer buffer; the bytes past the view are unreadable.)
    torch.manual_seed(0)
    bag = torch.nn.EmbeddingBag(10, 4, mode=mode)
    idx, offsets = torch.tensor([1, 2, 3, 4]), torch.tensor([0, 2])
    with torch.no_grad():
        w = sim_full(lambda i, o: bag(i, o) * 1)
        assert_close(run(w, M.FULL, D4, idx, offsets), bag(idx, offsets))
        idx.copy_(torch.tensor([5, 6, 7, 9]))
        assert_close(run(w, M.FULL, D4, idx, offsets), bag(idx, offsets))


def test_random_ops_advance_the_default_generator_on_every_replay():
    # GPU: the default generator is graph-safe: the capture does not advance it, each replay
    # draws the numbers the next eager call would have drawn, and moves it on.
    w = sim_full(lambda x: x + torch.rand(4))
    x = torch.zeros(4)
    with torch.inference_mode():
        torch.manual_seed(0)
        outs = [run(w, M.FULL, D4, x).clone() for _ in range(3)]
        after = torch.rand(4)
        torch.manual_seed(0)
        eager = [torch.rand(4) for _ in range(4)]
    assert_close(torch.stack(outs + [after]), torch.stack(eager))


def test_user_generator_is_refused_with_cudas_reason():
    # GPU: a torch.Generator the graph was not given raises "Attempt to increase offset for a CUDA
    # generator not in capture mode" (this was refused as an unrecordable Inductor kernel).
    g = torch.Generator().manual_seed(0)
    w = sim_full(lambda x: x + torch.rand(4, generator=g))
    with pytest.raises(RuntimeError, match="generator not in capture mode") as info:
        run(w, M.FULL, D4, torch.zeros(4))
    assert "default generator" in str(info.value) and "Inductor" not in str(info.value)
    assert w.entries == {} and not capture_active()


# ---------------------------------------------------------------- CUDA twins


def cuda_full(fn):
    return pb.CUDAGraphWrapper(fn, M.FULL, config=pb.CompilationConfig(platform="cuda", compile_pieces="eager"))


def warm(w, *args):
    with warmup_scope(get_platform("cuda")):
        out = run(w, M.NONE, None, *args)
    torch.cuda.synchronize()
    return out


@pytest.mark.cuda
@pytest.mark.parametrize("fn", HOST_READS)
def test_cuda_host_read_raises(fn):
    w = cuda_full(fn)
    x = torch.ones(4, device="cuda")
    warm(w, x)
    with pytest.raises(RuntimeError, match="capturing"):
        run(w, M.FULL, D4, x)
    assert w.entries == {} and not torch.cuda.is_current_stream_capturing()


@pytest.mark.cuda
@pytest.mark.parametrize("fn", COMPOSITE_SYNCS)
def test_cuda_sync_inside_a_composite_op_raises_under_inference_mode(fn):
    x = torch.arange(4.0, device="cuda")
    with torch.inference_mode():
        w = cuda_full(fn)
        warm(w, x)
        with pytest.raises(RuntimeError, match="capturing"):
            run(w, M.FULL, D4, x)
    assert w.entries == {} and not torch.cuda.is_current_stream_capturing()


@pytest.mark.cuda
def test_cuda_repeat_interleave_with_output_size_is_captured():
    x, repeats = torch.arange(4.0, device="cuda"), torch.tensor([1, 2, 0, 1], device="cuda")
    w = cuda_full(lambda x, r: torch.repeat_interleave(x, r, output_size=4) * 1)
    warm(w, x, repeats)
    assert_close(run(w, M.FULL, D4, x, repeats), torch.tensor([0.0, 1.0, 1.0, 3.0], device="cuda"))
    repeats.copy_(torch.tensor([0, 0, 4, 0]))
    assert_close(run(w, M.FULL, D4, x, repeats), torch.full((4,), 2.0, device="cuda"))
    unsized = cuda_full(lambda x, r: torch.repeat_interleave(x, r) * 1)
    warm(unsized, x, repeats)
    with pytest.raises(RuntimeError, match="capturing"):
        run(unsized, M.FULL, D4, x, repeats)


@pytest.mark.cuda
def test_cuda_one_hot_with_num_classes_is_captured():
    idx = torch.tensor([0, 2, 1, 2], device="cuda")
    with torch.inference_mode():
        w = cuda_full(lambda i: F.one_hot(i, num_classes=3) * 1)
        warm(w, idx)
        assert_close(run(w, M.FULL, D4, idx), F.one_hot(idx, 3))
        idx.copy_(torch.tensor([1, 1, 0, 2]))
        assert_close(run(w, M.FULL, D4, idx), F.one_hot(idx, 3))
        unsized = cuda_full(lambda i: F.one_hot(i) * 1)
        warm(unsized, idx)
        with pytest.raises(RuntimeError, match="capturing"):
            run(unsized, M.FULL, D4, idx)


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_cuda_embedding_bag_is_captured(mode):
    torch.manual_seed(0)
    bag = torch.nn.EmbeddingBag(10, 4, mode=mode).cuda()
    idx, offsets = torch.tensor([1, 2, 3, 4], device="cuda"), torch.tensor([0, 2], device="cuda")
    with torch.no_grad():
        w = cuda_full(lambda i, o: bag(i, o) * 1)
        warm(w, idx, offsets)
        assert_close(run(w, M.FULL, D4, idx, offsets), bag(idx, offsets))
        idx.copy_(torch.tensor([5, 6, 7, 9]))
        assert_close(run(w, M.FULL, D4, idx, offsets), bag(idx, offsets))


@pytest.mark.cuda
def test_cuda_random_ops_advance_the_default_generator_on_every_replay():
    w = cuda_full(lambda x: x + torch.rand(4, device="cuda"))
    x = torch.zeros(4, device="cuda")
    torch.manual_seed(0)
    warm(w, x)  # one eager draw
    outs = [run(w, M.FULL, D4, x).clone() for _ in range(3)]
    after = torch.rand(4, device="cuda")
    torch.manual_seed(0)
    eager = [torch.rand(4, device="cuda") for _ in range(5)]
    assert_close(torch.stack(outs + [after]), torch.stack(eager[1:]))


@pytest.mark.cuda
def test_cuda_user_generator_is_refused():
    g = torch.Generator(device="cuda").manual_seed(0)
    w = cuda_full(lambda x: x + torch.rand(4, device="cuda", generator=g))
    x = torch.zeros(4, device="cuda")
    warm(w, x)
    with pytest.raises(RuntimeError, match="generator not in capture mode"):
        run(w, M.FULL, D4, x)
    assert w.entries == {} and not torch.cuda.is_current_stream_capturing()
