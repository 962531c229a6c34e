"""Adapting a transformers model: the :class:`Mechanism` protocol, its mechanisms in order, :func:`adapt`.

A mechanism is one way of making a model servable, in its own module: it says why it cannot serve
a model (its refusal) and installs itself, returning the undo of what it changed. :func:`adapt`
checks the refusals of the mechanisms that run before the probe (:data:`BEFORE_PROBE`; the model's
own, :func:`.adapter.refusal`, among them), installs them, runs the probe forward (:func:`.adapter.probe`: a frozen
:class:`.probe_result.ProbeResult`), then the mechanisms that read it (:data:`AFTER_PROBE`), all in
one rollback: any exception undoes every install so far and leaves the model as it was.
docs/engine.md ("Adding a model family") goes from a refusal's text to its mechanism.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import torch

from ..serve.model_runner import own_code
from ..state.cache import StateSpec
from . import attention_swaps, host_breaks, indexed, mixers, paged_attention, position_swaps, self_assignments
from .adapter import EXPERTS, SERVED_LAYERS, probe
from .call_sites import CallSites
from .patching import Changes, Undo
from .probe_result import ProbeResult
from .transformers_lib import transformers_module


class Mechanism(Protocol):
    """One way of adapting a transformers model; :func:`adapt` applies them in order.

    ``probed`` is None for the mechanisms installed before the probe forward (:data:`BEFORE_PROBE`)
    and the probe's frozen :class:`~.probe_result.ProbeResult` for those after it (:data:`AFTER_PROBE`).
    """

    #: a short name (docs/engine.md's table)
    name: str

    def refusal_of(self, model: torch.nn.Module, probed: ProbeResult | None) -> str | None:
        """Why this mechanism cannot serve ``model`` (the message ``adapt`` raises as ``ValueError``), or None."""
        ...

    def install(self, model: torch.nn.Module, probed: ProbeResult | None) -> Undo:
        """Change ``model``; returns what reverts every change. May raise ``ValueError`` naming a refusal
        found only while installing (a host read no module around it can take)."""
        ...


#: Installed before the probe, in this order (their refusals are checked first, before anything changes).
BEFORE_PROBE: tuple[Mechanism, ...] = (
    EXPERTS, attention_swaps.MECHANISM, SERVED_LAYERS, position_swaps.MECHANISM, indexed.MECHANISM,
)
#: Installed after the probe, in this order, each after its refusal.
AFTER_PROBE: tuple[Mechanism, ...] = (
    host_breaks.MECHANISM, paged_attention.MECHANISM, self_assignments.MECHANISM, mixers.MECHANISM,
)


class TokensFirst(torch.nn.Module):
    """``(input_ids (tokens,), position_ids (tokens,)) -> logits (tokens, vocab)`` around a HF causal LM."""

    def __init__(
        self, model: torch.nn.Module, kv_shape: tuple[int, int, int] | None = None, host_breaks: list[str] | None = None,
        state_specs: Sequence[StateSpec] = (),
        indexer_dim: int = 0,
        call_sites: CallSites | None = None,
    ):
        super().__init__()
        self.model = model
        #: the indexer key size of its indexed attention layers (0: none; set by :func:`adapt`)
        self.indexer_dim = indexer_dim
        #: (attention layers, kv_heads, head_dim) of the cache the model needs (set by :func:`adapt`)
        self.kv_shape = kv_shape
        #: modules that read the host, run as break points (:mod:`~piecewise_backend.hf.host_breaks`)
        self.host_breaks = host_breaks or []
        #: the states its state layers keep per request, in the order of the state cache (set by :func:`adapt`)
        self.state_specs = list(state_specs)
        #: the attention calls of one forward where the cache holds a slot per call (:mod:`.call_sites`)
        self.call_sites = call_sites

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        # A step has >= 1 token: with the unbacked token count known non-zero, a model's
        # ``reshape(..., -1, d)`` needs no data-dependent guard (qwen3_next broke its graph there).
        torch._check(input_ids.shape[0] >= 1)
        if self.call_sites is not None:
            self.call_sites.start()
        return self.model(input_ids=input_ids[None], position_ids=position_ids[None], use_cache=False).logits[0]


def adapt(model: torch.nn.Module) -> TokensFirst:
    """Switch ``model`` to paged attention and wrap it in the runner's layout (the model is modified).

    Refuses (``ValueError`` naming the reason) any model the paged attention would serve wrongly:
    see :mod:`piecewise_backend.hf.adapter`; a refused model is left as it was. Mixture-of-experts
    layers are switched to a sync-free implementation; the cache layout is read from the attention
    modules by a probe forward.
    """
    return _adapt(model)[0]


@contextmanager
def adapting(model: torch.nn.Module) -> Iterator[TokensFirst]:
    """:func:`adapt` ``model`` for the body, which builds on it: when the body raises, the adaptation is
    undone (every change, newest first, and the modules' training modes) and the error raised on. An
    engine that adapts and then builds (or adapts a second model) leaves nothing adapted when it fails."""
    adapted, undo = _adapt(model)
    try:
        yield adapted
    except BaseException:
        undo()
        raise


def _adapt(model: torch.nn.Module) -> tuple[TokensFirst, Undo]:
    """:func:`adapt`, and what undoes it."""
    transformers = transformers_module()
    if not isinstance(model, transformers.PreTrainedModel):
        raise TypeError(f"adapt() takes a transformers PreTrainedModel, got {type(model).__name__}")
    name = type(model).__name__
    if getattr(model.config, "is_encoder_decoder", False) or not model.can_generate():
        raise ValueError(f"{name} is not a decoder-only causal LM; adapt() serves those only")
    for mechanism in BEFORE_PROBE:  # in order, the first refusal raises: nothing has changed yet
        reason = mechanism.refusal_of(model, None)
        if reason is not None:
            raise ValueError(reason)
    modes = [(m, m.training) for m in model.modules()]
    with rollback(model) as changes:
        for mechanism in BEFORE_PROBE:
            changes.then(mechanism.install(model, None))
        probed = probe_forward(model)
        for mechanism in AFTER_PROBE:
            reason = mechanism.refusal_of(model, probed)
            if reason is not None:
                raise ValueError(reason)
            changes.then(mechanism.install(model, probed))
    adapted = own_code(TokensFirst)(
        model.eval(), probed.kv_shape(), host_breaks.installed(model), mixers.specs(probed.state_layers),
        indexed.index_dim(model), probed.call_site_modules(),
    )

    def undo() -> None:
        changes.undo()
        for m, training in modes:
            m.training = training

    return adapted, undo


def probe_forward(model: torch.nn.Module) -> ProbeResult:
    """The adapter's probe of ``model`` (in eval mode), a failing forward refused as ``ValueError``."""
    try:
        return probe(model.eval())
    except Exception as e:  # e.g. a forward that needs more than token ids (embeddings, shared K/V states)
        raise ValueError(
            f"{type(model).__name__} fails on a plain token-id forward ({type(e).__name__}: {e}); adapt() gives it nothing else"
        ) from e


@contextmanager
def rollback(model: torch.nn.Module) -> Iterator[Changes]:
    """Within: what the installs record in the journal; on any exception, every change undone, newest first
    (the modules' training modes too), and the exception raised on."""
    changes = Changes()
    modes = [(m, m.training) for m in model.modules()]
    try:
        yield changes
    except BaseException:
        changes.undo()
        for m, training in modes:
            m.training = training
        raise


def kv_shape(model_or_config: Any) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of the cache a model needs.

    Given a model (or a :class:`TokensFirst`), read from its attention modules by a probe forward
    (multi-query, per-module head counts, MLA's differing K/V head dims: padded to the widest);
    given a HF config, computed from the config's fields (which some models do not follow).
    """
    if isinstance(model_or_config, TokensFirst) and model_or_config.kv_shape is not None:
        return model_or_config.kv_shape
    if isinstance(model_or_config, torch.nn.Module):
        result = probe(model_or_config)
        if not result.layers and not result.state_layers:
            raise ValueError(f"{type(model_or_config).__name__} calls no attention through transformers' AttentionInterface")
        return result.kv_shape()
    config = model_or_config.get_text_config() if hasattr(model_or_config, "get_text_config") else model_or_config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, kv_heads, head_dim
