"""What the engine serves of each image-text-to-text family: refusals with the reason, per-family tables.

:func:`refusal` names why a model cannot be served exactly (bidirectional image or prefix spans, cross-attention,
image content its text model takes besides the embeddings, a missing image token) or under the engine's
arguments (micro-batching, tensor parallel); the tables say how :class:`~.inputs.Admit` counts a family's
image tokens and reads its pixel layout.
"""

from __future__ import annotations

import inspect

import torch

from ...config import CompilationConfig
from ...serve.arguments import EngineArgs
from ..modality import image_token, text_model


#: Why families the embedding swap cannot serve exactly are refused, by model type.
REFUSED = {
    "gemma3": "gemma3 attends bidirectionally within each image's tokens (token_type_ids): the paged attention is causal",
    "paligemma": "paligemma attends bidirectionally over the whole prompt prefix (a prefix-LM): the paged attention is causal",
    "mllama": "mllama reads its images through cross-attention layers, not image tokens in the prompt",
    "shieldgemma2": ("shieldgemma2 is gemma3 (Gemma3ForConditionalGeneration): it attends bidirectionally within each "
                     "image's tokens (token_type_ids): the paged attention is causal"),
    "ovis2": ("ovis2's forward also puts visual-indicator embeddings (from its visual embedding table) at its "
              "indicator tokens, besides the image features at the image tokens"),
}


#: Inputs of the text model's forward that carry image content besides the image tokens' rows: a model whose
#: text model takes one is refused with the reason (the engine gives the text model input embeddings and
#: positions only).
TEXT_IMAGE_INPUTS = {
    "deepstack_visual_embeds": ("its text model adds features of several vision layers to the hidden states of "
                                "its first layers at the image tokens (deepstack), besides the input embeddings"),
}


#: Families whose image-token count is not the grid's patches / spatial_merge_size**2, why: counted when the
#: encoder runs (a prompt with another count is refused then).
GRID_COUNT_BY_ENCODER = {
    "hunyuan_vl": "a row separator per merged row and begin / end rows per image",
    "hy_v4_vl": "a row separator per merged row and begin / end rows per image",
}


#: Families whose ``pixel_values`` carry a leading per-prompt dim, ``(1, images, C, H, W)`` (their processor's
#: output for one prompt).
BATCHED_PIXELS = frozenset({"idefics2", "idefics3", "smolvlm"})


def text_image_input(model: torch.nn.Module) -> str | None:
    """The first :data:`TEXT_IMAGE_INPUTS` name the forward of ``model``'s text model takes (None: none)."""
    inner = getattr(model, "model", model)
    found = (getattr(owner, name, None) for owner in (inner, model) for name in ("language_model", "text_model"))
    text = next((m for m in found if isinstance(m, torch.nn.Module)), None)  # granite_docling: text_model
    if text is None:
        return None
    taken = inspect.signature(text.forward).parameters
    return next((name for name in TEXT_IMAGE_INPUTS if name in taken), None)


def deepstack_layers(model: torch.nn.Module) -> int:
    """How many text layers get vision features added at the image tokens (qwen3-vl's deepstack), where the
    engine serves it: a text model with ``_deepstack_process`` and ``deepstack_visual_indexes`` (0: none)."""
    text = text_model(model)
    indexes = getattr(getattr(model.config, "vision_config", None), "deepstack_visual_indexes", None)
    if text is model or not callable(getattr(text, "_deepstack_process", None)) or not indexes:
        return 0
    return len(indexes)


def refusal(model: torch.nn.Module, config: CompilationConfig, args: EngineArgs, *, tensor_parallel: bool) -> str | None:
    """Why the engine cannot serve the image-text-to-text ``model`` under ``config`` and ``args`` (None: it can)."""
    name = type(model).__name__
    kind = getattr(model.config, "model_type", "")
    if kind in REFUSED:
        return f"{name}: {REFUSED[kind]}"
    extra = text_image_input(model)
    if extra is not None and not (extra == "deepstack_visual_embeds" and deepstack_layers(model)):
        return f"{name}: {TEXT_IMAGE_INPUTS[extra]} (its text model's forward takes {extra})"
    if image_token(model) is None:
        return f"{name}: its config names no image token (image_token_id / image_token_index)"
    if config.use_ubatching:
        return (f"{name}: micro-batching (use_ubatching=True) is not served for image-text-to-text models (each half "
                "would read the image rows of the whole step)")
    if tensor_parallel:
        return f"{name}: tensor parallel is not served for image-text-to-text models yet (the ranks' mm_inputs agreement)"
    return None
