"""Which kind of transformers model this is: a text model alone, or an image-text-to-text model around one.

An image-text-to-text model (llava, qwen2-vl, ...) has a vision sub-config and ``get_image_features``;
only its text model's attention goes to the paged op (:func:`text_attention`), its vision tower keeps its own.
"""

from __future__ import annotations

import torch


def is_multimodal(model: torch.nn.Module) -> bool:
    """Whether ``model`` is an image-text-to-text model: a vision sub-config and ``get_image_features``."""
    sub = getattr(type(model.config), "sub_configs", {}) or {}
    return "vision_config" in sub and callable(getattr(model, "get_image_features", None))


def text_attention(model: torch.nn.Module, implementation: str) -> str | dict[str, str]:
    """What ``set_attn_implementation`` takes to switch the text model alone to ``implementation``
    (an image-text-to-text model's vision tower keeps its own attention)."""
    if not is_multimodal(model):
        return implementation
    text = model.config.get_text_config()
    for key in type(model.config).sub_configs:
        if getattr(model.config, key, None) is text:
            return {key: implementation}
    return implementation


def image_token(model: torch.nn.Module) -> int | None:
    """The id of the placeholder token an image's features replace."""
    for name in ("image_token_id", "image_token_index"):
        value = getattr(model.config, name, None)
        if isinstance(value, int):
            return value
    return None




def text_model(model: torch.nn.Module) -> torch.nn.Module:
    """The module of ``model`` whose config is its text config: the language model of an image-text-to-text
    model, ``model`` itself otherwise."""
    if not is_multimodal(model):
        return model
    text = model.config.get_text_config()
    return next((m for m in model.modules() if m is not model and getattr(m, "config", None) is text), model)


def can_set_attention(model: torch.nn.Module) -> bool:
    """Whether ``set_attn_implementation`` reaches ``model``'s text attention (an image-text-to-text model's
    vision tower may keep attention of its own code: it is not switched)."""
    inner = text_model(model)
    return inner._can_set_attn_implementation() if inner is not model else model._can_set_attn_implementation()
