"""Cross-rank agreement on ``torch.distributed``: process setup, and every rank running the same step.

The runner calls :func:`capture_agreement`, :func:`check_same_step` and :func:`wait_collectives`;
:func:`init_tensor_parallel` joins the process group ``torchrun`` describes. Sharding the toy
models lives in ``piecewise_backend.testing.sharding`` (see ``docs/distributed.md``).
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from ..context import BatchDescriptor
from ..modes import CUDAGraphMode
from ..observability import logger

DEFAULT_TIMEOUT_S = 120.0


def distributed() -> bool:
    """True in a process group of more than one rank (the checks below are no-ops otherwise)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def init_tensor_parallel(
    backend: str | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S
) -> torch.distributed.device_mesh.DeviceMesh:
    """Join the process group ``torchrun`` describes and return a 1-D mesh over every rank.

    ``backend`` defaults to NCCL with CUDA (each rank on GPU ``LOCAL_RANK``), else gloo.
    ``timeout_s`` bounds every collective: a rank whose peer died or never arrives raises
    after that long instead of waiting for torch's default of 10 to 30 minutes.
    """
    from torch.distributed.device_mesh import init_device_mesh

    if not timeout_s > 0:
        raise ValueError(f"init_tensor_parallel: timeout_s must be > 0 seconds, got {timeout_s!r}")
    cuda = torch.cuda.is_available()
    backend = backend or ("nccl" if cuda else "gloo")
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"init_tensor_parallel: backend must be 'nccl' or 'gloo', got {backend!r}")
    device_type = "cuda" if backend == "nccl" else "cpu"
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return init_device_mesh(device_type, (dist.get_world_size(),))


def _step_key(mode: CUDAGraphMode, desc: BatchDescriptor | None) -> tuple[int, int, int, int]:
    if desc is None:
        return (mode.value, -1, -1, 0)
    return (mode.value, desc.num_tokens, -1 if desc.num_reqs is None else desc.num_reqs, int(desc.uniform))


def _describe_key(key: tuple[int, ...]) -> str:
    mode, tokens, reqs, uniform = key
    desc = "no descriptor" if tokens < 0 else str(BatchDescriptor(tokens, None if reqs < 0 else reqs, bool(uniform)))
    return f"{CUDAGraphMode(mode).name} {desc}"


def gather_ints(key: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every rank's ``key`` (a few int64s, the same count on every rank), in rank order: one small all-gather."""
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mine = torch.tensor(key, dtype=torch.long, device=device)
    keys = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(keys, mine)
    return [tuple(k.tolist()) for k in keys]


def check_same_step(mode: CUDAGraphMode, desc: BatchDescriptor | None) -> None:
    """Raise on every rank when the ranks are about to run different descriptors in one step.

    A debug check (``CompilationConfig(debug_checks=True)``; one small all-gather per step):
    ranks that replay different graphs pair collectives of different shapes, which hangs or
    returns wrong values; this names the mismatch before any collective runs.
    """
    if not distributed():
        return
    keys = gather_ints(_step_key(mode, desc))
    if len(set(keys)) > 1:
        per_rank = ", ".join(f"rank {r}: {_describe_key(k)}" for r, k in enumerate(keys))
        raise RuntimeError(
            f"ranks dispatched different steps ({per_rank}); every rank must run the same batch "
            "(same token count, request count and decode flag) in each step: schedule on one rank "
            "and broadcast the batch, or seed every rank's scheduler the same"
        )


def wait_collectives(outputs: Any) -> None:
    """Wait on the functional-collective results in ``outputs`` that nothing will use.

    An eager DTensor step returns ``AsyncCollectiveTensor`` results, waited on when first
    used; a warm-up's outputs are dropped unused, and a collective never waited on stays in
    c10d's work registry (gloo warns about "unwaited collective calls" at exit).
    """
    if not distributed():
        return
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    for t in tree_leaves(outputs):
        if isinstance(t, AsyncCollectiveTensor):
            t.trigger_wait()
        elif isinstance(t, torch.Tensor) and is_traceable_wrapper_subclass(t):  # a DTensor holding one
            wait_collectives([getattr(t, name) for name in t.__tensor_flatten__()[0]])


class PeerCaptureError(RuntimeError):
    """Another rank failed while capturing, or captured a different descriptor."""


@contextlib.contextmanager
def capture_agreement(mode: CUDAGraphMode, desc: BatchDescriptor) -> Iterator[None]:
    """Around one descriptor's capture (and its first replay): no rank is left waiting on a failed one.

    A rank that raises here leaves the process group, so the peers' next collective (the
    replay that follows their capture) fails at once instead of waiting for a rank that
    will never come; then every rank checks that all captured the same descriptor.
    Capture failures are fatal in tensor parallel: restart the ranks.
    """
    if not distributed():
        yield
        return
    try:
        yield
    except Exception:
        logger.error(
            "capture of %s failed on rank %d: leaving the process group so the peers stop",
            _describe_key(_step_key(mode, desc)), dist.get_rank(),
        )
        dist.destroy_process_group()
        raise
    key = _step_key(mode, desc)
    keys: list[Any] = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(keys, key)
    except RuntimeError as e:
        raise PeerCaptureError(
            f"capture of {_describe_key(key)}: a peer rank left the process group (it failed during this "
            f"capture; its log says why): {e}"
        ) from e
    if len(set(keys)) > 1:
        per_rank = ", ".join(f"rank {r}: {_describe_key(k)}" for r, k in enumerate(keys))
        raise PeerCaptureError(
            f"ranks captured different descriptors in the same slot ({per_rank}): every rank needs the same "
            "CompilationConfig (capture sizes, mode, max_num_seqs) so the graphs hold the same collectives"
        )


# --- sharded toy models -------------------------------------------------------


