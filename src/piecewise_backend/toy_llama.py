"""Documented path of ``piecewise_backend.models.toy_llama`` (the toy Llama): a re-export."""

from .models.toy_llama import (  # noqa: F401
    ATTENTION_KINDS,
    AttnMetadata,
    DecoderLayer,
    RMSNorm,
    ToyConfig,
    ToyLlama,
    attention,
    attention_break,
    attention_fresh,
    make_model,
)
