"""GraphRunner micro-batching: split a step at a request boundary, agree across ranks, lay the halves out.

With ``use_ubatching`` every rank of a step runs the same shapes: the token count is the
largest of all ranks, and a micro-batched step has halves of the same padded sizes on every
rank (expert-parallel collectives pair tensors of equal shapes). One small all-gather per step
decides it: all ranks micro-batch or none does (none when any rank is below its threshold or
has a half that would be empty).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from ..context import BatchDescriptor, set_forward_context
from ..modes import CUDAGraphMode
from ..ubatch.wrapper import UBatchSlice
from .static_inputs import StaticInput, check_full_context, check_request_rows, context_tensors, eager_tensor, fill

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


def check_query_lens(query_lens: Any, n: int, reqs: int | None) -> list[int] | None:
    """``query_lens`` as a list: positive ints summing to the step's tokens, one per request row."""
    if query_lens is None:
        return None
    lens = list(query_lens)
    if not lens or any(not isinstance(x, int) or isinstance(x, bool) or x < 1 for x in lens) or sum(lens) != n:
        raise ValueError(f"GraphRunner.run: query_lens must be positive ints summing to the {n} tokens, got {lens}")
    if reqs is not None and len(lens) != reqs:
        raise ValueError(f"GraphRunner.run: {len(lens)} query_lens but the per-request inputs have {reqs} rows")
    return lens


def agree(runner: Any, n: int, uniform: bool, split: tuple[int, int] | None, fit: bool, step: int) -> Agreement:
    """Decide the step with every rank (one all-gather of 8 ints); a plain computation on one process."""
    config = runner.config
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


def _place(dst: torch.Tensor, value: torch.Tensor, cut: int, starts: tuple[int, int], pad: int | float) -> None:
    """Rows ``[:cut]`` of ``value`` at row ``starts[0]`` of ``dst``, the rest at ``starts[1]``; ``pad`` elsewhere."""
    dst.fill_(pad)
    for (a, b), start in zip(((0, cut), (cut, value.shape[0])), starts):
        chunk = value[a:b]
        dst[(slice(start, start + b - a), *(slice(0, d) for d in chunk.shape[1:]))].copy_(chunk)


def run_step(
    runner: Any, batch: Mapping[str, torch.Tensor], n: int, num_reqs: int | None, uniform: bool, context: dict,
    fit: bool, query_lens: list[int] | None,
) -> Any:
    """One step of a micro-batching runner (micro-batched or not, padded to the ranks' largest count)."""
    q = runner.dispatcher.uniform_decode_query_len
    runner.steps += 1
    agreed = agree(runner, n, uniform, split_point(n, query_lens, uniform, q, num_reqs), fit, runner.steps)
    total, uniform = agreed.num_tokens, agreed.uniform
    mode, desc = runner.dispatcher.dispatch(total, uniform_decode=uniform, num_reqs=num_reqs if total == n else None)
    if mode != _NONE and not agreed.fit:  # one rank's inputs are too wide for the buffers: every rank eagerly
        mode, desc = _NONE, BatchDescriptor(total)
    if runner._route_lazily and mode != _NONE:  # lazy capture: no graph yet runs eagerly
        mode, desc, _ = runner.lazy.route(runner.dispatcher, mode, desc, total)
    if mode == _FULL and context:
        check_full_context(context, runner._buffer_storages)
    runner.last_ubatched = agreed.ubatch
    if not agreed.ubatch:
        runner.last_mode = mode
        rows = runner._request_rows
        if mode == _NONE:
            views = {k: eager_tensor(runner.inputs[k], t, rows.get(k, total), runner.device) for k, t in batch.items()}
            out = runner._call(views, mode, desc, context)
            padded = total
        else:
            padded = desc.num_tokens
            for name, t in batch.items():
                fill(runner.buffers[name], t, rows.get(name, padded), runner.inputs[name].pad)
            out = runner._call(runner._views(padded), mode, desc, context)
        return tree_map(lambda o: _unpad(o, n, padded), out)
    # a uniform decode batch splits the same way every step of a descriptor (plain FULL mode keys it relaxed)
    canonical = canonical_rows(desc.num_tokens, q) if mode == _FULL and uniform else None
    if canonical is not None:
        # Fill the graph's first half before its second: the second half's requests then start at request
        # row canonical[0] // q and need at most max(n - canonical[0], q) // q rows after it, which fits
        # max_num_reqs whenever the step does. Every rank derives its split the same way from its n.
        first = min(canonical[0], n - q)
        largest_second = max(agreed.num_tokens - canonical[0], q)  # of any rank: the same check on every rank
        if runner._per_request and (canonical[0] + largest_second) // q > runner.max_num_reqs:
            canonical = None  # the second half's requests would not fit the per-request buffers at the graph's offset
        else:
            agreed = dataclasses.replace(agreed, split=(first, first // q))
    if canonical is None:  # only uniform decode splits the same way every step: the rest runs eagerly
        mode, halves = _NONE, agreed.rows
    else:
        halves = canonical
    runner.last_mode = mode
    if runner.config.debug_checks:
        _check_half_rows(runner, batch, agreed.split, n, num_reqs)
    out = _run_halves(runner, batch, agreed, mode, desc, halves, context)
    cut = agreed.split[0]
    return tree_map(lambda o: _unsplit(o, cut, n, halves), out)


def _check_half_rows(
    runner: Any, batch: Mapping[str, torch.Tensor], split: tuple[int, int], n: int, num_reqs: int | None
) -> None:
    """Under ``debug_checks``: each half's ``request_row`` values name only that half's requests."""
    cut, first_reqs = split
    for name in runner._request_row:
        t = batch[name]
        check_request_rows(runner.inputs[name], t[:cut], 0, first_reqs,
                           where=f" (micro-batch 0: tokens 0..{cut - 1}, requests 0..{first_reqs - 1})")
        check_request_rows(runner.inputs[name], t[cut:], first_reqs, num_reqs, first=cut,
                           where=f" (micro-batch 1: tokens {cut}..{n - 1}, requests {first_reqs}..{num_reqs - 1})")


def request_rows(runner: Any, mode: CUDAGraphMode, halves: tuple[int, int], agreed: Agreement) -> int:
    """Request rows of the first half (per-request inputs): fixed for a graph, the real count eagerly."""
    q = runner.dispatcher.uniform_decode_query_len
    return halves[0] // q if mode == _FULL else agreed.split[1]


def _run_halves(
    runner: Any, batch: Mapping[str, torch.Tensor], agreed: Agreement, mode: CUDAGraphMode, desc: BatchDescriptor,
    halves: tuple[int, int], context: dict,
) -> Any:
    rows0 = request_rows(runner, mode, halves, agreed)
    views = _layout(runner, batch, agreed.split, halves, rows0, graph=mode == _FULL)
    desc = desc if mode == _FULL else BatchDescriptor(sum(halves))
    return call_halves(runner, views, mode, desc, halves, rows0, context)


def _layout(
    runner: Any, batch: Mapping[str, torch.Tensor], split: tuple[int, int], halves: tuple[int, int], rows0: int,
    graph: bool,
) -> dict[str, torch.Tensor]:
    """The step's inputs with each half's rows starting at its half's first row (padded in between)."""
    views = {}
    for name, t in batch.items():
        spec: StaticInput = runner.inputs[name]
        per_request = name in runner._per_request
        rows = runner.max_num_reqs if per_request else sum(halves)
        if graph:
            dst = runner.buffers[name][:rows]
        else:
            shape = tuple(max(a, b) for a, b in zip(t.shape[1:], spec.shape))
            dst = torch.empty((rows, *shape), dtype=spec.dtype, device=runner.device)
        cut = split[1] if per_request else split[0]
        second = rows0 if per_request else halves[0]  # where the second half's rows start
        value = t.to(device=runner.device, dtype=spec.dtype)
        if name in runner._request_row:  # the second half's requests start at its own per-request row 0
            value = torch.cat([value[:cut], value[cut:] - split[1]])
        _place(dst, value, cut, (0, second), spec.pad)
        views[name] = dst
    return views


def call_halves(
    runner: Any, views: dict[str, torch.Tensor], mode: CUDAGraphMode, desc: BatchDescriptor,
    halves: tuple[int, int], rows0: int, context: dict, capturing: bool = False,
) -> Any:
    """Run the wrapped model on a laid-out step: each half gets its views and its own context."""
    q = runner.dispatcher.uniform_decode_query_len
    slices = []
    tensors: dict[str, tuple] = {}  # context_fn's tensors of both halves: what a FULL graph bakes in
    for i, (start, size) in enumerate(((0, halves[0]), (halves[0], halves[1]))):
        part = {
            k: (v[:rows0] if i == 0 else v[rows0:]) if k in runner._per_request else v[start:start + size]
            for k, v in views.items()
        }
        own = dict(runner.context_fn(dict(part))) if runner.context_fn else {}
        if mode == _FULL and runner.context_fn:
            tensors.update(context_tensors(own, prefix=f"micro-batch {i}: "))
        attrs = dict(own, **context)
        half_desc = BatchDescriptor(size, size // q, True) if mode == _FULL else BatchDescriptor(size)
        args = tuple(part[a] for a in runner.model_args)
        slices.append(UBatchSlice(args, {k: part[k] for k in runner.model_kwargs}, half_desc, attrs, size))
    extra: dict[str, Any] = {"ubatch_slices": slices}
    if capturing:
        extra["allow_capture"] = True
    elif runner.capture_closed or runner._route_lazily:
        extra["allow_capture"] = False
    guard = None
    if mode == _FULL and runner.context_fn:
        guard = runner._guard_context(("ubatch", desc), desc, tensors, runner.model.ubatch_entries)
    with set_forward_context(mode, desc, **extra):
        out = runner.model(*[views[a] for a in runner.model_args], **{k: views[k] for k in runner.model_kwargs})
    if guard is not None:
        guard()
    return out


def _unpad(o: Any, n: int, padded: int) -> Any:
    return o[:n] if isinstance(o, torch.Tensor) and o.dim() and o.shape[0] == padded else o


def _unsplit(o: Any, cut: int, n: int, halves: tuple[int, int]) -> Any:
    """This rank's rows of a micro-batched output, in the original token order."""
    if not isinstance(o, torch.Tensor) or not o.dim() or o.shape[0] != sum(halves):
        return o
    return torch.cat([o[:cut], o[halves[0]:halves[0] + n - cut]])


def capture_ubatched(runner: Any, desc: BatchDescriptor, platform: Any, warm: Any, scope: Any, agreement: Any) -> bool:
    """Warm up and capture the micro-batched FULL graph of ``desc`` (for uniform decode steps); False
    when no uniform decode step of ``desc`` is micro-batched (too small, or a half would be empty)."""
    q = runner.dispatcher.uniform_decode_query_len
    halves = canonical_rows(desc.num_tokens, q)
    if halves is None or desc.num_tokens < runner.config.dbo_decode_token_threshold:
        return False
    if runner._per_request and halves[0] // q >= runner.max_num_reqs:
        return False
    rows0 = halves[0] // q
    views = {k: (v if k in runner._per_request else v[:desc.num_tokens]) for k, v in runner.buffers.items()}
    with warm(platform):
        for _ in range(runner.config.num_warmups):
            with scope(platform):  # the threads run on the launching thread's stream: the capture stream
                call_halves(runner, views, _NONE, BatchDescriptor(desc.num_tokens), halves, rows0, {}, True)
        with agreement(_FULL, desc):
            call_halves(runner, views, _FULL, desc, halves, rows0, {}, True)
    return True
