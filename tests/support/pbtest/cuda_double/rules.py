"""What torch's CUDA graph and allocator code does, version by version: the rule table of the
CUDA double (tests/support/pbtest/cuda_double/fake.py) and of the GPU rule checks (tests/platforms/test_cuda_double.py -m cuda).

Each rule says from which torch release on it holds and where that was read. Sources: CG is
aten/src/ATen/cuda/CUDAGraph.cpp, CCA c10/cuda/CUDACachingAllocator.cpp, CHA
ATen/core/CachingHostAllocator.h, CTX ATen/cuda/CUDAContextLight.h (implemented in
ATen/cuda/CublasHandlePool.cpp); "2.11 binary" / "2.13 binary" are the disassembly of
``libtorch_cuda.so`` and ``libc10_cuda.so`` from the torch 2.11.0+cu130 wheel (the lent GPU machine's
torch) and the 2.13.0+cu130 wheel, "2.13 headers" the headers shipped with torch 2.13.0. The double follows the
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
        "CCA release_cached_blocks: the all-pools emptyCache() frees private pools only once freeable (use count 0; "
        "a routed pool holds a use), so it leaves routed pools alone without an error; only emptyCache(pool) (from "
        "~MemPool) asserts captures_underway.empty() (2.11 binary) / !is_capture_context() (2.13 binary)",
    ),
    "empty_cache_default_pools_only_outside_capture": Rule(
        (2, 13),
        "CCA release_cached_blocks(context, {0, 0}): the 2.11 binary syncs and frees the default pools only when "
        "captures_underway is empty (any graph capture or use_mem_pool routing, any thread); the 2.13 binary frees "
        "them unless is_capture_context() (num_active_captures_ > 0 and cudaStreamGetCaptureInfo of the caller's "
        "current stream active: issue 175015, graph capture untangled from user mempools, PR 168137). 2.12 not "
        "checked. Not modelled: 2.13's cudaFree from a non-capturing thread during another thread's capture",
    ),
    "stream_pool_of_32": Rule(
        (2, 11),
        "c10/cuda/CUDAStream.cpp getStreamFromPool (what torch.cuda.Stream() calls): kStreamsPerPool = 32 per device "
        "and priority level (min(-priority, max_stream_priorities - 1), at most 4 levels), handed out round robin "
        "(get_idx); priority > 0 refused (TORCH_CHECK). The CUDAStream.h note (2.13 headers): of 33 streams the first "
        "and the last are the same",
    ),
    "cublaslt_unified_workspace": Rule(
        (2, 12),
        "CTX getCUDABlasLtWorkspace: the 2.13 binary takes unified_cublas_and_lt_workspaces() (on unless "
        "TORCH_CUBLASLT_UNIFIED_WORKSPACE=0) and uses the cuBLAS workspace of (handle, stream) from "
        "cublas_handle_stream_to_workspace, making it (getNewWorkspace, 32 MiB on Hopper) if missing (PR 175879, "
        "merged after the 2.11 branch cut; 2.12 not checked). The 2.11 binary unifies only the size by default "
        "(PR 168175) and the workspace only when the variable is 1: an Lt GEMM (addmm with a bias, bf16) uses its "
        "own workspace per (handle, stream) in cublaslt_handle_stream_to_workspace (1 MiB), made lazily by the first "
        "Lt GEMM there; torch.cuda.current_blas_handle() does not make it",
    ),
    "blas_handles_pooled": Rule(
        (2, 11),
        "ATen/cuda/detail/DeviceThreadHandles.h (2.13 headers) DeviceThreadHandlePool: a thread's PoolWindow reserves "
        "a handle another thread released (available_handles, the last released first) before creating one; its "
        "destructor at thread exit gives the handles back (CTX getCurrentCUDABlasHandle: a thread_local PoolWindow). "
        "Workspaces are keyed by (handle, stream) in process-wide maps (CTX WorkspaceMapWithMutex): they outlive the "
        "thread and come with the handle to the next one",
    ),
    "event_query_unsafe_in_global_capture": Rule(
        (2, 11),
        "CUDA runtime, cudaStreamCaptureModeGlobal: cudaEventQuery and cudaStreamQuery are potentially unsafe calls; "
        "from any thread during a global-mode capture they fail and invalidate it (PR 104555 / PR 105182: the NCCL "
        "watchdog's cudaEventQuery crashed captures; PR 148594 queries under thread-local mode); an event recorded in "
        "an open capture, or a capturing stream, cannot be queried at all",
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
