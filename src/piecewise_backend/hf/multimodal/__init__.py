"""Image-text-to-text models on the engine: a request's images, their encoder output, M-RoPE positions.

A request's ``mm_inputs`` are the model's own multimodal keyword inputs for its prompt (what its
processor returns for it: ``pixel_values``, ``image_grid_thw``, ``image_sizes``, ...). :class:`Admit`
checks them against the prompt's image tokens and keeps a copy (:class:`Images`). The step that
prefills a request's first image token runs the encoder (the model's ``get_image_features``: vision
tower and projector, eagerly) and keeps its output until every image token is prefilled; then
:class:`ImageTokensFirst`, the runner's layout around the model, puts those rows in place of the
image tokens' embeddings. Its step buffers are module buffers written in place before each step
(the graphs read them where they are), so the runner's own inputs are the text model's.

M-RoPE models (qwen2-vl and relatives, a ``get_rope_index``) get 3-D rope positions: per request,
the model's ``get_rope_index`` over its prompt, and past the prompt the sequence position plus the
request's rope delta (the model keeps one delta per batch; here each request has its own). The KV
cache keeps 1-D sequence positions.

The package: :mod:`.families` (what is served of each family, refusals), :mod:`.inputs` (a request's
``mm_inputs`` admitted), :mod:`.layout` (the runner's layout around the model), :mod:`.step` (the
executor that runs the encoder), :mod:`.encoder_graphs` (the encoder as CUDA graphs).
"""

from .encoder_graphs import DEFAULT_BUDGETS, FIXED_SIZE, GRID_TOWERS, EncoderGraphs, GridEncoderGraphs, fixed_image_shape
from .families import (
    BATCHED_PIXELS,
    GRID_COUNT_BY_ENCODER,
    REFUSED,
    TEXT_IMAGE_INPUTS,
    deepstack_layers,
    refusal,
    text_image_input,
)
from .inputs import VIDEO_KEYS, Admit, Images, digest, split_inputs
from .layout import ImageTokensFirst, layout
from .step import ImageDecode, build_encoder_graphs, encode, features

__all__ = [
    "BATCHED_PIXELS", "DEFAULT_BUDGETS", "FIXED_SIZE", "GRID_COUNT_BY_ENCODER", "GRID_TOWERS", "REFUSED",
    "TEXT_IMAGE_INPUTS", "VIDEO_KEYS", "Admit", "EncoderGraphs", "GridEncoderGraphs", "ImageDecode", "ImageTokensFirst",
    "Images", "build_encoder_graphs", "deepstack_layers", "digest", "encode", "features", "fixed_image_shape", "layout",
    "refusal", "split_inputs", "text_image_input",
]
