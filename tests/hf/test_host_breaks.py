"""Automatic breaks for HF models that read the host (hf/host_breaks.py), on the simulated platform."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import piecewise_backend as pb
from piecewise_backend.runner import drop_full_graphs

transformers = pytest.importorskip("transformers")
from piecewise_backend import hf  # noqa: E402
from piecewise_backend.hf import host_breaks  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
M = pb.CUDAGraphMode


class Traced(Exception):
    pass


@pytest.mark.parametrize(
    "arch, breaks",
    [
        # the router returns expert_size as a list of ints its parent consumes: the break holds the
        # parent (the attention module of jetmoe's mixture of attention heads, and the MoE block)
        ("jetmoe", ["model.layers.0.self_attention", "model.layers.0.mlp", "model.layers.1.self_attention", "model.layers.1.mlp"]),
        # the experts loop over nonzero() and .item() themselves, taking and returning tensors: they are the break
        ("longcat_flash", ["model.layers.0.mlp.experts"]),  # the tiny config has one MoE layer
    ],
)
def test_the_smallest_module_around_a_host_read_that_takes_and_returns_tensors_becomes_a_break(arch, breaks):
    model = hf.tiny_random_model(arch)
    adapted = hf.adapt(model)
    assert adapted.host_breaks == breaks
    for path in breaks:
        assert isinstance(model.get_submodule(path).pb_host_break, int)
    # Dynamo traces one graph (no graph break) with one opaque op per break, which the backend splits at
    graphs = []

    def trace_only(gm, example_inputs, **kwargs):
        graphs.append(gm)

        def run(*args):
            raise Traced  # running would need a step's attention metadata

        return run

    torch._dynamo.reset()
    with torch.no_grad(), pytest.raises(Traced):
        torch.compile(adapted, backend=trace_only)(torch.arange(1, 7), torch.arange(6))
    assert len(graphs) == 1
    ops = [n for n in graphs[0].graph.nodes if n.op == "call_function" and "module_break" in str(n.target)]
    assert len(ops) == len(breaks)
    assert "pb_hf::module_break" in pb.registered_splitting_ops()
    torch._dynamo.reset()


@pytest.mark.parametrize("arch", ["jetmoe", "longcat_flash"])
def test_host_reading_models_pass_the_example_check_with_breaks(arch):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "hf_generate.py"), "--arch", arch, "--check"],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    steps = re.findall(r"^step\s+\d+:.*(decode|mixed)\s* -> (\w+)$", proc.stdout, re.M)
    # no FULL graph holds a break: decode steps replay PIECEWISE graphs too
    assert {(kind, mode) for kind, mode in steps} == {("mixed", "PIECEWISE"), ("decode", "PIECEWISE")}, proc.stdout
    assert "check: 5/5 requests match model.generate" in proc.stdout


def test_mode_resolution_drops_full_graphs_with_the_reason_logged(caplog):
    assert drop_full_graphs(M.FULL_AND_PIECEWISE, "x") == M.PIECEWISE
    assert drop_full_graphs("FULL", "x") == M.PIECEWISE
    assert drop_full_graphs(M.FULL_DECODE_ONLY, "x") == M.NONE
    assert drop_full_graphs(M.PIECEWISE, "x") == M.PIECEWISE and drop_full_graphs(M.NONE, "x") == M.NONE
    config = pb.CompilationConfig(cudagraph_mode="FULL_AND_PIECEWISE", platform="simulated", compile_pieces="eager")
    assert host_breaks.no_full_graphs(config, []) is config
    with caplog.at_level(logging.INFO, logger="piecewise_backend"):
        lowered = host_breaks.no_full_graphs(config, ["model.layers.0.mlp"])
    assert lowered.cudagraph_mode == M.PIECEWISE
    assert "FULL_AND_PIECEWISE -> PIECEWISE" in caplog.text and "reads the host in model.layers.0.mlp" in caplog.text


def test_a_module_returning_host_values_cannot_be_the_break():
    t3, t5 = torch.zeros(1, 3, 4), torch.zeros(1, 5, 4)
    router = {3: (((t3,), {}), (t3[0], [1, 2])), 5: (((t5,), {}), (t5[0], [2, 3]))}
    assert "returns something other than tensors" in host_breaks._plan("R.router", torch.nn.Identity(), router)
    assert host_breaks._plan("R.experts", torch.nn.Identity(), {}) == "its forward is not called"
    sized = {3: (((t3, 3), {}), t3), 5: (((t5, 5), {}), t5)}  # the token count passed as a Python int
    assert "differs with the token count" in host_breaks._plan("R.block", torch.nn.Identity(), sized)
    ok = host_breaks._plan("R.block", torch.nn.Identity(), {3: (((t3, None), {"flag": True}), (t3, None)),
                                                           5: (((t5, None), {"flag": True}), (t5, None))})
    assert isinstance(ok, host_breaks.ModuleBreak)
    assert ok.sizes == [((0, 1), (1, 0), (0, 4))] and ok.token_dim == (0, 1, 1, 0)  # (1, tokens, 4)


def test_a_break_module_called_with_another_structure_says_so():
    model = hf.tiny_random_model("longcat_flash")
    hf.adapt(model)
    experts = model.get_submodule("model.layers.0.mlp.experts")
    x, idx, w = torch.zeros(3, model.config.hidden_size), torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, 2)
    with pytest.raises(ValueError, match="the call.* is NoneType None, but the probe that made this module a break saw a tensor"):
        experts(x, None, w)
    assert experts(x, idx, w).shape == x.shape  # the break itself runs eagerly outside a capture


def test_a_host_reading_model_lists_its_lost_full_graphs_in_the_runners_downgrades():
    config = pb.CompilationConfig(cudagraph_mode="FULL_AND_PIECEWISE", capture_sizes=[1, 2, 4], platform="simulated",
                                  compile_pieces="eager")
    engine = hf.HFEngine(hf.tiny_random_model("jetmoe"), config, max_num_reqs=2, max_model_len=32, block_size=4)
    assert engine.runner.mode == M.PIECEWISE
    lost = [d for d in engine.runner.downgrades if "FULL_AND_PIECEWISE -> PIECEWISE" in d]
    assert len(lost) == 1 and "reads the host in model.layers.0.self_attention" in lost[0], engine.runner.downgrades
    assert host_breaks.host_read_downgrades(config, []) == ()
    assert host_breaks.host_read_downgrades(config.replace(cudagraph_mode="PIECEWISE"), ["m"]) == ()  # nothing lost
