"""``import piecewise_backend`` loads only what every user needs: Dynamo, Inductor, torch.fx and transformers
are imported by the paths that use them (compiling, the AOT artifact, the Hugging Face adapter), never by the
package itself, so the compile-free API, the simulator and every restart do not pay for them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch._dynamo", "torch._inductor", "torch.fx", "transformers", "sympy")

PROBE = """
import json, sys
import torch
before = set(sys.modules)
import {module}
print(json.dumps({{"new": sorted(set(sys.modules) - before), "all": sorted(sys.modules)}}))
"""


def loaded_by(module: str) -> tuple[set[str], set[str]]:
    """The modules a fresh interpreter has after ``import torch; import <module>``: (new ones, all)."""
    proc = subprocess.run([sys.executable, "-c", PROBE.format(module=module)], check=False, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return set(out["new"]), set(out["all"])


def heavy(names: set[str]) -> list[str]:
    return sorted(n for n in names if any(n == h or n.startswith(h + ".") for h in HEAVY))


@pytest.mark.parametrize("module", ["piecewise_backend", "piecewise_backend.serve", "piecewise_backend.kv",
                                    "piecewise_backend.testing", "piecewise_backend.backend"])
def test_importing_the_package_loads_no_compiler_and_no_transformers(module):
    new, everything = loaded_by(module)
    assert module in new
    assert heavy(new) == [], f"import {module} loaded {heavy(new)[:10]}"
    # torch 2.13 imports torch.fx itself; Dynamo, Inductor and transformers are not loaded at all
    assert not {"torch._dynamo", "torch._inductor", "transformers"} & everything


def test_the_probe_sees_a_heavy_import():
    """The check can fail: a module that does import Dynamo is reported."""
    new, _ = loaded_by("torch._dynamo")
    assert "torch._dynamo" in heavy(new)


def test_the_parallel_face_loads_no_fixture_until_a_sharding_name_is_read():
    new, _ = loaded_by("piecewise_backend.parallel")
    assert "piecewise_backend.runner.agreement" in new
    assert "piecewise_backend.testing.sharding" not in new  # (the package face itself loads testing.graphs)
    import piecewise_backend.parallel as parallel
    from piecewise_backend.testing import sharding

    for name in ("ToyMLP", "make_kv_caches", "shard_mlp", "shard_toy_llama"):
        assert getattr(parallel, name) is getattr(sharding, name) and name in parallel.__all__ and name in dir(parallel)
    with pytest.raises(AttributeError, match="has no attribute 'shard_everything'"):
        parallel.shard_everything  # noqa: B018
