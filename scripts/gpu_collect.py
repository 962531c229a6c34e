"""A pytest plugin for ``scripts/gpu_check.sh --plan``: one collection, the tests each step would run.

    python -m pytest --collect-only -q -p gpu_collect <every step's files>   # scripts/ on PYTHONPATH

reads the steps' selections (JSON: step -> {"tests": [...], "marker": "cuda"}) from the file named by
``GPU_CHECK_SELECTIONS`` and writes step -> count to ``GPU_CHECK_COUNTS``, matching each item as the
step's own ``pytest -m <marker> <tests>`` would select it. One process instead of one per step:
importing torch and the package dominates a collection (~10 s each on the 2-core CI machine).
"""

from __future__ import annotations

import json
import os
from typing import Any


def selected(nodeid: str, entries: list[str]) -> bool:
    """Whether ``pytest <entries>`` collects ``nodeid`` (an entry is a folder, a file or a node id)."""
    for entry in entries:
        entry = entry.rstrip("/")
        if nodeid == entry or nodeid.startswith((entry + "::", entry + "[", entry + "/")):
            return True
    return False


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    path = os.environ.get("GPU_CHECK_SELECTIONS")
    if not path:
        return
    with open(path) as f:
        steps = json.load(f)
    counts = {}
    for name, sel in steps.items():
        marker = sel.get("marker")
        counts[name] = sum(
            1 for item in items
            if selected(item.nodeid, sel["tests"]) and (not marker or item.get_closest_marker(marker) is not None)
        )
    with open(os.environ["GPU_CHECK_COUNTS"], "w") as f:
        json.dump(counts, f)
