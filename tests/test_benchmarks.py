"""The documented benchmark entry point runs (a smoke test: no timing is asserted here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_quick_benchmarks_print_their_tables():
    proc = subprocess.run(
        [sys.executable, "benchmarks/run.py", "--quick", "--only", "wrappers,replay"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = proc.stdout
    assert "Wrapper passthrough cost" in out and "CUDAGraphWrapper(FULL) under PIECEWISE" in out
    assert "breakable / per-piece" in out
    assert "torch" in out and "2." in out  # the environment table is recorded with the results
