"""A request's images: its ``mm_inputs`` checked against its prompt and kept (:class:`Admit`, :class:`Images`).

``mm_inputs`` are the model's own multimodal keyword inputs for one prompt (what its processor returns for
it); :class:`Admit` refuses what does not match the prompt's image tokens at ``add_request`` and copies the
rest to the model's device and dtype, with the request's M-RoPE positions and a digest of the images (in its
prefix-cache keys). :func:`split_inputs` cuts a processor's batched output into one dict per prompt.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
from collections.abc import Mapping
from typing import Any

import torch

from ..modality import image_token
from .families import BATCHED_PIXELS, GRID_COUNT_BY_ENCODER


#: Keyword inputs of video frames: not served (refused at ``add_request``).
VIDEO_KEYS = ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts")


@dataclasses.dataclass
class Images:
    """What a request keeps of its ``mm_inputs``: copies on the model's device, the prompt positions
    of its image tokens, its M-RoPE positions (``(prompt, 3)``; None: 1-D rope) and delta, a digest
    of the images' content, and the encoder output while image tokens are left to prefill."""

    inputs: dict[str, torch.Tensor]
    placeholders: torch.Tensor  # (image tokens,) long, ascending prompt positions
    rope: torch.Tensor | None = None
    delta: int = 0
    digest: bytes = b""
    embeds: torch.Tensor | None = None  # (image tokens, hidden): the encoder's output, dropped once prefilled

    @property
    def last(self) -> int:
        """The position after the last image token (the encoder output is needed before it)."""
        return int(self.placeholders[-1]) + 1 if self.placeholders.numel() else 0


def digest(inputs: Mapping[str, torch.Tensor]) -> bytes:
    """A content hash of ``inputs`` (names, dtypes, shapes and bytes): requests with other images never share
    cached prompt blocks."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(inputs):
        t = inputs[name].detach().to("cpu").contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.digest()


class Admit:
    """``(prompt ids, mm_inputs, where) -> Images | None`` for one model: the engine's
    :attr:`~piecewise_backend.serve.loop.ServingLoop.multimodal` (refusals name ``where``)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.image_token = image_token(model)
        forward = inspect.signature(model.forward).parameters
        #: the keyword inputs the model's forward takes besides text (what mm_inputs may hold)
        self.accepted = frozenset(n for n in forward if n not in ("input_ids", "attention_mask", "position_ids",
                                                                  "inputs_embeds", "labels", "use_cache", "cache",
                                                                  "past_key_values", "cache_position", "kwargs",
                                                                  "logits_to_keep", "return_dict"))
        self.vision = model.config.vision_config
        self.merge = getattr(self.vision, "spatial_merge_size", None)
        inner = getattr(model, "model", model)
        self.rope_index = getattr(inner, "get_rope_index", None)

    def __call__(self, prompt: list[int], mm_inputs: Any, where: str) -> Images | None:
        ids = torch.tensor(prompt, dtype=torch.long)
        places = (ids == self.image_token).nonzero().flatten()
        if mm_inputs is None:
            if places.numel():
                raise ValueError(f"{where}: the prompt holds {places.numel()} image tokens (id {self.image_token}) "
                                 "but no mm_inputs give their images")
            return self._text(len(prompt))
        inputs = self._copy(mm_inputs, where)
        if not places.numel():
            raise ValueError(f"{where}: mm_inputs given, but the prompt holds no image token (id {self.image_token})")
        expected = self.image_tokens(inputs, where)
        if expected is not None and expected != places.numel():
            raise ValueError(f"{where}: the images in mm_inputs make {expected} image tokens, the prompt holds "
                             f"{places.numel()} (id {self.image_token}): one placeholder token per image feature")
        images = Images(inputs, places.to(self.device), digest=digest(inputs))
        if self.rope_index is not None:
            self._rope(images, ids, where)
        return images

    def _text(self, length: int) -> Images | None:
        """A text-only request: None, or on an M-RoPE model its (equal) 3-D positions."""
        if self.rope_index is None:
            return None
        rope = torch.arange(length, device=self.device)[:, None].expand(length, 3).contiguous()
        return Images({}, torch.zeros(0, dtype=torch.long, device=self.device), rope=rope)

    def _copy(self, mm_inputs: Any, where: str) -> dict[str, torch.Tensor]:
        """``mm_inputs`` copied to the model's device (floating inputs in its dtype, as ``generate`` casts
        pixel values), after the checks of their keys and types."""
        if not isinstance(mm_inputs, Mapping) or not mm_inputs:
            raise ValueError(f"{where}: mm_inputs must be a non-empty dict of the model's multimodal keyword inputs "
                             f"(e.g. pixel_values), got {type(mm_inputs).__name__}")
        video = sorted(k for k in mm_inputs if k in VIDEO_KEYS)
        if video:
            raise ValueError(f"{where}: video inputs {video} are not served (images only)")
        unknown = sorted(str(k) for k in mm_inputs if k not in self.accepted)
        if unknown:
            raise ValueError(f"{where}: mm_inputs {unknown} are not keyword inputs of {type(self.model).__name__}'s "
                             f"forward; it takes {sorted(self.accepted)}")
        if "pixel_values" not in mm_inputs:
            raise ValueError(f"{where}: mm_inputs has no pixel_values")
        out = {}
        for name, value in mm_inputs.items():
            if not isinstance(value, torch.Tensor):
                try:
                    value = torch.as_tensor(value)
                except Exception as e:
                    raise ValueError(f"{where}: mm_inputs[{name!r}] must be a tensor, got {type(value).__name__}") from e
            dtype = self.dtype if value.is_floating_point() else value.dtype
            out[name] = value.detach().to(device=self.device, dtype=dtype, copy=True)
        return out

    def image_tokens(self, inputs: Mapping[str, torch.Tensor], where: str) -> int | None:
        """How many image tokens ``inputs`` make (None where only the encoder can tell: checked when it runs);
        pixel values of the wrong shape refused."""
        pixels = inputs["pixel_values"]
        grid = inputs.get("image_grid_thw")
        if grid is not None and self.merge:  # patches flattened: (sum of t*h*w, channels * patch volume)
            if grid.dim() != 2 or grid.shape[1] != 3:
                raise ValueError(f"{where}: image_grid_thw must be (images, 3), got shape {tuple(grid.shape)}")
            patches = int(grid.prod(-1).sum())
            if pixels.dim() < 2 or pixels.shape[0] != patches:  # (patches, C, p, p): paddleocr_vl, kimi_k25
                raise ValueError(f"{where}: pixel_values of shape {tuple(pixels.shape)} do not match image_grid_thw "
                                 f"{grid.tolist()}: it needs ({patches}, patch features)")
            return None if self.model.config.model_type in GRID_COUNT_BY_ENCODER else patches // self.merge ** 2
        size, patch = getattr(self.vision, "image_size", None), getattr(self.vision, "patch_size", None)
        channels = getattr(self.vision, "num_channels", 3)
        if "image_sizes" in inputs or not isinstance(size, int) or not isinstance(patch, int):
            return None
        if self.model.config.model_type in BATCHED_PIXELS and pixels.dim() == 5 and pixels.shape[0] == 1:
            pixels = pixels[0]
        if pixels.dim() != 4 or tuple(pixels.shape[1:]) != (channels, size, size):
            raise ValueError(f"{where}: pixel_values must be (images, {channels}, {size}, {size}), got "
                             f"{tuple(pixels.shape)}")
        strategy = getattr(self.model.config, "vision_feature_select_strategy", None)
        if type(self.model).__name__ != "LlavaForConditionalGeneration" or strategy not in ("default", "full"):
            return None
        per_image = (size // patch) ** 2 + (strategy == "full")
        return pixels.shape[0] * per_image

    def _rope(self, images: Images, ids: torch.Tensor, where: str) -> None:
        """The M-RoPE positions of the prompt and its delta, as the model computes them."""
        wanted = inspect.signature(self.rope_index).parameters
        given = {k: v for k, v in images.inputs.items() if k in wanted}
        if "mm_token_type_ids" in wanted and "mm_token_type_ids" not in given:
            given["mm_token_type_ids"] = (ids == self.image_token).int()[None].to(self.device)
        try:
            rope, delta = self.rope_index(ids[None].to(self.device), **given)
        except Exception as e:
            raise ValueError(f"{where}: the model's get_rope_index fails on these mm_inputs "
                             f"({type(e).__name__}: {e})") from e
        images.rope = rope[:, 0].t().contiguous()  # (prompt, 3)
        images.delta = int(delta.flatten()[0])


def split_inputs(batch: Mapping[str, Any], model: torch.nn.Module) -> list[dict[str, torch.Tensor] | None]:
    """One ``mm_inputs`` dict (None: no image) per prompt of a processor's batched output for ``model``.

    ``batch`` holds ``input_ids`` (prompts, tokens) and the images of every prompt in prompt order:
    per-image inputs (``pixel_values`` of every image, or of every patch with ``image_grid_thw``;
    ``image_sizes``, ...) are cut at each prompt's images; inputs with one row per prompt
    (``pixel_values`` of shape (prompts, images, C, H, W)) at its row. Without a grid, a prompt's
    image count is its image tokens over the tokens per image (every image the same size).
    """
    ids = batch["input_ids"]
    token = image_token(model)
    tokens = (torch.as_tensor(ids) == token).sum(-1).tolist()
    prompts = len(tokens)
    pixels = batch["pixel_values"]
    rest = {k: v for k, v in batch.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids",
                                                         "token_type_ids")}
    grid = batch.get("image_grid_thw")
    if grid is not None:
        merge = model.config.vision_config.spatial_merge_size
        per_image = (grid.prod(-1) // merge ** 2).tolist()
        patches = grid.prod(-1).tolist()
    elif pixels.dim() == 5 and pixels.shape[0] == prompts:  # one row per prompt
        return [({k: v[i] for k, v in rest.items()} if tokens[i] else None) for i in range(prompts)]
    else:
        images = pixels.shape[0]
        if images == 0 or sum(tokens) % images:
            raise ValueError(f"split_inputs: {sum(tokens)} image tokens over {images} images: not one size per image")
        per_image = [sum(tokens) // images] * images
        patches = [1] * images
    out: list[dict[str, torch.Tensor] | None] = []
    image = patch = 0
    for i, n in enumerate(tokens):
        first_image, first_patch, have = image, patch, 0
        while have < n and image < len(per_image):
            have, patch, image = have + per_image[image], patch + patches[image], image + 1
        if have != n:
            raise ValueError(f"split_inputs: prompt {i} holds {n} image tokens; its images make {have}")
        if not n:
            out.append(None)
            continue
        out.append({k: v[first_patch:patch] if k == "pixel_values" else v[first_image:image] for k, v in rest.items()})
    return out
