"""Positional embeddings that take the step's ``position_ids``, swapped at module level.

The causal-LM decoders of bart, mbart, marian, pegasus, plbart, blenderbot, blenderbot-small,
bigbird_pegasus, trocr and mvp (the last two with attention :mod:`.attention_swaps` swaps) embed positions from an
``arange`` over the row's length plus the HF cache's length, whatever ``position_ids`` the model is
called with: on the engine's tokens-first row (every request of a step in one row, no HF cache) the
second request of a step and every decode token would get the wrong position. Their positional
embeddings are tables (learned, with an offset of 2 in bart's, mbart's, plbart's, trocr's and mvp's, or
fixed sinusoids) looked up at those positions.

:func:`swap` gives each such module a forward that looks up the positions the model was called
with: a forward pre-hook on the model keeps ``position_ids`` from the call's keywords on each
module (:data:`POSITIONS_ATTR`) and a forward hook clears them after (the hook sits on the model,
not the decoder: trocr's and mvp's causal LMs pass no keywords on to its decoder). Called without
``position_ids`` (``model.generate`` passes none to these models) a module runs its own forward.
Dynamo traces the hooks and the attribute writes with the forward, so the graph reads the step's
positions input.

trocr's sinusoidal table (fairseq's) counts positions from ``padding_idx + 1`` over the non-pad
tokens; here they come from ``position_ids``, so a pad token inside a prompt gets its position's
row where transformers gives it zeros and does not count it.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .patching import Changes, RefusesNothing, Swap, class_key, recorded

if TYPE_CHECKING:
    from .probe_result import ProbeResult

#: The attribute holding the positions of the model call in progress (None outside one).
POSITIONS_ATTR = "pb_position_ids"
_HOOKS_ATTR = "pb_position_hooks"  # on the model: its hooks are installed (a second adapt adds none)
#: trocr's sinusoidal table as a buffer: transformers keeps it as a plain attribute, which ``model.to()``
#: does not move (a graph would copy it from the host every step)
TABLE_BUFFER = "pb_position_table"
_TROCR_SINUSOIDAL = "transformers.models.trocr.modeling_trocr.TrOCRSinusoidalPositionalEmbedding"
_NAMES = (
    "transformers.models.bart.modeling_bart.BartLearnedPositionalEmbedding",
    "transformers.models.bigbird_pegasus.modeling_bigbird_pegasus.BigBirdPegasusLearnedPositionalEmbedding",
    "transformers.models.blenderbot.modeling_blenderbot.BlenderbotLearnedPositionalEmbedding",
    "transformers.models.blenderbot_small.modeling_blenderbot_small.BlenderbotSmallLearnedPositionalEmbedding",
    "transformers.models.marian.modeling_marian.MarianSinusoidalPositionalEmbedding",
    "transformers.models.mbart.modeling_mbart.MBartLearnedPositionalEmbedding",
    "transformers.models.mvp.modeling_mvp.MvpLearnedPositionalEmbedding",
    "transformers.models.pegasus.modeling_pegasus.PegasusSinusoidalPositionalEmbedding",
    "transformers.models.plbart.modeling_plbart.PLBartLearnedPositionalEmbedding",
    "transformers.models.trocr.modeling_trocr.TrOCRLearnedPositionalEmbedding",
    _TROCR_SINUSOIDAL,
)


def positional_forward(self: torch.nn.Embedding, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The table's rows at the model call's ``position_ids`` (plus the family's ``offset``), else the own forward."""
    positions = getattr(self, POSITIONS_ATTR, None)
    if positions is None:
        return type(self).forward(self, *args, **kwargs)
    if class_key(self) == _TROCR_SINUSOIDAL:  # fairseq's table: position p at row padding_idx + 1 + p
        return getattr(self, TABLE_BUFFER)[positions + (self.padding_idx + 1)]
    return torch.nn.Embedding.forward(self, positions + getattr(self, "offset", 0))


#: Swapped positional-embedding classes, by :func:`~.patching.class_key` (``module.qualname``; transformers 5.24).
SWAPS: dict[str, Swap] = {name: Swap(positional_forward) for name in _NAMES}


def _hooks(embeddings: list[torch.nn.Module]) -> tuple[Any, Any]:
    def keep(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        for embedding in embeddings:
            setattr(embedding, POSITIONS_ATTR, kwargs.get("position_ids"))

    def clear(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        for embedding in embeddings:
            setattr(embedding, POSITIONS_ATTR, None)

    return keep, clear


def swappable(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The positional-embedding modules of ``model`` that :func:`swap` replaces (empty: none)."""
    return [m for m in model.modules() if class_key(m) in SWAPS]


def swap(model: torch.nn.Module, changes: Changes) -> list[torch.nn.Module]:
    """Make every swappable positional embedding of ``model`` use the ``position_ids`` ``model`` is called
    with (a model swapped before keeps its hooks); returns the embeddings; ``changes`` can undo it all."""
    found = swappable(model)
    if not found or _HOOKS_ATTR in model.__dict__:
        return found
    changes.set(model, _HOOKS_ATTR, True)
    keep, clear = _hooks(found)
    changes.hook(model.register_forward_pre_hook(keep, with_kwargs=True))
    changes.hook(model.register_forward_hook(clear, with_kwargs=True, always_call=True))
    device = next(model.parameters()).device
    for embedding in found:
        if class_key(embedding) == _TROCR_SINUSOIDAL:
            changes.buffer(embedding, TABLE_BUFFER, embedding.weights.detach().to(device))
        changes.set(embedding, POSITIONS_ATTR, None)
        changes.set(embedding, "forward", types.MethodType(SWAPS[class_key(embedding)].forward, embedding))
    return found


class PositionSwaps(RefusesNothing):
    """The mechanism that points positional embeddings taking no ``position_ids`` at the model call's (:data:`SWAPS`)."""

    name = "position swaps"

    def install(self, model: torch.nn.Module, probed: ProbeResult | None) -> Callable[[], None]:
        return recorded(swap, model)


MECHANISM = PositionSwaps()
