"""The documented benchmark entry point runs (a smoke test: no timing is asserted here)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


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


def test_attention_benchmark_tables_and_memory_tracker():
    """bench_attention's op table (two sizes) and the live-bytes tracker its CPU memory column uses."""
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
