"""scripts/gpu_check.sh and scripts/gpu_smoke.py where there is no GPU: a clear FAIL, at once.

Without the gate, every CUDA test skips, pytest returns 0, and a run on a machine without a
usable GPU would read as a pass. (On a GPU these would run the whole check: skipped there.)
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the script runs the whole check")


def test_gpu_check_fails_at_the_gate_without_cuda(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path)}
    env.pop("GPU_CHECK_DRY_RUN", None)
    start = time.monotonic()
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], env=env, capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0, proc.stdout
    assert "FAIL gate: no CUDA device" in proc.stdout.splitlines()
    assert elapsed < 60, f"the gate took {elapsed:.0f} s"
    assert "FAIL gate: no CUDA device" in (tmp_path / "summary.txt").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["steps.log", "summary.txt"]  # no step ran


def test_gpu_smoke_fails_without_cuda():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_smoke.py")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "FAIL smoke: no CUDA device" in proc.stdout
