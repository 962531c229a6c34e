"""StepBuffers: a GraphRunner's persistent input buffers, and the views a step or a capture reads.

A graph reads fixed addresses, so every input lives in one buffer allocated once (see
:mod:`.static_inputs` for the rules of a :class:`StaticInput`): per-token inputs have one row per
token of the largest capture size, per-request inputs ``max_num_reqs`` rows. A step copies its
tensors into the buffers' leading rows (:meth:`StepBuffers.fill`) and passes views of them
(:meth:`StepBuffers.views`); a step that runs eagerly may pass copies of its own tensors laid out
the same way instead (:meth:`StepBuffers.eager_views`). Capture planning (:mod:`.orchestration`,
:mod:`.lazy`) and micro-batching (:mod:`.ubatch_step`) take this object, never the runner.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ..inputs import mark_persistent
from ..shapes import mark_token_views
from .static_inputs import StaticInput

_PLANS = 4096  # filling plans kept per StepBuffers (one per row counts seen; bounded by the capture sizes)


class StepBuffers:
    """One persistent buffer per :class:`StaticInput`, filled with its ``pad``; ``tokens`` rows for
    per-token inputs (the largest capture size), ``max_num_reqs`` for per-request ones. ``mark_tokens=False``
    (a model no Dynamo compiles): views are never marked dynamic (:meth:`mark_token_views` does nothing)."""

    def __init__(
        self, inputs: Sequence[StaticInput], *, tokens: int, max_num_reqs: int | None, device: torch.device,
        mark_tokens: bool = True,
    ) -> None:
        self.mark_tokens = mark_tokens
        #: The inputs' specs, by name, in the order given.
        self.specs: dict[str, StaticInput] = {i.name: i for i in inputs}
        self.device = device
        self.max_num_reqs = max_num_reqs
        #: Names of the per-request inputs (their views are the whole buffer on every step).
        self.per_request = frozenset(i.name for i in inputs if i.per == "request")
        #: Names of the per-token inputs whose values are rows of the per-request inputs (micro-batching
        #: rebases them per half).
        self.request_row = frozenset(i.name for i in inputs if i.request_row)
        self._request_rows = {name: max_num_reqs for name in self.per_request}  # the others: the step's tokens
        #: The buffers themselves, by name (``GraphRunner.buffers``).
        self.tensors: dict[str, torch.Tensor] = {
            i.name: torch.full((self.rows(i.name, tokens), *i.shape), i.pad, dtype=i.dtype, device=device)
            for i in inputs
        }
        mark_persistent(*self.tensors.values())  # graphs read them in place: no staging copy per replay
        self._step_views: dict[int, dict[str, torch.Tensor]] = {}
        self._trailing = {name: buf.shape[1:] for name, buf in self.tensors.items() if buf.dim() > 1}  # 1-d: no columns
        self._heads: dict[tuple[str, int, int], tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._order = tuple(self.tensors)  # the names, in the order of a plan's destinations
        self._plans: dict[tuple[int, int | None, int], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        # one row of each input's pad: expanded (no copy) into the padding rows of a plan
        self._pad_rows = {i.name: torch.full((1, *i.shape), i.pad, dtype=i.dtype, device=device) for i in inputs}
        #: Storage addresses of the buffers: a tensor whose storage is one of them is a view of a buffer.
        self.storages = frozenset(b.untyped_storage().data_ptr() for b in self.tensors.values())

    def rows(self, name: str, tokens: int) -> int:
        """Rows input ``name`` has in a step of ``tokens`` (padded) tokens: ``max_num_reqs`` per request."""
        return self._request_rows.get(name, tokens)  # type: ignore[return-value]

    def views(self, tokens: int) -> dict[str, torch.Tensor]:
        """What a step of ``tokens`` padded tokens passes: each per-token buffer's first rows, every
        per-request buffer whole."""
        per_request = self.per_request
        return {name: buf if name in per_request else buf[:tokens] for name, buf in self.tensors.items()}

    def step_views(self, tokens: int) -> Mapping[str, torch.Tensor]:
        """:meth:`views` for a graph step, made once per ``tokens`` and then the same objects every step (do not
        modify it): a FULL replay's context check then finds the tensors it captured by identity."""
        views = self._step_views.get(tokens)
        if views is None:
            views = self._step_views[tokens] = self.views(tokens)
        return views

    def fill(
        self, batch: Mapping[str, torch.Tensor], tokens: int, counts: tuple[int, int | None] | None = None
    ) -> None:
        """Copy a step's tensors into the buffers' leading rows, ``pad`` in the other rows of a step of
        ``tokens`` tokens (and in any columns a tensor narrower than its spec leaves).

        ``counts``: the step's ``(tokens, requests)`` when every tensor has its buffer's width (checked by
        the caller): then the data and the pads are one ``_foreach_copy_`` into row views planned once per
        row counts, the pads copied from an expanded row of each input's pad (slicing a buffer anew and one
        ``fill_`` per input each step cost more than the copies).
        """
        if counts is None:
            self._fill_rows(batch, tokens)
            return
        key = (counts[0], counts[1], tokens)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plan(*key)
        dsts, pads = plan
        torch._foreach_copy_(dsts, [*map(batch.__getitem__, self._order), *pads])

    def _plan(self, n: int, reqs: int | None, tokens: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The destinations (each input's data rows in :attr:`_order`, then the padding rows) and the pad
        sources of a full-width step of ``n`` tokens and ``reqs`` requests padded to ``tokens``."""
        if len(self._plans) >= _PLANS:
            self._plans.clear()
        heads, pad_dsts, pads = [], [], []
        for name in self._order:
            buf, per_request = self.tensors[name], name in self.per_request
            rows, padded = (reqs, self.max_num_reqs) if per_request else (n, tokens)
            heads.append(buf[:rows])
            if padded > rows:  # type: ignore[operator]
                pad_dsts.append(buf[rows:padded])
                pads.append(self._pad_rows[name].expand(padded - rows, *buf.shape[1:]))  # type: ignore[operator]
        plan = self._plans[(n, reqs, tokens)] = (heads + pad_dsts, pads)
        return plan

    def _fill_rows(self, batch: Mapping[str, torch.Tensor], tokens: int) -> None:
        """:meth:`fill` of any step: per input, narrower ones padded column by column."""
        specs, rows, trailing, heads = self.specs, self._request_rows, self._trailing, self._heads
        if len(heads) > _PLANS:  # row views by (input, rows, padded rows): bounded by the capture sizes, kept small
            heads.clear()
        dsts, srcs = [], []
        for name, t in batch.items():
            buf = self.tensors[name]
            padded = rows.get(name, tokens)
            if name in trailing and t.shape[1:] != trailing[name]:  # narrower than its spec: pad the columns too
                fill(buf, t, padded, specs[name].pad)  # type: ignore[arg-type]
                continue
            n = t.shape[0]
            key = (name, n, padded)
            views = heads.get(key)
            if views is None:
                views = heads[key] = (buf[:n], buf[n:padded] if padded > n else None)
            dsts.append(views[0])
            srcs.append(t)
            if views[1] is not None:
                views[1].fill_(specs[name].pad)
        if dsts:
            torch._foreach_copy_(dsts, srcs)

    def eager_views(self, batch: Mapping[str, torch.Tensor], tokens: int) -> dict[str, torch.Tensor]:
        """What an eager step of ``tokens`` tokens passes without the buffers: the step's own tensors where
        they have the buffers' dtype, width and row count, padded copies otherwise."""
        specs, rows, device = self.specs, self._request_rows, self.device
        return {
            k: eager_tensor(specs[k], t, rows.get(k, tokens), device)  # type: ignore[arg-type]
            for k, t in batch.items()
        }

    def lazy_views(self, batch: Mapping[str, torch.Tensor], tokens: int, *, mark: bool) -> dict[str, torch.Tensor]:
        """The views an eager step a graph will serve later reads: the step filled in, each buffer's first
        ``tokens`` rows, their token dim marked dynamic when ``mark`` (as a capture's warm-ups mark them)."""
        self.fill(batch, tokens)
        views = self.views(tokens)
        if mark:
            self.mark_token_views(views)
        return views

    def reset(self) -> None:
        """Every buffer back to its ``pad``: no capture or warm-up runs on a previous step's data."""
        for name, buf in self.tensors.items():
            buf.fill_(self.specs[name].pad)

    def mark_token_views(self, views: dict[str, torch.Tensor]) -> None:
        """Mark the per-token views' token dim dynamic (one Dynamo graph for every size, 1 included)."""
        if self.mark_tokens:
            mark_token_views(views, self.specs)


def fill(buf: torch.Tensor, value: torch.Tensor, rows: int, pad: int | float) -> None:
    """Write ``value`` into the corner of ``buf[:rows]`` and ``pad`` everywhere else in it."""
    n = value.shape[0]
    if value.shape[1:] == buf.shape[1:]:  # the common case: one copy, pad only the padding rows
        buf[:n].copy_(value)
        if rows > n:
            buf[n:rows].fill_(pad)
    else:
        buf[:rows].fill_(pad)
        buf[(slice(0, n), *(slice(0, d) for d in value.shape[1:]))].copy_(value)


def eager_tensor(spec: StaticInput, value: torch.Tensor, rows: int, device: torch.device) -> torch.Tensor:
    """What an eager step passes for ``value``: the same dtype, width and row count a graph step sees."""
    if value.shape[0] == rows and value.shape[1:] == spec.shape:
        if value.dtype == spec.dtype and value.device == device:
            return value  # the common case: the caller's tensor as it is, as an eager call would get it
        return value.to(device=device, dtype=spec.dtype)
    shape = tuple(max(a, b) for a, b in zip(value.shape[1:], spec.shape))
    out = torch.empty((rows, *shape), dtype=spec.dtype, device=device)
    fill(out, value, rows, spec.pad)
    return out
