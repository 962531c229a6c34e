"""A CPU test double of torch.cuda's graph API that enforces CUDA's capture rules (see fake.py)."""

from .fake import FakeCuda, check_clean, current, install, installed, per_release_fixture
from .graph import IMPLICIT, INVALIDATED, WORKSPACE, Capture, FakeCUDAGraph, FakeEvent, FakeMemPool, FakeStream

__all__ = [
    "FakeCuda", "check_clean", "current", "install", "installed", "per_release_fixture",
    "IMPLICIT", "INVALIDATED", "WORKSPACE", "Capture", "FakeCUDAGraph", "FakeEvent", "FakeMemPool", "FakeStream",
]
