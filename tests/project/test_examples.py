"""The examples run as a user would run them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_serve_example_runs_piecewise_and_full_steps():
    # One intra-op thread: the toy model is tiny and the CI machine small and shared.
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "serve.py")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"serve.py exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    steps = re.findall(r"^step\s+\d+:\s+(\d+) tokens.*-> (\w+)\s+max\|diff\| (\S+)$", proc.stdout, re.MULTILINE)
    modes = {mode for _, mode, _ in steps}
    assert {"PIECEWISE", "FULL"} <= modes, proc.stdout
    assert all(float(diff) < 1e-3 for _, _, diff in steps), proc.stdout
    assert re.search(r"^captured \d+ graphs", proc.stdout, re.MULTILINE), proc.stdout


def test_serve_example_help_prints_usage_and_runs_nothing():
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "serve.py"), "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: serve.py") and "step" not in proc.stdout.split("options:")[-1]
    assert "captured" not in proc.stdout and "platform:" not in proc.stdout


def test_compile_split_example_shows_pieces_and_compile_once():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "compile_split.py"), "--layers", "3", "--pieces", "eager"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "graph 0: 7 pieces" in proc.stdout  # 2N+1 for N=3
    assert proc.stdout.count("splitting (runs eagerly") == 3
    assert re.search(r"max \|compiled - eager\|: \S+", proc.stdout)


def test_spec_decode_example_matches_generate():
    """One K/mode/drafter subset here (each run compiles two models); all 12 llama/qwen2 x K=1,2,4 x
    mode runs are the acceptance check (docs/engine.md#speculative-decoding)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "spec_decode.py"), "--arch", "qwen2", "--num-speculative-tokens", "2",
         "--target-mode", "FULL_AND_PIECEWISE", "--draft-layers", "3", "--check"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    rounds = re.findall(r"^round\s+\d+: .*(verify|mixed)\s* -> target (\w+), drafter ([\w,]+), accepted \[([\d, ]*)\]$",
                        proc.stdout, re.M)
    assert {(kind, mode) for kind, mode, _, _ in rounds} == {("mixed", "PIECEWISE"), ("verify", "FULL")}, proc.stdout
    assert all(set(d.split(",")) == {"PIECEWISE"} and len(d.split(",")) == 2 for _, _, d, _ in rounds), proc.stdout
    rate = float(re.search(r"^acceptance rate: (\S+)", proc.stdout, re.M).group(1))
    per_step = float(re.search(r"^tokens per target step: (\S+)", proc.stdout, re.M).group(1))
    assert 0 < rate <= 1 and per_step > 1, proc.stdout
    assert "check: 5/5 requests match model.generate" in proc.stdout


def test_own_model_example_serves_a_decoder_that_is_not_a_hf_model():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "own_model.py"), "--check"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert len(re.findall(r"^prompt \d: .* == full recompute$", proc.stdout, re.M)) == 4 and proc.stdout.rstrip().endswith("PASS"), proc.stdout
    assert re.search(r"modes \['FULL', 'PIECEWISE'\], chunked prefill: True, preemptions: [1-9]", proc.stdout), proc.stdout


def test_vlm_generate_example_checks_and_refuses():
    """examples/vlm_generate.py as the survey runs it: a served type exits 0 with its check line, a refused
    one exits 2 naming the reason."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    run = lambda arch: subprocess.run([sys.executable, str(ROOT / "examples" / "vlm_generate.py"), "--arch", arch,  # noqa: E731
                                       "--check"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    served = run("llava")
    assert served.returncode == 0, f"stdout:\n{served.stdout}\nstderr:\n{served.stderr}"
    assert "check: 2/2 requests match model.generate" in served.stdout
    refused = run("paligemma")
    assert refused.returncode == 2 and "bidirectionally over the whole prompt prefix" in refused.stderr, refused.stderr
