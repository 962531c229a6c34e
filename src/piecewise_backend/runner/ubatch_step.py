"""GraphRunner micro-batching: split a step at a request boundary, agree across ranks, lay the halves out.

With ``use_ubatching`` every rank of a step runs the same shapes: the token count is the
largest of all ranks, and a micro-batched step has halves of the same padded sizes on every
rank (expert-parallel collectives pair tensors of equal shapes). One small all-gather per step
decides it: all ranks micro-batch or none does (none when any rank is below its threshold or
has a half that would be empty).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from ..config import CompilationConfig
from ..context import BatchDescriptor
from ..modes import CUDAGraphMode
from .batch_checks import BatchChecks
from .buffers import StepBuffers

_NONE, _FULL = CUDAGraphMode.NONE, CUDAGraphMode.FULL


@dataclasses.dataclass(frozen=True)
class Agreement:
    """What every rank runs this step (the same on all ranks), and this rank's own split."""

    num_tokens: int  # the largest token count of all ranks: every rank dispatches it
    uniform: bool  # every rank is a uniform decode batch
    ubatch: bool  # micro-batched on every rank
    fit: bool  # every rank's inputs fit the static buffers (else every rank runs eagerly)
    rows: tuple[int, int]  # padded token rows of each half (when micro-batched)
    split: tuple[int, int]  # this rank's real (tokens, requests) in the first half


def split_point(
    n: int, query_lens: Sequence[int] | None, uniform: bool, q: int, num_reqs: int | None
) -> tuple[int, int] | None:
    """``(tokens, requests)`` of the first half: the request boundary nearest the middle, or
    None when no boundary leaves both halves non-empty."""
    if query_lens is not None:
        bounds, total = [], 0
        for k, length in enumerate(query_lens[:-1], start=1):
            total += length
            bounds.append((abs(2 * total - n), total, k))
        best = min(bounds, default=None)
        return None if best is None else (best[1], best[2])
    if uniform and n % q == 0 and n // q >= 2:
        k = n // q // 2
        return k * q, k
    if num_reqs == n and n >= 2:  # one token per request
        return n // 2, n // 2
    return None


def agree_step(
    config: CompilationConfig, n: int, query_lens: list[int] | None, uniform: bool, q: int, num_reqs: int | None,
    fit: bool, step: int,
) -> Agreement:
    """This rank's split of a step of ``n`` tokens (:func:`split_point`), agreed with every rank (:func:`agree`)."""
    return agree(config, n, uniform, split_point(n, query_lens, uniform, q, num_reqs), fit, step)


def agree(
    config: CompilationConfig, n: int, uniform: bool, split: tuple[int, int] | None, fit: bool, step: int
) -> Agreement:
    """Decide the step with every rank (one all-gather of 8 ints); a plain computation on one process."""
    threshold = config.dbo_decode_token_threshold if uniform else config.dbo_prefill_token_threshold
    wants = split is not None and n >= threshold
    first = split[0] if split else 0
    mine = [n, int(uniform), int(wants), first, n - first if split else 0, int(fit),
            config.dbo_decode_token_threshold, config.dbo_prefill_token_threshold]
    rows = [mine]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        t = torch.tensor(mine, dtype=torch.long, device=device)
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        try:
            dist.all_gather(parts, t)
        except RuntimeError as e:
            raise RuntimeError(
                f"step {step} on rank {dist.get_rank()}: the ranks could not agree on micro-batching (a peer rank is "
                f"absent, stopped, or runs a step without micro-batching): {e}"
            ) from e
        rows = [p.tolist() for p in parts]
        if len({tuple(r[6:]) for r in rows}) > 1:
            per_rank = ", ".join(f"rank {i}: decode {r[6]}, prefill {r[7]}" for i, r in enumerate(rows))
            raise RuntimeError(
                f"step {step}: ranks would decide micro-batching differently (thresholds {per_rank}); give every "
                "rank the same dbo_decode_token_threshold and dbo_prefill_token_threshold"
            )
    ubatch = all(r[2] for r in rows)
    halves = (max(r[3] for r in rows), max(r[4] for r in rows)) if ubatch else (0, 0)
    return Agreement(
        max(r[0] for r in rows), all(r[1] for r in rows), ubatch, all(r[5] for r in rows), halves, split or (0, 0)
    )


def canonical_rows(num_tokens: int, q: int) -> tuple[int, int] | None:
    """Halves of a FULL micro-batched uniform-decode graph: the middle request boundary of the padded batch."""
    if num_tokens % q or num_tokens // q < 2:
        return None
    first = num_tokens // q // 2 * q
    return first, num_tokens - first


@dataclasses.dataclass(frozen=True)
class HalfLayout:
    """How a micro-batched step lays its two halves out in the step's rows: ``rows`` padded token rows
    of each half (the second starts at row ``rows[0]``), and ``request_rows`` per-request rows of the
    first half (the second half's requests start at that row)."""

    rows: tuple[int, int]
    request_rows: int


def plan(
    agreed: Agreement, mode: CUDAGraphMode, desc: BatchDescriptor, n: int, q: int, buffers: StepBuffers
) -> tuple[CUDAGraphMode, Agreement, HalfLayout]:
    """How an agreed micro-batched step runs: its mode (FULL only for a uniform decode step split the
    way its graph was captured; anything else runs its halves eagerly), the agreement with this rank's
    split, and the layout of the halves."""
    # a uniform decode batch splits the same way every step of a descriptor (plain FULL mode keys it relaxed)
    canonical = canonical_rows(desc.num_tokens, q) if mode == _FULL and agreed.uniform else None
    if canonical is not None:
        # Fill the graph's first half before its second: the second half's requests then start at request
        # row canonical[0] // q and need at most max(n - canonical[0], q) // q rows after it, which fits
        # max_num_reqs whenever the step does. Every rank derives its split the same way from its n.
        first = min(canonical[0], n - q)
        largest_second = max(agreed.num_tokens - canonical[0], q)  # of any rank: the same check on every rank
        second_end = (canonical[0] + largest_second) // q
        if buffers.per_request and second_end > buffers.max_num_reqs:  # type: ignore[operator]
            canonical = None  # the second half's requests would not fit the per-request buffers at the graph's offset
        else:
            agreed = dataclasses.replace(agreed, split=(first, first // q))
    if canonical is None:  # only uniform decode splits the same way every step: the rest runs eagerly
        mode, halves = _NONE, agreed.rows
    else:
        halves = canonical
    request_rows = halves[0] // q if mode == _FULL else agreed.split[1]  # fixed for a graph, the real count eagerly
    return mode, agreed, HalfLayout(halves, request_rows)


def capture_layout(desc: BatchDescriptor, q: int, threshold: int, buffers: StepBuffers) -> HalfLayout | None:
    """The layout of the micro-batched FULL graph of ``desc`` (uniform decode steps); None when no uniform
    decode step of ``desc`` is micro-batched (below ``threshold``, or a half would be empty or overflow the
    per-request buffers)."""
    halves = canonical_rows(desc.num_tokens, q)
    if halves is None or desc.num_tokens < threshold:
        return None
    if buffers.per_request and halves[0] // q >= buffers.max_num_reqs:  # type: ignore[operator]
        return None
    return HalfLayout(halves, halves[0] // q)


def _place(dst: torch.Tensor, value: torch.Tensor, cut: int, starts: tuple[int, int], pad: int | float) -> None:
    """Rows ``[:cut]`` of ``value`` at row ``starts[0]`` of ``dst``, the rest at ``starts[1]``; ``pad`` elsewhere."""
    dst.fill_(pad)
    for (a, b), start in zip(((0, cut), (cut, value.shape[0])), starts):
        chunk = value[a:b]
        dst[(slice(start, start + b - a), *(slice(0, d) for d in chunk.shape[1:]))].copy_(chunk)


def layout(
    buffers: StepBuffers, batch: Mapping[str, torch.Tensor], split: tuple[int, int], halves: HalfLayout, graph: bool
) -> dict[str, torch.Tensor]:
    """The step's inputs with each half's rows starting at its half's first row (padded in between): in the
    buffers for a graph, else in fresh tensors."""
    views = {}
    rows0 = halves.request_rows
    for name, t in batch.items():
        spec = buffers.specs[name]
        per_request = name in buffers.per_request
        rows = buffers.max_num_reqs if per_request else sum(halves.rows)
        if graph:
            dst = buffers.tensors[name][:rows]
        else:
            shape = tuple(max(a, b) for a, b in zip(t.shape[1:], spec.shape))
            dst = torch.empty((rows, *shape), dtype=spec.dtype, device=buffers.device)  # type: ignore[arg-type]
        cut = split[1] if per_request else split[0]
        second = rows0 if per_request else halves.rows[0]  # where the second half's rows start
        value = t.to(device=buffers.device, dtype=spec.dtype)
        if name in buffers.request_row:  # the second half's requests start at its own per-request row 0
            value = torch.cat([value[:cut], value[cut:] - split[1]])
        _place(dst, value, cut, (0, second), spec.pad)
        views[name] = dst
    return views


def half_views(
    views: Mapping[str, torch.Tensor], halves: HalfLayout, per_request: frozenset[str]
) -> list[dict[str, torch.Tensor]]:
    """Each half's views of a laid-out step: its token rows, and its rows of the per-request inputs."""
    (first, second), rows0 = halves.rows, halves.request_rows
    return [
        {
            k: (v[:rows0] if i == 0 else v[rows0:]) if k in per_request else v[start:start + size]
            for k, v in views.items()
        }
        for i, (start, size) in enumerate(((0, first), (first, second)))
    ]


def unsplit(o: Any, cut: int, n: int, halves: HalfLayout) -> Any:
    """This rank's rows of a micro-batched output, in the original token order."""
    rows = halves.rows
    if not isinstance(o, torch.Tensor) or not o.dim() or o.shape[0] != sum(rows):
        return o
    return torch.cat([o[:cut], o[rows[0]:rows[0] + n - cut]])


def run_halves(
    step: Callable[..., Any], buffers: StepBuffers, checks: BatchChecks, batch: Mapping[str, torch.Tensor],
    agreed: Agreement,
    mode: CUDAGraphMode, desc: BatchDescriptor, n: int, num_reqs: int | None, q: int, context: dict,
    may_capture: bool | None,
) -> tuple[CUDAGraphMode, BatchDescriptor, Any]:
    """The rest of a GraphRunner step that every rank micro-batches: plan it (:func:`plan`), lay its halves out
    (:func:`layout`) and run them in one call of ``step`` (a :class:`~.step.Step`); returns the mode and
    descriptor it ran under (``q``: the uniform decode query length) and this rank's rows of the output, in
    token order. ``checks`` (the runner's :class:`~.batch_checks.BatchChecks`) checks each half's request
    rows under ``debug_checks``."""
    mode, agreed, halves = plan(agreed, mode, desc, n, q, buffers)
    if checks.debug_checks:
        checks.check_halves(batch, agreed.split, n, num_reqs)
    views = layout(buffers, batch, agreed.split, halves, graph=mode == _FULL)
    desc = desc if mode == _FULL else BatchDescriptor(sum(halves.rows))
    out = step(views, mode, desc, context=context, may_capture=may_capture, halves=halves)
    cut = agreed.split[0]
    return mode, desc, tree_map(lambda o: unsplit(o, cut, n, halves), out)
