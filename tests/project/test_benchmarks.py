"""The documented benchmark entry point runs (a smoke test: no timing is asserted here)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def test_quick_benchmarks_print_their_tables(tmp_path):
    doc = tmp_path / "benchmarks.md"
    shutil.copy(ROOT / "docs" / "benchmarks.md", doc)
    proc = subprocess.run(
        [sys.executable, "benchmarks/run.py", "--quick", "--only", "wrappers,replay", "--out", str(doc)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = proc.stdout
    assert "Wrapper passthrough cost" in out and "CUDAGraphWrapper(FULL) under PIECEWISE" in out
    assert "breakable / per-piece" in out
    written = doc.read_text()  # --out rewrites the results section with the environment recorded
    assert torch.__version__ in written and "Wrapper passthrough cost" in written
    assert written.count("<!-- BEGIN cpu-results -->") == 1


def test_dbo_benchmark_reports_both_variants_and_the_ratio():
    proc = subprocess.run(
        [sys.executable, "benchmarks/run.py", "--quick", "--only", "dbo"], cwd=ROOT, capture_output=True, text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Micro-batching (dual-batch overlap): step time on gloo" in proc.stdout
    assert "Micro-batching: thread hand-over cost (CPU)" in proc.stdout
    row = re.search(r"^\| 64 +\| [\d.]+ .*\| [\d.]+ .*\| ([\d.]+)x", proc.stdout, re.M)
    assert row and 0.2 < float(row.group(1)) < 5, proc.stdout  # a ratio was measured, whatever it is


def test_attention_benchmark_tables_and_memory_tracker(monkeypatch):
    """bench_attention's op table (two sizes, every output checked) and the live-bytes tracker its CPU memory
    column uses."""
    import time

    from benchmarks import bench_attention

    outside = torch.zeros(10000)
    with bench_attention.LiveBytes() as live:
        a = torch.empty(1000)  # 4000 bytes, alive
        b = torch.empty(250)
        del b  # freed before the next allocation: the peak counts it once
        c = a.view(10, 100)  # a view: no new storage
        d = torch.empty(500)
        outside[:10].add_(1)  # a view of a tensor made outside: not working memory
    assert live.peak == 4000 + 2000 and live.live >= 4000
    del a, c, d
    with torch.inference_mode():
        section = bench_attention.op_table(True, "cpu", time.monotonic() + 5, lens=(256, 1024), reps=3)
    assert "| bounded (captured) | 1024" in section.body and "peak MiB" in section.body
    memory = section.data["memory"]
    assert memory["reference", 1024] > 3 * memory["reference", 256]  # the reference grows with max_model_len
    assert memory["bounded (eager)", 1024] == memory["bounded (eager)", 256]
    assert section.data["failed"] == []
    real = bench_attention.op_variant

    def skewed(backend, captured, *args):  # a captured path that computes something else
        fn = real(backend, captured, *args)
        return (lambda: fn() + 1) if captured else fn

    monkeypatch.setattr(bench_attention, "op_variant", skewed)
    with torch.inference_mode():
        section = bench_attention.op_table(True, "cpu", time.monotonic() + 5, lens=(256,), reps=3)
    assert section.data["failed"] == ["bounded (captured) @256"] and "differ from the reference" in section.body


def test_hf_throughput_smoke_compares_three_engines_on_equal_tokens():
    """run.py --only hf_throughput on the CPU: every engine's row (or why transformers' own is absent), HFEngine's
    decode steps replayed FULL, its tokens equal per-prompt generate's, and the warning that CPU numbers mean little."""
    from benchmarks.bench_hf_throughput import decode_window

    # the window starts when every request has its first token: 2 tokens at t=1 are prefill, the rest is decode
    assert decode_window([(0.5, 2), (1.0, 2), (1.5, 2), (3.0, 2)], 1.0) == (4, 2.0)
    assert decode_window([(1.0, 4)], 1.0) == (0, 0.0)
    pytest.importorskip("transformers")
    proc = subprocess.run(
        [sys.executable, "benchmarks/run.py", "--quick", "--only", "hf_throughput"], cwd=ROOT, capture_output=True,
        text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = proc.stdout
    hf_row = re.search(r"^\| HFEngine FULL_AND_PIECEWISE .*\| (\d+) +\| ([\d,]+) +\| ([\d.]+)x.*\| (.*) \|$", out, re.M)
    assert hf_row, out
    assert hf_row.group(1) == "32" and float(hf_row.group(2).replace(",", "")) > 0  # 4 prompts x 8 new tokens
    assert "all 4 prompts; FULL replays 7/7 decode steps" in hf_row.group(4)
    assert re.search(r"^\| model\.generate \(eager, batch left padded\) +\| 32 .*\| 1\.000x", out, re.M), out
    cb_row = re.search(r"^\| transformers generate_batch .*\| 32 ", out, re.M)
    assert cb_row or "transformers continuous batching" in out, out  # a row, or the line saying why there is none
    assert "the CUDA graphs are simulated" in out


def test_state_benchmark_measures_memory_per_request_against_context():
    """bench_state on small contexts: state layers' bytes per request do not grow, KV bytes do; no KV without attention."""
    import importlib

    bench_state = importlib.import_module("benchmarks.bench_state")
    section = bench_state.run(quick=True, contexts=(16, 48))[0]
    assert "| state only (lfm2, 2 conv layers)" in section.body
    data = section.data
    assert data["lfm2"]["kv_bytes"] == {16: 0, 48: 0} and data["lfm2"]["state_bytes"] > 0
    assert data["mamba"]["kv_bytes"] == {16: 0, 48: 0} and data["mamba"]["state_bytes"] > 0
    assert data["qwen3_next"]["kv_bytes"][48] > data["qwen3_next"]["kv_bytes"][16] > 0
    assert data["llama"]["state_bytes"] == 0


def test_breaks_benchmark_reports_the_machinery_cost_per_segment():
    proc = subprocess.run(
        [sys.executable, "benchmarks/run.py", "--quick", "--only", "breaks"], cwd=ROOT, capture_output=True, text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Breaks anywhere: capture cost per segment (CPU)" in proc.stdout
    for row in ("eager (no capture)", "null platform", "simulated"):
        assert re.search(rf"^\| {re.escape(row)} +\| [\d.]+ ", proc.stdout, re.M), proc.stdout


def test_breaks_benchmark_gpu_part_runs_on_the_cuda_double():
    """The GPU comparison's control flow (both captures, both replays) on the CPU double of torch.cuda, so the
    GPU step cannot fail for a reason the CPU could have shown (its timings mean nothing here)."""
    import warnings

    from benchmarks import bench_breaks
    from pbtest import cuda_double

    with cuda_double.installed() as fake, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the double's kernels-free segments are "empty graphs"
        section = bench_breaks.gpu_section(True, None, device="cpu")
        cuda_double.check_clean(fake)
    assert "| breakable_graph " in section.body and "| per-segment torch.cuda.graph " in section.body
    assert section.body.count("ms per replay") == 1 and len(section.data["times"]["breakable_graph"]) == 3


def test_cuda_headline_checks_every_variant_and_fails_only_for_the_librarys_own(tmp_path, monkeypatch, capsys):
    """bench_cuda --headline on the simulator: the table is written out, torch's own variant failing (here: no
    CUDA) is a cell, not a failure; a library variant whose logits differ from eager's fails the benchmark."""
    from benchmarks import bench_cuda

    monkeypatch.setattr(bench_cuda, "HEADLINE_BATCHES", (1, 8))
    out = tmp_path / "headline.md"
    argv = ["--headline", "--quick", "--simulate", "--out", str(out)]
    assert bench_cuda.main(argv) == 0
    text = out.read_text()
    assert all(name in text for name in bench_cuda.LIBRARY)
    assert "not run: needs a CUDA device" in text and "measuring" not in text and torch.__version__ in text
    assert re.search(r"^\| 8 +\| [\d.]+ +\| [\d.]+ ", text, re.M), text  # eager and FULL measured at batch 8
    monkeypatch.setattr(bench_cuda, "agree", lambda got, ref: (False, 1.0))
    capsys.readouterr()
    assert bench_cuda.main(argv) == 1
    assert "FAILED: FULL, breakable PIECEWISE, per-piece PIECEWISE" in capsys.readouterr().out
    assert "logits differ from eager at batch 1" in out.read_text()


def test_serving_benchmark_splits_the_time_to_first_token():
    """bench_serving's cold-start child (in this process here): its parts add up; a lazy engine captures nothing and
    serves its first token before Dynamo traces anything."""
    pytest.importorskip("transformers")
    from benchmarks import bench_serving

    result = bench_serving.child("lazy", "cpu", quick=True)
    assert result["graphs"] == 0 and result["capture_s"] < 0.05
    assert abs(result["build_s"] + result["capture_s"] + result["first_step_s"] - result["ttft_s"]) < 1e-6
    assert result["dynamo_s"] == 0 and len(result["tokens"]) == 4


def test_cold_start_and_soak_benchmarks_print_their_tables():
    """bench_cold_start and bench_soak through the entry point (--quick): both tables, tokens equal (exit 0)."""
    pytest.importorskip("transformers")
    proc = subprocess.run(
        [sys.executable, "benchmarks/run.py", "--quick", "--only", "cold_start,soak"], cwd=ROOT, capture_output=True,
        text=True, timeout=900, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = proc.stdout
    assert "Cold start: seconds per captured graph, up-front vs capture_idle" in out and "| 2      | capture_idle" in out
    assert "| 2      | no Dynamo" in out  # compile_pieces="none"'s capture() beside the compiled one
    assert "Cold start: a lazy engine under traffic that never drains (soak)" in out
    assert re.search(r"\| round 2 +\| lazy +\| \d+ +\| \d+ \(\d+%\)", out), out


def test_host_benchmark_times_runner_and_engine_steps_side_by_side():
    proc = subprocess.run(
        [sys.executable, "benchmarks/run.py", "--quick", "--only", "host"], cwd=ROOT, capture_output=True, text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = proc.stdout
    assert "Host time per FULL decode step, outside the replay" in out
    for what in ("GraphRunner.run, batch 1", "GraphRunner.run, batch 8", "Engine.step, batch 1", "Engine.step, batch 8"):
        row = re.search(rf"^\| {re.escape(what)} +\| ([\d.]+) ", out, re.M)
        assert row and 0 < float(row.group(1)) < 100_000, out  # a time was measured, whatever it is
    assert re.search(r"Mode-mismatched passthrough / bare forwarder: [\d.]+x", out), out


def test_tp_benchmark_reports_both_engines_side_by_side():
    proc = subprocess.run(
        [sys.executable, "benchmarks/run.py", "--quick", "--only", "tp"], cwd=ROOT, capture_output=True, text=True,
        timeout=600, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Tensor parallel (HF llama, tp_plan='auto'): decode tokens/s on gloo" in proc.stdout
    rates = dict(re.findall(r"^\| (TP=[12]) +\| ([\d.]+) ", proc.stdout, re.MULTILINE))
    assert set(rates) == {"TP=1", "TP=2"} and all(float(r) > 0 for r in rates.values()), proc.stdout
    kv = [int(k) for k in re.findall(r"^\| TP=[12] +\| .*\| (\d+) +\|$", proc.stdout, re.MULTILINE)]
    assert len(kv) == 2 and kv[0] == 2 * kv[1], proc.stdout  # each TP=2 rank holds half the KV heads
    assert "tokens are equal" in proc.stdout, proc.stdout


def test_prefix_benchmark_compares_caching_on_and_off_on_equal_tokens(monkeypatch):
    from benchmarks import bench_prefix

    monkeypatch.setattr(bench_prefix, "SYSTEM_TOKENS", 48)  # smoke-sized: 3 blocks of 16
    section, same = bench_prefix.run(quick=True)
    assert same and section.data["identical"]
    assert "caching on" in section.body and "caching off" in section.body and "hit rate" in section.body
    assert section.data["ttft_ratio"] > 0
