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
from .static_inputs import StaticInput, eager_tensor, fill


class StepBuffers:
    """One persistent buffer per :class:`StaticInput`, filled with its ``pad``; ``tokens`` rows for
    per-token inputs (the largest capture size), ``max_num_reqs`` for per-request ones."""

    def __init__(
        self, inputs: Sequence[StaticInput], *, tokens: int, max_num_reqs: int | None, device: torch.device
    ) -> None:
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

    def fill(self, batch: Mapping[str, torch.Tensor], tokens: int) -> None:
        """Copy a step's tensors into the buffers' leading rows, ``pad`` in the other rows of a step of
        ``tokens`` tokens (and in any columns a tensor narrower than its spec leaves).

        The common case (every tensor as wide as its buffer) is one ``_foreach_copy_`` into row views made
        once per row count, and one ``fill_`` per input with padding rows: slicing a buffer anew each step
        cost more than the copies.
        """
        specs, rows, trailing, heads = self.specs, self._request_rows, self._trailing, self._heads
        if len(heads) > 4096:  # row views by (input, rows, padded rows): bounded by the capture sizes, kept small
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

    def reset(self) -> None:
        """Every buffer back to its ``pad``: no capture or warm-up runs on a previous step's data."""
        for name, buf in self.tensors.items():
            buf.fill_(self.specs[name].pad)

    def mark_token_views(self, views: dict[str, torch.Tensor]) -> None:
        """Mark the per-token views' token dim dynamic (one Dynamo graph for every size, 1 included)."""
        mark_token_views(views, self.specs)
