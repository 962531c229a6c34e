"""CUDA platform: what is left to undo after a capture failed inside CUDA, on torch 2.11 and later.

A capture CUDA invalidated (a host sync, another thread's sync or cudaMalloc, an unjoined side
stream) fails in ``capture_end``. What the allocators then still hold depends on the release
(tests/support/pbtest/cuda_double/rules.py has the sources):

* torch 2.11 raises before ending the pool routing of the device and the host allocator; 2.12+
  (PR 180395) ends both first. The platform ends the device routing itself where it is still on.
  No binding ends the host routing, and its filter points at the failed graph: the graph object is
  kept alive for the process, and the pool id is never captured into again.
* Without PR 190348, ``reset()`` of a failed graph gives back neither of its pool uses, so the
  pool would never become freeable. The platform measures that on the pool's use count, gives the
  device uses back itself when the generation ends, and counts the host uses it cannot release.

Later captures move to a new generation (fresh pool and stream); graphs captured before keep theirs.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ...observability import logger

if TYPE_CHECKING:
    from .pools import Generation, Generations


class CaptureHost(Protocol):
    """What a segment recorder and :func:`recover` need of the CUDA platform (typed here, not
    imported: the platform module imports this one)."""

    device: int
    generations: Generations
    broken: str | None

    def route_breaks(self) -> None: ...

    def unjoined_streams(self) -> list[Any]: ...

    def segment_ended(self) -> None: ...

    def capture_error_mode(self) -> str: ...

RULES = (
    "keep host syncs (.item(), nonzero, torch.cuda.synchronize), other threads' GPU work and unjoined "
    "side streams out of a capture (see 'CUDA rules' in docs/troubleshooting.md)"
)
_failed_graphs: list[Any] = []  # see the module docstring: a host routing may still point at them


class CaptureInvalidatedError(RuntimeError):
    """CUDA invalidated a capture; the platform recovered and the next capture can run."""


def recover(platform: CaptureHost, graph: Any, gen: Generation, error: BaseException, *, began: bool) -> None:
    """After a capture that failed inside CUDA; ``began``: capture_begin returned. Refuses later
    captures (``platform.broken``) when the state cannot be restored."""
    problems = []
    routing_was_on = False
    try:
        torch._C._cuda_endAllocateToPool(platform.device, gen.id)
        routing_was_on = True  # torch 2.11 (or a capture_begin that failed after routing began)
    except Exception as e:  # RuntimeError, or AttributeError from a torch without the binding
        if "not currently recording" not in str(e):
            problems.append(f"ending the allocator's routing to pool {gen.id} failed ({e})")
    before = gen.mempool.use_count()
    with contextlib.suppress(Exception):
        graph.reset()
    if (began or routing_was_on) and gen.mempool.use_count() == before:
        gen.leaked += 1  # no PR 190348: reset() kept the failed capture's pool uses
        platform.generations.leaked_host_uses += 1
    _failed_graphs.append(graph)
    gen.failures += 1
    platform.generations.failed_captures += 1
    with torch.cuda.device(platform.device), torch.cuda.stream(gen.stream):
        if torch.cuda.is_current_stream_capturing():
            problems.append("the capture stream is still capturing")
    if problems:
        platform.broken = (
            f"CUDA graph capture on cuda:{platform.device} cannot be used again in this process: a capture failed "
            f"({error}) and {'; '.join(problems)}. Restart the process; to prevent it, {RULES}"
        )
        raise RuntimeError(platform.broken) from error
    if gen is platform.generations.current:
        platform.generations.switch()
    logger.warning(
        "CUDA graph capture failed (%s); allocator routing ended, later captures use pool %s (%d failed captures "
        "so far, %d host pool uses leaked)",
        error, platform.generations.current.id, platform.generations.failed_captures,
        platform.generations.leaked_host_uses,
    )

