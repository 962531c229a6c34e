"""The simulated platform: CUDA graph semantics on the CPU, recorded at the ATen dispatcher."""

from .checks import UnrecordableError
from .classify import OpKind, classify, is_composite
from .platform import SimulatedGraph, SimulatedPlatform, is_recording
from .pool import BLOCK, PoolMode, SimPool

__all__ = [
    "is_recording",
    "SimulatedGraph",
    "SimulatedPlatform",
    "UnrecordableError",
    "classify",
    "is_composite",
    "OpKind",
    "BLOCK",
    "PoolMode",
    "SimPool",
]
