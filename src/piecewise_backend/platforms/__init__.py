"""Graph platforms: real CUDA graphs (``cuda/``), or a faithful CPU simulator (``simulated/``).

A platform opens capture *scopes* (one per wrapper capture call: stream, gc) and records
*segments* inside them; a finished segment is a graph with ``replay()``."""

from .base import Graph, Platform, Recorder, Recording, fresh_outputs, may_collect_garbage, set_gc_managed
from .registry import (
    config_platform_name,
    effective_mode,
    get_platform,
    resolve_platform_name,
    warm_up,
    warmed_step,
    warmup_scope,
)

__all__ = [
    "fresh_outputs",
    "Graph",
    "Platform",
    "Recorder",
    "Recording",
    "may_collect_garbage",
    "set_gc_managed",
    "config_platform_name",
    "effective_mode",
    "get_platform",
    "resolve_platform_name",
    "warm_up",
    "warmed_step",
    "warmup_scope",
]
