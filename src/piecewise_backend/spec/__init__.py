"""Speculative decoding: a drafter proposes, the target verifies in one uniform step."""

from .engine import SpecEngine, truncated_drafter
from .state import RequestStates, RoundInfo, SpecStats, chunk_ends

__all__ = [
    "SpecEngine",
    "truncated_drafter",
    "chunk_ends",
    "RequestStates",
    "RoundInfo",
    "SpecStats",
]
