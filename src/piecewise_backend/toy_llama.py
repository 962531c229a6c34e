"""Documented path of ``piecewise_backend.testing.toy_llama`` (the toy Llama): a re-export."""

from .testing.toy_llama import (  # noqa: F401
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
