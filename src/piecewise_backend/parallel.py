"""Documented path of tensor parallelism: cross-rank step agreement (``runner.agreement``), re-exported.

The toy models' sharding (``shard_toy_llama``, ``make_kv_caches``, ``ToyMLP``, ``shard_mlp``) is a
fixture and lives in ``testing.sharding``; its names stay importable from here as lazy aliases, so
importing this module loads no fixture.
"""

from __future__ import annotations

from typing import Any

from .runner.agreement import (
    DEFAULT_TIMEOUT_S,
    PeerCaptureError,
    capture_agreement,
    check_same_step,
    distributed,
    init_tensor_parallel,
    wait_collectives,
)

#: Names read from ``testing.sharding`` on first use (PEP 562).
_SHARDING = ("ToyMLP", "make_kv_caches", "shard_mlp", "shard_toy_llama")

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "PeerCaptureError",
    "capture_agreement",
    "check_same_step",
    "distributed",
    "init_tensor_parallel",
    "wait_collectives",
    *_SHARDING,
]


def __getattr__(name: str) -> Any:
    if name in _SHARDING:
        from .testing import sharding

        return getattr(sharding, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_SHARDING))
