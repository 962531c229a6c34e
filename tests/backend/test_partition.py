"""use_inductor_graph_partition on the CPU (backend/partition.py): the partition wrapper's contract with a fake
partition callable, the op names Inductor partitions at, the config's refusal, and what Inductor does with a CPU
graph (the splitting op is a fallback kernel it would partition at; every other node is "cpu ops", so there is no
partition). The GPU path is tests/gpu/test_partition_cuda.py (a GPU-check step)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import piecewise_backend as pb
import piecewise_backend.kv
from piecewise_backend.backend.partition import Partition, PartitionWrappers, compile_partitioned, partition_op_names

M = pb.CUDAGraphMode
SIM = dict(platform="simulated", compile_pieces="eager")


@dataclasses.dataclass
class Meta:  # what Inductor passes the wrapper: torch._inductor.utils.CUDAGraphWrapperMetadata's fields
    num_partitions: int
    partition_index: int


class FakePartition:
    """An Inductor partition function: takes the list of its inputs, empties it (as Inductor's code does, to free
    them early), returns a list of outputs."""

    def __init__(self):
        self.calls = 0

    def __call__(self, args: list) -> list:
        self.calls += 1
        x, w = args
        args.clear()
        return [x @ w + 1]


def test_each_partition_becomes_a_piecewise_piece_that_captures_replays_and_passes_through():
    wrappers = PartitionWrappers(pb.CompilationConfig(cudagraph_mode="PIECEWISE", **SIM))
    fakes = [FakePartition(), FakePartition()]
    pieces = [wrappers(f, Meta(2, i)) for i, f in enumerate(fakes)]
    assert [type(p) for p in pieces] == [pb.CUDAGraphWrapper] * 2 and wrappers.wrappers == pieces
    assert [repr(p) for p in wrappers.partitions] == ["Partition(1 of 2)", "Partition(2 of 2)"]
    assert all(w.runtime_mode == M.PIECEWISE for w in pieces)
    x, w = torch.randn(4, 3), torch.randn(3, 3)
    pb.mark_persistent(x)
    inputs = [x, w]
    out = pieces[0](inputs)[0]  # no forward context: straight through
    assert torch.allclose(out, x @ w + 1) and inputs == [x, w]  # the caller's list is left whole
    for step in range(3):  # capture, then replays that read x in place
        x.copy_(torch.randn(4, 3))
        with pb.set_forward_context(M.PIECEWISE, pb.BatchDescriptor(4)):
            out = pieces[0]([x, w])[0]
        assert torch.allclose(out, x @ w + 1), step
    assert fakes[0].calls == 2 and len(pieces[0].entries) == 1  # one eager call, one capture; replays call nothing
    with pb.set_forward_context(M.FULL, pb.BatchDescriptor(4)):  # FULL: the outer graph captures, pieces pass through
        assert torch.allclose(pieces[1]([x, w])[0], x @ w + 1)
    assert fakes[1].calls == 1 and not pieces[1].entries


def test_without_piecewise_graphs_a_partition_is_the_bare_piece_and_a_second_application_starts_afresh():
    wrappers = PartitionWrappers(pb.CompilationConfig(cudagraph_mode="FULL_DECODE_ONLY", **SIM))
    first = wrappers(FakePartition(), Meta(1, 0))
    assert isinstance(first, Partition) and wrappers.wrappers == []
    again = wrappers(FakePartition(), Meta(1, 0))  # Inductor applied the wrappers again (a cache hit)
    assert wrappers.partitions == [again]


def test_partition_op_names_are_what_inductor_matches_and_python_functions_are_refused():
    packet = torch.ops.pb_kv.paged_attention
    assert partition_op_names(["ns::op", packet, packet.default]) == [
        "ns::op", "pb_kv::paged_attention", "pb_kv::paged_attention.default"
    ]
    from piecewise_backend.kv.op import paged_attention

    assert partition_op_names([paged_attention]) == ["pb_kv::paged_attention"]  # the custom_op object
    with pytest.raises(ValueError, match=r"splitting ops \['gelu'\] are Python functions.*torch.library custom op"):
        partition_op_names([torch.nn.functional.gelu])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal without a GPU (a GPU machine accepts the option)")
def test_without_a_gpu_the_config_refuses_the_partition_naming_why():
    with pytest.raises(ValueError, match=r"use_inductor_graph_partition=True is refused: no GPU here, and Inductor "
                                         r"partitions only GPU nodes .*'cpu ops'"):
        pb.CompilationConfig(use_inductor_graph_partition=True, use_breakable=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a GPU machine's refusals (CPU: refused for want of a GPU)")
@pytest.mark.cuda
@pytest.mark.parametrize("kwargs, why", [
    (dict(), "pass use_breakable=False"),
    (dict(use_breakable=False, cache_dir="/tmp/x"), "pass cache_dir=None"),
    (dict(use_breakable=False, compile_pieces="eager"), "compile_pieces='inductor'"),
])
def test_on_a_gpu_the_config_refuses_what_the_partition_does_not_do(kwargs, why):
    with pytest.raises(ValueError, match=why):
        pb.CompilationConfig(use_inductor_graph_partition=True, **kwargs)
    assert pb.CompilationConfig(use_inductor_graph_partition=True, use_breakable=False).use_inductor_graph_partition


def test_a_cpu_graph_gets_no_partition_and_paged_attention_is_the_fallback_kernel_inductor_would_cut_at(monkeypatch):
    """Inductor's scheduler on a CPU graph: pb_kv::paged_attention (which mutates ``out``) reaches it as a
    FallbackKernel and gets the custom-partition reason; every other node gets "cpu ops", so Inductor makes no
    partition and never calls the wrapper: why the config refuses the option without a GPU."""
    from torch._inductor import scheduler
    from torch.fx.experimental.proxy_tensor import make_fx

    from piecewise_backend.backend.compiler import _compile_inductor

    reasons = []
    real = scheduler.Scheduler.should_partition

    def record(self, node):
        reason = real(self, node)
        reasons.append((type(node.node).__name__, str(getattr(node.node, "op_overload", "")), reason))
        return reason

    monkeypatch.setattr(scheduler.Scheduler, "should_partition", record)

    def f(q, k, v, w):
        q = (q @ w).relu()
        out = torch.empty_like(q)
        torch.ops.pb_kv.paged_attention(q, k, v, out, 0, 0.5, -1)
        return (out @ w).sin()

    example = [torch.randn(4, 2, 8), torch.randn(4, 1, 8), torch.randn(4, 1, 8), torch.randn(8, 8)]
    gm = make_fx(f, tracing_mode="fake")(*example)
    for node, value in zip([n for n in gm.graph.nodes if n.op == "placeholder"], example):
        node.meta["example_value"] = value
    wrappers = PartitionWrappers(pb.CompilationConfig(cudagraph_mode="PIECEWISE", **SIM))
    compile_partitioned(lambda: _compile_inductor(gm), [torch.ops.pb_kv.paged_attention], wrappers)
    cut = [r for r in reasons if r[0] == "FallbackKernel" and r[1] == "pb_kv.paged_attention.default"]
    assert cut and all(r[2] == "custom partition op: pb_kv::paged_attention.default" for r in cut), reasons
    assert {r[2] for r in reasons if r not in cut} == {"cpu ops"}, reasons
    assert wrappers.partitions == []  # no partition on the CPU
    import torch._inductor.utils as inductor_utils

    assert inductor_utils._unstable_customized_partition_wrapper.wrapper is None  # the hook was restored
