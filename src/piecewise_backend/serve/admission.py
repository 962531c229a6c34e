"""Tensor parallel admission: every rank must serve the same requests, checked as the stepping thread admits them.

Under tensor parallelism every rank runs one scheduler program over its own copy of the requests, and
the collectives inside the model pair each rank's step with the others'. Ranks given different requests
compute silently wrong tokens (the vocab-parallel embedding all-reduces different token ids). So before
each step under a process group, :class:`Admission` all-gathers the count and one digest of the requests
added since the last step (``add_request`` may run on any thread; the step's lock orders them), and when
they differ, exchanges each request's field digests and refuses on every rank, naming the request and the
field (prompt, max_new_tokens, stop_token_ids, sampling, cache_salt: a different salt would make a different
prefix-cache decision) with each rank's value.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from ..runner.agreement import gather_ints
from .scheduler import Request

__all__ = ["FIELDS", "Admission", "AdmissionMismatch", "request_fields"]

#: What must agree across ranks for each request, in the order of :func:`request_fields`.
FIELDS = ("prompt", "max_new_tokens", "stop_token_ids", "sampling", "cache_salt")


class AdmissionMismatch(ValueError):
    """The ranks were given different requests; ``requests``: the ones this rank added since the last step."""

    def __init__(self, message: str, requests: Sequence[Request]):
        super().__init__(message)
        self.requests = list(requests)


def _digest(value: Any) -> int:
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little", signed=True)


def _values(r: Request) -> tuple[Any, ...]:
    s = r.sampling
    sampling = ("greedy",) if r.greedy else (s.temperature, s.top_k, s.top_p, r.seed)
    return (r.prompt, r.max_new_tokens, sorted(r.stop_token_ids), sampling, r.cache_salt)


def request_fields(request: Request) -> tuple[int, ...]:
    """A digest of each of ``request``'s :data:`FIELDS` (the resolved seed: seedless requests take rank 0's)."""
    return tuple(_digest(v) for v in _values(request))


class Admission:
    """The requests added since the last step, checked across ranks by :meth:`check` before the next one."""

    def __init__(self) -> None:
        self.pending: list[Request] = []

    def note(self, request: Request) -> None:
        self.pending.append(request)

    def check(self) -> None:
        """Every rank added the same requests since the last step, or :class:`AdmissionMismatch` on every rank."""
        pending, self.pending = self.pending, []
        fields = [request_fields(r) for r in pending]
        counts = gather_ints((len(fields), _digest(fields)))
        if len(set(counts)) == 1:
            return
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, [(repr(r.tag), _values(r)) for r in pending])
        raise AdmissionMismatch(_difference(everyone), pending)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _difference(everyone: list[list[tuple[str, tuple[Any, ...]]]]) -> str:
    tail = ("; every rank must add the same requests (prompt, budget, stop tokens, sampling and cache salt) in the same order "
            "before each step: these requests were refused on every rank")
    sizes = [len(x) for x in everyone]
    if len(set(sizes)) > 1:
        per_rank = ", ".join(f"rank {r}: {n}" for r, n in enumerate(sizes))
        return f"tensor parallel: the ranks added different numbers of requests before this step ({per_rank})" + tail
    for i in range(sizes[0]):
        for f, name in enumerate(FIELDS):
            values = [requests[i][1][f] for requests in everyone]
            if len({repr(v) for v in values}) > 1:
                per_rank = ", ".join(f"rank {r}: {_show(v)}" for r, v in enumerate(values))
                return (f"tensor parallel: request {everyone[0][i][0]} (number {i + 1} of those added before this step) has a different "
                        f"{name} on each rank ({per_rank})") + tail
    return "tensor parallel: the ranks added different requests before this step" + tail
