"""Speculative decoding of HF causal LMs: :class:`~piecewise_backend.serve.SpeculativeEngine` over two adapted models.

:class:`SpecEngine` adapts the target and the drafter (:func:`~.engine.adapt`), reads each one's
cache layout from its attention modules (the probe: HFEngine's source of the layout, since the
config's fields can be wrong), and serves them on serve's speculative engine: the online API,
preemption, chunked prefill and lazy capture included. :func:`truncated_drafter` builds a drafter
from the target's first layers.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch

from ..config import CompilationConfig
from ..modes import AttentionGraphSupport
from ..serve.arguments import MODEL_EOS, EngineArgs, engine_args, takes_engine_args
from ..serve.model_runner import KVLayout
from ..serve.speculative import SpecModel, SpeculativeEngine, check_speculative_args
from .adaptation import adapting, kv_shape
from .engine import check_hf_model, generation_eos, resolve_rules
from .modality import is_multimodal
from .host_breaks import host_read_downgrades, no_full_graphs
from .tensor_parallel import is_tensor_parallel


class SpecEngine(SpeculativeEngine):
    """Continuous batching with speculative decoding of HF causal LMs: ``drafter`` proposes, ``target`` verifies.

    ``drafter`` may be ``target`` itself (every draft is then accepted). Both models are switched
    to paged attention (:func:`~piecewise_backend.hf.adapt`) once every argument was checked.
    ``config`` is the target's; the drafter uses ``drafter_config`` (default: ``config``) with
    ``drafter=True``. ``attention_backend`` is ``HFEngine``'s, for both models' caches (reported as
    ``.attention_backend``); the other keywords are :class:`~piecewise_backend.hf.HFEngine`'s. The
    default stop token is the target's ``generation_config.eos_token_id``. ``.target_model`` and
    ``.drafter_model`` are the HF models given; ``.target`` and ``.drafter`` their model runners.
    """

    @takes_engine_args(exclude=MODEL_EOS)
    def __init__(
        self, target: torch.nn.Module, drafter: torch.nn.Module, config: CompilationConfig, *,
        num_speculative_tokens: int, drafter_config: CompilationConfig | None = None,
        target_attention_support: AttentionGraphSupport = AttentionGraphSupport.ALWAYS,
        args: EngineArgs | None = None, **engine_kwargs: Any,
    ):
        args = engine_args("SpecEngine", args, engine_kwargs, exclude=MODEL_EOS)
        k = check_speculative_args(num_speculative_tokens, config, drafter_config, args.max_num_batched_tokens,
                                   args.token_rules)
        if any(is_tensor_parallel(m) for m in (target, drafter)):
            raise ValueError("SpecEngine does not serve tensor-parallel models (tp_plan) yet: the drafter and the "
                             "verifier would need their collectives agreed per step; use HFEngine")
        multimodal = [type(m).__name__ for m in (target, drafter) if is_multimodal(m)]
        if multimodal:
            raise ValueError(f"SpecEngine does not serve image-text-to-text models yet ({multimodal[0]}): the drafter "
                             "would need the target's image embeddings; use HFEngine")
        vocab = [m.config.get_text_config().vocab_size for m in (target, drafter)]
        if vocab[0] != vocab[1]:
            raise ValueError(f"the drafter's vocabulary ({vocab[1]} tokens) must be the target's ({vocab[0]})")
        resolve_rules(target, None, "SpecEngine", vocab[0], applies=False)  # warns what generate would apply
        drafter_config = drafter_config or config
        for role, m, c in (("target", target, config), ("drafter", drafter, drafter_config)):
            check_hf_model(m, c, args.max_model_len)  # HFEngine's refusals (its position limit among them)
            args.check_model(m, role)
        # every check above ran before either model changed; a failure below undoes both adaptations
        with adapting(target) as adapted_target, (
                contextlib.nullcontext(adapted_target) if drafter is target else adapting(drafter)) as adapted_drafter:
            self._start_speculative(
                args, k, _served(adapted_target, config), _served(adapted_drafter, drafter_config),
                target_attention_support, vocab_size=vocab[0], eos_token_id=frozenset(),
            )
        #: the HF models (adapted in place); ``.target.model`` / ``.drafter.model`` are the adapted ones compiled
        self.target_model, self.drafter_model = target, drafter

    def default_eos(self) -> Any:
        """The target's ``generation_config.eos_token_id``, as ``model.generate`` uses by default."""
        return generation_eos(self.target_model)


def _served(adapted: torch.nn.Module, config: CompilationConfig) -> SpecModel:
    """A model :func:`~.engine.adapt` returned, as a speculative engine runs it: its probed cache layout and states, and ``config``
    without FULL graphs when it has a break point (no FULL graph holds one)."""
    return SpecModel(adapted, no_full_graphs(config, adapted.host_breaks),
                     KVLayout(*kv_shape(adapted), adapted.indexer_dim), adapted.state_specs,
                     host_read_downgrades(config, adapted.host_breaks))


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
