"""Speculative decoding of HF causal LMs: :class:`~piecewise_backend.serve.SpeculativeEngine` over two adapted models.

:class:`SpecEngine` adapts the target and the drafter (:func:`~.engine.adapt`), reads each one's
cache layout from its attention modules (the probe: HFEngine's source of the layout, since the
config's fields can be wrong), and serves them on serve's speculative engine: the online API,
preemption, chunked prefill and lazy capture included. :func:`truncated_drafter` builds a drafter
from the target's first layers.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from ..config import CompilationConfig
from ..modes import AttentionGraphSupport
from ..serve.arguments import check_attention_backend
from ..serve.model_runner import KVLayout, first_parameter
from ..serve.speculative import SpeculativeEngine, check_speculative_args
from .engine import adapt, check_hf_model, generation_eos, kv_shape
from .host_breaks import no_full_graphs
from .tensor_parallel import is_tensor_parallel


class SpecEngine(SpeculativeEngine):
    """Continuous batching with speculative decoding of HF causal LMs: ``drafter`` proposes, ``target`` verifies.

    ``drafter`` may be ``target`` itself (every draft is then accepted). Both models are switched
    to paged attention (:func:`~piecewise_backend.hf.adapt`) once every argument was checked.
    ``config`` is the target's; the drafter uses ``drafter_config`` (default: ``config``) with
    ``drafter=True``. ``attention_backend`` is ``HFEngine``'s, for both models' caches (reported as
    ``.attention_backend``); the other keywords are :class:`~piecewise_backend.hf.HFEngine`'s. The
    default stop token is the target's ``generation_config.eos_token_id``.
    """

    def __init__(
        self,
        target: torch.nn.Module,
        drafter: torch.nn.Module,
        config: CompilationConfig,
        *,
        num_speculative_tokens: int,
        drafter_config: CompilationConfig | None = None,
        target_attention_support: AttentionGraphSupport = AttentionGraphSupport.ALWAYS,
        max_num_reqs: int = 4,
        max_model_len: int = 128,
        block_size: int = 16,
        num_blocks: int | None = None,
        attention_backend: str = "auto",
        lazy_capture: bool = False,
        max_num_batched_tokens: int | None = None,
        graph_memory_budget: int | None = None,
        step_capture_budget_s: float | None = None,
    ):
        engine_args = dict(max_num_reqs=max_num_reqs, max_model_len=max_model_len, block_size=block_size,
                           num_blocks=num_blocks, lazy_capture=lazy_capture,
                           max_num_batched_tokens=max_num_batched_tokens, graph_memory_budget=graph_memory_budget,
                           step_capture_budget_s=step_capture_budget_s)
        check_speculative_args(num_speculative_tokens, config, drafter_config, **engine_args)
        if any(is_tensor_parallel(m) for m in (target, drafter)):
            raise ValueError("SpecEngine does not serve tensor-parallel models (tp_plan) yet: the drafter and the "
                             "verifier would need their collectives agreed per step; use HFEngine")
        vocab = [m.config.get_text_config().vocab_size for m in (target, drafter)]
        if vocab[0] != vocab[1]:
            raise ValueError(f"the drafter's vocabulary ({vocab[1]} tokens) must be the target's ({vocab[0]})")
        for role, m, c in (("target", target, config), ("drafter", drafter, drafter_config or config)):
            limit = getattr(m.config.get_text_config(), "max_position_embeddings", None)
            if limit is not None and max_model_len > limit:
                raise ValueError(f"max_model_len={max_model_len} exceeds {type(m).__name__}'s max_position_embeddings={limit}")
            check_hf_model(m, c, max_model_len)
            param = first_parameter(m, role)
            check_attention_backend(attention_backend, device=param.device, dtype=param.dtype, block_size=block_size)
        adapted_target = adapt(target)
        adapted_drafter = adapted_target if drafter is target else adapt(drafter)
        # a break point: no FULL graph holds it
        target_config = no_full_graphs(config, adapted_target.host_breaks)
        drafter_config = no_full_graphs(drafter_config or config, adapted_drafter.host_breaks)
        super().__init__(
            adapted_target, adapted_drafter, target_config, num_speculative_tokens=num_speculative_tokens,
            target_layout=KVLayout(*kv_shape(adapted_target), adapted_target.indexer_dim),
            drafter_layout=KVLayout(*kv_shape(adapted_drafter), adapted_drafter.indexer_dim),
            vocab_size=vocab[0], target_state_specs=adapted_target.state_specs,
            drafter_state_specs=adapted_drafter.state_specs, drafter_config=drafter_config,
            target_attention_support=target_attention_support,
            attention_backend=attention_backend, **engine_args,
        )
        self.target.model, self.drafter.model = target, drafter  # the HF models (adapted in place)

    def default_eos(self) -> Any:
        """The target's ``generation_config.eos_token_id``, as ``model.generate`` uses by default."""
        return generation_eos(self.target.model)


def truncated_drafter(model: torch.nn.Module, num_layers: int) -> torch.nn.Module:
    """A draft model: ``model``'s first ``num_layers`` decoder layers with its embeddings, final norm
    and head (self-speculation by early exit); same vocabulary by construction. ``model`` is untouched."""
    config = copy.deepcopy(model.config)
    total = config.get_text_config().num_hidden_layers
    if not isinstance(num_layers, int) or isinstance(num_layers, bool) or not 1 <= num_layers <= total:
        raise ValueError(f"num_layers must be an int in 1..{total} (the target's layer count), got {num_layers!r}")
    config.get_text_config().num_hidden_layers = num_layers
    for name in ("layer_types",):  # per-layer lists follow the layer count
        prop = getattr(type(config), name, None)
        derived = isinstance(prop, property) and prop.fset is None  # mamba2's follows num_hidden_layers itself
        if not derived and isinstance(getattr(config, name, None), list):
            setattr(config, name, getattr(config, name)[:num_layers])
    draft = type(model)(config)
    missing = draft.load_state_dict(model.state_dict(), strict=False).missing_keys
    if missing:
        raise ValueError(f"truncated_drafter: the draft model has weights the target lacks: {missing[:3]}")
    param = next(model.parameters())
    return draft.to(device=param.device, dtype=param.dtype).eval()
