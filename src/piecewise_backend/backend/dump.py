"""Dump a split graph: debug log, tlparse artifacts, readable Python under ``debug_dump_dir``."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..observability import logger
from .split import SplitGraph


def _artifact(name: str, text: str) -> None:
    torch._logging.trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": name, "encoding": "string"},
        payload_fn=lambda: text,
    )


def dump_split(split: SplitGraph, graph_index: int, dump_dir: str | os.PathLike[str] | None) -> None:
    """Log the split, emit tlparse artifacts, and write readable Python to ``dump_dir`` if set."""
    summary = ", ".join(f"{p.name}:{'split' if p.is_splitting else 'compiled'}" for p in split.pieces)
    logger.debug("graph %d split into %d pieces: %s", graph_index, len(split.pieces), summary)
    _artifact(f"piecewise_split_graph_{graph_index}", split.split_gm.code)
    for p in split.pieces:
        _artifact(f"piecewise_graph_{graph_index}_{p.name}", p.module.code)
    if dump_dir is None:
        return
    out = Path(dump_dir) / f"graph_{graph_index}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "split.py").write_text(split.split_gm.print_readable(print_output=False))
    for p in split.pieces:
        kind = "splitting" if p.is_splitting else "compiled"
        (out / f"{p.name}_{kind}.py").write_text(p.module.print_readable(print_output=False))
    logger.info("dumped graph %d (%d pieces) to %s", graph_index, len(split.pieces), out)
