"""Fixtures for users' and our own tests: ``graph_code`` for expecttests (imported here); the toy models
(``testing.toy_llama``, ``testing.moe``, ``testing.sharding``) and tiny random Hugging Face models
(``testing.hf_models``) are submodules, imported by name: importing them registers their ops."""

from .graphs import graph_code

__all__ = ["graph_code"]
