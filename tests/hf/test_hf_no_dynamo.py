"""HFEngine with ``compile_pieces="none"`` (issue 45 point 2), simulated platform: llama, models Dynamo cuts into
several graphs (diffllama, xglm) and a hybrid with state layers (qwen3_next), served with FULL and PIECEWISE
replays and ``model.generate``'s tokens, no Dynamo graph compiled; tensor parallel on 2 gloo ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import piecewise_backend as pb

transformers = pytest.importorskip("transformers")
from piecewise_backend import hf

M = pb.CUDAGraphMode
HERE = Path(__file__).resolve().parent
CONFIG = pb.CompilationConfig(platform="simulated", compile_pieces="none", capture_sizes=[1, 2, 4, 8])
ENGINE = dict(max_num_reqs=3, max_model_len=32, block_size=4, max_num_batched_tokens=8)
PROMPTS = [list(range(10, 13)), list(range(40, 51)), [77]]


def reference_tokens(model: torch.nn.Module, prompt: list[int], new: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ["llama", "diffllama", "xglm", "qwen3_next"])  # qwen3_next: state ops break too
def test_served_with_full_and_piecewise_replays_and_generates_tokens(arch, monkeypatch):
    want = [reference_tokens(hf.tiny_random_model(arch), p, 5) for p in PROMPTS]

    def refuse(*args, **kwargs):
        raise AssertionError("torch.compile was called under compile_pieces='none'")

    monkeypatch.setattr(torch, "compile", refuse)
    engine = hf.HFEngine(hf.tiny_random_model(arch), CONFIG, **ENGINE)
    assert engine.runner.downgrades == ()
    steps: list[hf.StepInfo] = []
    with pb.expect(graphs=0, compiles=0):
        engine.capture()
        before = pb.counters["replays"]
        got = engine.generate(PROMPTS, 5, on_step=steps.append)
    assert got == want
    assert {s.mode for s in steps} == {M.FULL, M.PIECEWISE}
    assert pb.counters["replays"] - before == len(steps)  # every step replayed a graph


def test_tensor_parallel_ranks_serve_the_unsharded_tokens_without_dynamo(tmp_path):
    pytest.importorskip("accelerate")
    folder, out = tmp_path / "llama", tmp_path / "out"
    out.mkdir()
    hf.tiny_random_model("llama").save_pretrained(folder)
    root = HERE.parents[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PB_TP_COMPILE_PIECES="none",
               PYTHONPATH=os.pathsep.join([str(root / "src"), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(HERE / "tp_worker.py"), str(out), str(folder)]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    for rank in range(2):
        lines = (out / f"rank{rank}.txt").read_text().splitlines()
        result = json.loads(next(line for line in lines if line.startswith("RESULT ")).split(" ", 1)[1])
        assert result["greedy"] == result["expected"] and result["peers_same"], result
        assert result["full_decode"] >= 4 and result["piecewise"] >= 1, result  # FULL and PIECEWISE replays
        assert result["full_collectives"] == [2 * result["layers"] + 2], result  # collectives inside FULL graphs
