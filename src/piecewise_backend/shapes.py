"""Dynamic sizes: one Dynamo graph for every token count, 1 included."""

from __future__ import annotations

import torch


def mark_token_dim(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Mark ``t``'s ``dim`` as a size Dynamo must not specialize, 0 and 1 included; returns ``t``.

    ``torch._dynamo.mark_dynamic`` still specializes sizes 0 and 1, so a step of one token
    traced a second graph. An *unbacked* size never specializes: one graph serves every
    count. The model may then not branch in Python on that size (Dynamo raises a
    data-dependent-guard error naming the line); code that only computes with it is fine.
    """
    torch._dynamo.decorators.mark_unbacked(t, dim)
    return t
