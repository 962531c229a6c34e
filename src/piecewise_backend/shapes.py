"""Dynamic sizes: one Dynamo graph for every token count, 1 included."""

from __future__ import annotations

from typing import Any

import torch

TOKENS = "pb_num_tokens"  # the shape_id every per-token input shares: a step has one token count


def mark_token_dim(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Mark ``t``'s ``dim`` as the token count, a size Dynamo never specializes (0 and 1
    included); returns ``t``.

    ``torch._dynamo.mark_dynamic`` still specializes sizes 0 and 1, so a step of one token
    traced a second graph. An *unbacked* size never specializes: one graph serves every
    count. Every tensor marked here shares one symbol (a runtime check asserts they agree).
    The model may then not branch in Python on that size (Dynamo raises a data-dependent
    guard error naming the line); code that only computes with it is fine.
    """
    torch._dynamo.decorators.mark_unbacked(t, dim, shape_id=TOKENS)
    return t


def mark_token_views(views: dict[str, torch.Tensor], specs: dict[str, Any]) -> None:
    """:func:`mark_token_dim` on dim 0 of every per-token view (``specs[name].per`` is
    ``"token"`` or absent); per-request views keep their static size."""
    for name, v in views.items():
        if getattr(specs.get(name), "per", "token") == "token" and v.dim():
            mark_token_dim(v)
