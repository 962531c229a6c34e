"""Positional embeddings that take the step's ``position_ids``, swapped at module level.

The causal-LM decoders of bart, mbart, marian, pegasus, plbart, blenderbot, blenderbot-small and
bigbird_pegasus accept ``position_ids`` (it reaches their decoder in ``**kwargs``) but embed
positions from an ``arange`` over the row's length plus the HF cache's length: on the engine's
tokens-first row (every request of a step in one row, no HF cache) the second request of a step
and every decode token would get the wrong position. Each of their positional-embedding modules
(a learned table, with bart's offset of 2 in the families that have one, or a fixed sinusoidal
table; both ``nn.Embedding`` subclasses) already takes a ``position_ids`` keyword, but the decoder
passes its own.

:func:`swap` gives each such module a forward that looks up the positions its decoder was called
with: a forward pre-hook on the decoder keeps ``position_ids`` from the call's keywords on the
module (:data:`POSITIONS_ATTR`) and a forward hook clears it after. Without ``position_ids`` in the
call (``model.generate`` passes none to these models) the module's own forward runs. Dynamo traces
the hooks and the attribute write with the forward, so the graph reads the step's positions input.
"""

from __future__ import annotations

import types
from typing import Any

import torch

#: The attribute holding the positions of the decoder call in progress (None outside one).
POSITIONS_ATTR = "pb_position_ids"
_HOOKS_ATTR = "pb_position_hooks"
_MODELS = ("bart", "mbart", "marian", "pegasus", "plbart", "blenderbot", "blenderbot_small", "bigbird_pegasus")
_PREFIX = {"mbart": "MBart", "plbart": "PLBart", "blenderbot_small": "BlenderbotSmall", "bigbird_pegasus": "BigBirdPegasus"}
#: Swapped positional-embedding classes, by ``module.qualname`` (transformers 5.24).
SWAPPED: frozenset[str] = frozenset(
    f"transformers.models.{m}.modeling_{m}.{_PREFIX.get(m, m.capitalize())}{kind}PositionalEmbedding"
    for m in _MODELS for kind in (("Sinusoidal",) if m in ("marian", "pegasus") else ("Learned",))
)


def _key(module: torch.nn.Module) -> str:
    return f"{type(module).__module__}.{type(module).__qualname__}"


def positional_forward(self: torch.nn.Embedding, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The table's rows at the decoder call's ``position_ids`` (plus the family's ``offset``), else the own forward."""
    positions = getattr(self, POSITIONS_ATTR, None)
    if positions is None:
        return type(self).forward(self, *args, **kwargs)
    return torch.nn.Embedding.forward(self, positions + getattr(self, "offset", 0))


def _keep(embedding: torch.nn.Module) -> tuple[Any, Any]:
    def keep(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        setattr(embedding, POSITIONS_ATTR, kwargs.get("position_ids"))

    def clear(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        setattr(embedding, POSITIONS_ATTR, None)

    return keep, clear


def swappable(model: torch.nn.Module) -> list[tuple[torch.nn.Module, torch.nn.Module]]:
    """``(decoder, positional embedding)`` of each swappable positional-embedding module of ``model``."""
    return [
        (parent, child) for parent in model.modules() for child in parent.children() if _key(child) in SWAPPED
    ]


def swap(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Make every swappable positional embedding of ``model`` use its decoder call's ``position_ids``
    (idempotent); returns the embeddings."""
    found = []
    for decoder, embedding in swappable(model):
        found.append(embedding)
        if _HOOKS_ATTR in embedding.__dict__:
            continue
        keep, clear = _keep(embedding)
        hooks = (decoder.register_forward_pre_hook(keep, with_kwargs=True),
                 decoder.register_forward_hook(clear, with_kwargs=True, always_call=True))
        embedding.__dict__[_HOOKS_ATTR] = hooks
        setattr(embedding, POSITIONS_ATTR, None)
        embedding.forward = types.MethodType(positional_forward, embedding)
    return found


def restore(model: torch.nn.Module) -> None:
    """Undo :func:`swap`: the embeddings' own forwards, no hooks on their decoders."""
    for _, embedding in swappable(model):
        for hook in embedding.__dict__.pop(_HOOKS_ATTR, ()):
            hook.remove()
        embedding.__dict__.pop("forward", None)
        embedding.__dict__.pop(POSITIONS_ATTR, None)
