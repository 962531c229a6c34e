"""``transformers``, the optional extra every module of :mod:`piecewise_backend.hf` needs, imported on first use."""

from __future__ import annotations

from typing import Any


def transformers_module() -> Any:
    """``transformers``, imported on first use (the adapter is an optional extra), or a clear ImportError."""
    try:
        import transformers
    except ImportError as e:
        raise ImportError("piecewise_backend.hf needs transformers: pip install 'piecewise_backend[hf]'") from e
    return transformers
