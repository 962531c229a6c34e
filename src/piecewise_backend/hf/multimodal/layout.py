"""The runner's layout of an image-text-to-text model: the text model on input embeddings, images in place.

:class:`ImageTokensFirst` puts the encoder's rows in place of the image tokens' embeddings
(``where(mm_mask, mm_embeds, embed(ids))``) from persistent module buffers the executor writes before a
step, so the graphs read them where they are and a decode step replays the text model's FULL graph; M-RoPE
positions come from a ``(T, 3)`` buffer, deepstack rows from more columns of the embeddings' buffer.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from ...config import CompilationConfig
from ...inputs import mark_persistent
from ...serve.arguments import EngineArgs
from ...serve.model_runner import own_code
from ..adaptation import TokensFirst
from ..modality import text_model
from .families import deepstack_layers


def layout(adapted: TokensFirst, config: CompilationConfig, args: EngineArgs) -> ImageTokensFirst:
    """The runner's layout of an adapted image-text-to-text model: image-token buffers as many rows as a step's
    tokens can be (``max_num_batched_tokens``, else the largest capture size, else ``max_model_len``)."""
    rows = max(args.max_num_batched_tokens or 0, max(config.sizes, default=0), args.max_num_reqs) or args.max_model_len
    model = adapted.model
    hidden = model.get_input_embeddings().weight.shape[-1]
    mrope = callable(getattr(getattr(model, "model", model), "get_rope_index", None))
    return own_code(ImageTokensFirst)(adapted, rows=rows, hidden=hidden, mrope=mrope, deepstack=deepstack_layers(model))


class ImageTokensFirst(TokensFirst):
    """:class:`~.adaptation.TokensFirst` of an image-text-to-text model: the text model on input embeddings,
    image tokens' rows from :attr:`mm_embeds` where :attr:`mm_mask` says so, rope positions from
    :attr:`rope_positions` on an M-RoPE model (module buffers, written by :meth:`stage` before a step)."""

    def __init__(self, base: TokensFirst, *, rows: int, hidden: int, mrope: bool, deepstack: int = 0):
        super().__init__(base.model, base.kv_shape, base.host_breaks, base.state_specs, base.indexer_dim,
                         base.call_sites)
        param = next(base.model.parameters())
        self.embed = base.model.get_input_embeddings()
        self.rows, self.hidden = rows, hidden
        #: text layers that add vision features at the image tokens (deepstack): their rows sit beside the
        #: embeddings' in :attr:`mm_embeds`, ``hidden`` columns each
        self.deepstack = deepstack
        if deepstack:
            self.text = text_model(base.model)
            self.text._deepstack_process = types.MethodType(_deepstack_rows, self.text)  # see _deepstack_rows
        self.register_buffer("mm_embeds", torch.zeros(rows, hidden * (1 + deepstack), dtype=param.dtype,
                                                      device=param.device), persistent=False)
        self.register_buffer("mm_mask", torch.zeros(rows, dtype=torch.bool, device=param.device), persistent=False)
        self.mrope = mrope
        self.register_buffer("rope_positions", torch.zeros(rows, 3, dtype=torch.long, device=param.device),
                             persistent=False)
        mark_persistent(self.mm_embeds, self.mm_mask, self.rope_positions)
        self._staged: torch.Tensor | None = None  # rows of mm_mask set for this step

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        torch._check(input_ids.shape[0] >= 1)
        if self.call_sites is not None:
            self.call_sites.start()
        n, h = input_ids.shape[0], self.hidden
        mask = self.mm_mask[:n]
        embeds = torch.where(mask[:, None], self.mm_embeds[:n, :h], self.embed(input_ids))
        positions = self.rope_positions[:n].t()[:, None] if self.mrope else position_ids[None]
        if not self.deepstack:
            return self.model(inputs_embeds=embeds[None], position_ids=positions, use_cache=False).logits[0]
        deep = [self.mm_embeds[:n, h * (i + 1):h * (i + 2)] for i in range(self.deepstack)]
        out = self.text(inputs_embeds=embeds[None], position_ids=positions, use_cache=False,
                        visual_pos_masks=mask[None], deepstack_visual_embeds=deep)
        return self.model.get_output_embeddings()(out.last_hidden_state)[0]

    def restore(self) -> None:
        """Undo what this layout changed in the model (the deepstack step): the engine failed to build on it."""
        if self.deepstack and "_deepstack_process" in vars(self.text):
            del self.text._deepstack_process

    def stage(self, rows: torch.Tensor | None, embeds: torch.Tensor | None, rope: torch.Tensor | None) -> None:
        """Before a step: ``embeds`` in place of the embeddings of step tokens ``rows``, ``rope`` (``(tokens, 3)``)
        the step's rope positions. :meth:`unstage` after it."""
        if rows is not None and rows.numel():
            self.mm_embeds.index_copy_(0, rows, embeds.to(self.mm_embeds.dtype))
            self.mm_mask.index_fill_(0, rows, True)
            self._staged = rows
        if rope is not None:
            self.rope_positions[:rope.shape[0]].copy_(rope)

    def unstage(self) -> None:
        """After a step: no token's embedding replaced."""
        if self._staged is not None:
            self.mm_mask.index_fill_(0, self._staged, False)
            self._staged = None


def _deepstack_rows(self: Any, hidden_states: torch.Tensor, visual_pos_masks: torch.Tensor,
                    visual_embeds: torch.Tensor) -> torch.Tensor:
    """The text model's deepstack step with ``visual_embeds`` one row per token (the step's rows; only image
    tokens' are read): added where ``visual_pos_masks`` holds, without the boolean indexing (a host read)."""
    add = visual_embeds.to(hidden_states.dtype)[None]
    return torch.where(visual_pos_masks[..., None], hidden_states + add, hidden_states)
