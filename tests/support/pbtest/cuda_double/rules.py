"""What torch's CUDA graph and allocator code does, version by version: the rule table of the
CUDA double (tests/support/pbtest/cuda_double/fake.py) and of the GPU rule checks (tests/platforms/test_cuda_double.py -m cuda).

Each rule says from which torch release on it holds and where that was read. Sources: CG is
aten/src/ATen/cuda/CUDAGraph.cpp, CCA c10/cuda/CUDACachingAllocator.cpp, CHA
ATen/core/CachingHostAllocator.h, CTX ATen/cuda/CUDAContextLight.h; "2.11 binary" is the
disassembly of ``libtorch_cuda.so`` from the torch 2.11.0+cu130 wheel (the lent GPU machine's
torch), "2.13 headers" the headers shipped with torch 2.13.0. The double follows the
installed torch (:func:`holds`); a test may pin another version with :func:`pinned`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

TESTED = ((2, 11), (2, 13))  # torch releases the CPU suite ran under (README "Versions")


@dataclass(frozen=True)
class Rule:
    since: tuple[int, int] | None  # first release that behaves so; None: no tabled release does
    source: str


RULES: dict[str, Rule] = {
    "host_pool_registration": Rule(
        (2, 11),
        "CG capture_begin: getHostAllocator(kCUDA)->begin_allocate_to_pool(mempool_id_) after the device "
        "beginAllocateToPool; reset(): release_pool on both (2.11 binary: CUDAGraph::reset calls the host "
        "allocator's release_pool; CHA create_or_incref_pool_under_lock asserts use_count > 0 on a known id)",
    ),
    "reset_clears_cublas_workspace": Rule(
        (2, 12),
        "PR 175276: CG reset() calls clearCublasWorkspacesForStream(capture_stream_) (declared in the 2.13 "
        "headers, CTX; absent from the 2.11 headers and from the 2.11 binary's CUDAGraph::reset); the map is "
        "process-wide, keyed by (cuBLAS handle, stream), one handle per thread (upstream issue 193402)",
    ),
    "failed_capture_end_ends_routing": Rule(
        (2, 12),
        "PR 180395: CG capture_end calls endAllocateToPool (device and host) before AT_CUDA_CHECK of "
        "cudaStreamEndCapture; the 2.11 binary checks first, so a failed capture leaves both routings on",
    ),
    "failed_capture_releases_pool": Rule(
        None,
        "PR 190348: CG reset() releases the pool use of a capture that began but did not end (allocated_pool_); "
        "without it the failed graph's device and host uses leak and its pool never becomes freeable",
    ),
    "empty_cache_skips_routed_pools": Rule(
        (2, 11),
        "CCA release_cached_blocks: the all-pools emptyCache() synchronizes only without captures underway and "
        "leaves routed pools alone; only emptyCache(pool) (from ~MemPool) asserts captures_underway.empty()",
    ),
}

_pinned: list[tuple[int, int]] = []


def installed() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def version() -> tuple[int, int]:
    """The torch release the double imitates: the installed one, unless a test pinned another."""
    return _pinned[-1] if _pinned else installed()


def holds(name: str, at: tuple[int, int] | None = None) -> bool:
    rule = RULES[name]
    return rule.since is not None and (at or version()) >= rule.since


def cite(name: str) -> str:
    return f"{name} ({'not in any tabled release' if RULES[name].since is None else f'torch >= {RULES[name].since[0]}.{RULES[name].since[1]}'}): {RULES[name].source}"


@contextlib.contextmanager
def pinned(release: tuple[int, int]) -> Iterator[None]:
    """Make the double behave as torch ``release`` does (e.g. 2.11's failed capture_end on a 2.13 CI)."""
    _pinned.append(release)
    try:
        yield
    finally:
        _pinned.pop()
