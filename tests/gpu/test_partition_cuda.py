"""use_inductor_graph_partition on CUDA: one Inductor compile partitioned at the splitting ops gives the outputs
per-piece compilation gives, in a GraphRunner's PIECEWISE, FULL and FULL_AND_PIECEWISE steps (a GPU-check step,
scripts/gpu_steps.py). Its simulated twin is tests/backend/test_partition.py (the partition wrapper's contract with
a fake partition, the refusal, what Inductor does with a CPU graph)."""

from __future__ import annotations

import pytest
import torch
from pbtest.helpers import make_model
from torch.testing import assert_close

import piecewise_backend as pb

pytestmark = pytest.mark.cuda

M = pb.CUDAGraphMode
TOL = dict(rtol=2e-3, atol=2e-3)
LAYERS = 2


def runner(partition: bool):
    """A FULL_AND_PIECEWISE runner of a 2-layer toy llama: partitioned Inductor compile, or eager pieces split
    before compiling (the per-piece scheme; eager so that the check costs one Inductor compile, not four)."""
    torch._dynamo.reset()
    model = make_model(num_layers=LAYERS, attention="inplace", device="cuda")
    config = pb.CompilationConfig(cudagraph_mode="FULL_AND_PIECEWISE", capture_sizes=[4, 8], platform="cuda",
                                  compile_pieces="inductor" if partition else "eager", use_breakable=False,
                                  use_inductor_graph_partition=partition)
    backend = pb.make_backend(config)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    r = pb.GraphRunner(compiled, config, inputs=[pb.StaticInput("input_ids")])
    r.capture(progress=False)
    return model, r, backend


def test_partitioned_compile_matches_per_piece_compilation_in_full_and_piecewise_steps():
    model, per_piece, _ = runner(partition=False)
    _, partitioned, backend = runner(partition=True)
    parts = [len(w.partitions) for w in backend.partitioned]
    assert parts and all(n == LAYERS + 1 for n in parts), parts  # cut at each attention op
    assert sum(len(w.entries) for w in backend.piece_wrappers) > 0  # partitions captured PIECEWISE graphs
    g = torch.Generator().manual_seed(0)
    modes = set()
    for n, uniform in ((3, False), (4, True), (8, False), (8, True), (5, False), (2, True)):
        ids = torch.randint(0, 128, (n,), generator=g).cuda()
        kw = dict(uniform_decode=True, num_reqs=n) if uniform else {}
        with torch.inference_mode():
            want = model(ids)
            a = per_piece.run(input_ids=ids, **kw).clone()
            b = partitioned.run(input_ids=ids, **kw).clone()
        modes.add(partitioned.last_mode)
        assert partitioned.last_mode == per_piece.last_mode
        assert_close(a, want, **TOL)
        assert_close(b, a, **TOL)
    assert modes == {M.FULL, M.PIECEWISE}
