"""Speculative decoding (the documented path): a drafter proposes, the target verifies in one uniform step.

The code lives in :mod:`piecewise_backend.serve.speculative` (any model) and
:mod:`piecewise_backend.hf.speculative` (Hugging Face models).
"""

from ..hf.speculative import SpecEngine, truncated_drafter
from ..serve.loop import chunk_ends
from ..serve.speculative import RoundInfo, SpecStats, SpeculativeEngine

__all__ = [
    "SpecEngine",
    "SpeculativeEngine",
    "truncated_drafter",
    "chunk_ends",
    "RoundInfo",
    "SpecStats",
]
