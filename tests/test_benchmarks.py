"""The documented benchmark entry point runs (a smoke test: no timing is asserted here)."""

from __future__ import annotations

import re
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
