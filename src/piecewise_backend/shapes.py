"""Dynamic sizes: one Dynamo graph for every token count, 1 included."""

from __future__ import annotations

from typing import Any

import torch

TOKENS = "pb_num_tokens"  # the shape_id shared by every per-token input


def mark_token_dim(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Mark ``t``'s ``dim`` as a size Dynamo must not specialize, 0 and 1 included; returns ``t``.

    ``torch._dynamo.mark_dynamic`` still specializes sizes 0 and 1, so a step of one token
    traced a second graph. An *unbacked* size never specializes: one graph serves every
    count. The model may then not branch in Python on that size (Dynamo raises a
    data-dependent-guard error naming the line); code that only computes with it is fine.
    """
    torch._dynamo.decorators.mark_unbacked(t, dim)
    return t


def mark_token_views(views: dict[str, torch.Tensor], specs: dict[str, Any]) -> None:
    """Mark dim 0 of every per-token view (``specs[name].per`` is ``"token"``, or absent) as one
    shared unbacked size: all per-token inputs of a step have the same token count."""
    for name, v in views.items():
        if getattr(specs.get(name), "per", "token") == "token" and v.dim():
            torch._dynamo.decorators.mark_unbacked(v, 0, shape_id=TOKENS)
