"""Model factories that tests/project/test_cli.py hands ``python -m piecewise_backend inspect`` as
``pbtest.cli_factories:NAME`` (importable in the test process and in its subprocesses)."""

from __future__ import annotations

import pytest
import torch

from piecewise_backend.toy_llama import make_model


def pair_factory():
    """A model plus its own example inputs (--tokens does not apply)."""
    return make_model(attention="sdpa"), (torch.randint(0, 128, (5,)),)


class _Noisy(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.rand_like(x, dtype=torch.float)  # eager and compiled draw different numbers


def noisy_factory():
    return _Noisy()


not_a_factory = 42


def raising_factory():
    raise ValueError("no weights here")


def factory_with_arguments(size, layers=2):
    return make_model(layers)


class _NeedsMask(torch.nn.Module):
    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return ids * mask


def failing_model_factory():
    return _NeedsMask()  # inspect's default inputs give it one argument, not two


def keyword_factory():
    """Keyword example inputs, passed as ``model(ids=..., mask=...)``."""
    return _NeedsMask(), {"ids": torch.arange(4), "mask": torch.ones(4, dtype=torch.long)}


def hf_factory():
    """A tiny random-weight Hugging Face Llama (nothing downloaded): 2-D ``input_ids`` as a keyword."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


@torch.library.custom_op("pb_test_cli::context_scale", mutates_args=())
def context_scale(x: torch.Tensor) -> torch.Tensor:
    """Multiplies by the forward context's ``scale``: an op that reads the context, as attention reads its metadata."""
    import piecewise_backend as pb

    return x * pb.get_forward_context().scale


@context_scale.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class _ReadsContext(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(128, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.ops.pb_test_cli.context_scale(self.emb(ids)).sum(-1)


def context_model_factory():
    return _ReadsContext()


def scale_context(ids: torch.Tensor) -> dict:
    """The forward context of a step of ``ids`` (what --context supplies): its ``scale``."""
    return {"scale": float(len(ids))}


def fixed_context() -> dict:
    return {"scale": 0.5}


def not_a_dict_context() -> list:
    return [1, 2]


class _Breaks(torch.nn.Module):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = ids.float() * 2
        h = h[h > 4]  # boolean-mask indexing: Dynamo breaks the graph here
        return h.sum()


def graph_break_factory():
    return _Breaks()
