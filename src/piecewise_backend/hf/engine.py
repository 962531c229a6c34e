"""Serve a stock Hugging Face decoder-only model on GraphRunner with a paged KV cache.

Needs ``transformers`` (``pip install piecewise_backend[hf]``); importing ``piecewise_backend``
alone never imports it. Works for decoder-only models whose attention goes through
transformers' ``AttentionInterface`` (Llama, Qwen, Mistral, Mixtral, DeepSeek V2/V3, gpt-oss,
Gemma 2/3, ...), and those whose attention modules :mod:`.attention_swaps` swaps onto the paged
op (falcon, bloom, mpt, gpt_neox_japanese, xglm, openai-gpt), and the decoders of encoder-decoder
families whose positional embeddings :mod:`.position_swaps` points at ``position_ids`` (bart, marian,
pegasus, ...); :func:`adapt` refuses, naming the
reason, every model it would serve wrongly (:mod:`piecewise_backend.hf.adapter`; docs/models.md
lists every type's outcome):

* :func:`register_attention` adds ``pb_paged`` to the interface: HF's q/k/v (after RoPE) go to
  ``pb_kv::paged_attention``, which reads the step's metadata from the forward context. HF builds
  no mask and no cache for an implementation it does not know masks for, and ``use_cache=False``.
* :func:`adapt` reads the cache layout from the attention modules (a probe forward), pads
  narrower head dims and repeats KV heads of layers with fewer, and switches MoE experts to a
  sync-free implementation.
* :class:`TokensFirst` is the runner's layout: all tokens of a step as one row
  (``input_ids[None]``), with ``position_ids`` per token, so RoPE sees each token's own position.
* :class:`HFEngine` is :class:`piecewise_backend.serve.Engine` over the adapted model: the serving
  loop (chunked prefill, preemption, sampling, streaming, the online API, lazy capture) is
  serve's; steps with prompt tokens replay PIECEWISE graphs, pure decode steps replay one FULL graph.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ..config import CompilationConfig
from ..serve.arguments import MODEL_EOS, EngineArgs, check_config, engine_args, engine_keywords, takes_engine_args
from ..serve.engine import Engine
from ..serve.model_runner import Decode, KVLayout, ModelRunner, own_code
from ..state.cache import StateSpec
from . import attention_swaps, indexed, mixers, position_swaps
from .adapter import graph_safe_experts, layout_refusal, length_refusal, probe, refusal, transformers_module
from .buffers import drop_self_assignments
from .call_sites import CallSites
from .host_breaks import install_host_breaks, no_full_graphs
from .tensor_parallel import (
    check_engine_agreement,
    check_heads,
    composition_refusal,
    is_tensor_parallel,
    localize,
    replicated_kv_plan,
)

ATTN_IMPLEMENTATION = "pb_paged"


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """AttentionInterface entry: ``query`` (1, heads, tokens, dim) -> ((1, tokens, heads, v_dim), None).

    q/k/v are zero-padded to the cache's head dim (``module.pb_head_dim``, set by :func:`adapt`) when
    narrower, which leaves the scores unchanged (the scale is the unpadded one); the output is sliced back.
    A layer with fewer KV heads than the cache repeats each ``module.pb_kv_repeat`` times: query head
    ``h`` still meets KV head ``h // (heads // kv_heads)``.
    """
    if query.shape[0] != 1:
        raise ValueError(f"{ATTN_IMPLEMENTATION} attention takes the tokens-first layout (batch of 1 row), got batch {query.shape[0]}")
    sinks = kwargs.get("s_aux")  # gpt-oss style: one logit per query head in each softmax denominator
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    dim = getattr(module, "pb_head_dim", query.shape[-1])
    v_dim = value.shape[-1]
    repeat = getattr(module, "pb_kv_repeat", 1)  # a layer with fewer KV heads than the cache: each one repeated
    if repeat > 1:
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    q, k, v = (F.pad(t[0], (0, dim - t.shape[-1])).transpose(0, 1).contiguous() for t in (query, key, value))
    out = torch.empty_like(q)
    sites = getattr(module, "pb_call_sites", None)  # a cache slot per call, not per layer (see .call_sites)
    layer = sites.next(module) if sites is not None else getattr(module, "pb_kv_layer", module.layer_idx)
    selected = kwargs.get("indices")  # an indexer's top-k positions (1, tokens, topk): indexed attention
    if selected is not None:
        if sliding_window or softcap:
            raise ValueError(f"{ATTN_IMPLEMENTATION}: indexed attention takes no sliding window or soft-capping")
        torch.ops.pb_kv.indexed_attention(q, k, v, out, selected[0], layer, scale, sinks)
        return out[..., :v_dim].unsqueeze(0), None
    torch.ops.pb_kv.paged_attention(
        q, k, v, out, layer, scale, sliding_window or -1, float(softcap or 0.0), sinks, getattr(module, "pb_chunk_size", 0),
        getattr(module, "pb_alibi_slopes", None),  # ALiBi modules swapped by attention_swaps
    )
    return out[..., :v_dim].unsqueeze(0), None


def register_attention() -> str:
    """Register ``pb_paged`` with transformers' AttentionInterface (idempotent); returns the name."""
    transformers_module().AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION


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
    see :mod:`piecewise_backend.hf.adapter`. Mixture-of-experts layers are switched to a sync-free
    implementation; the cache layout is read from the attention modules by a probe forward.
    """
    transformers = transformers_module()
    if not isinstance(model, transformers.PreTrainedModel):
        raise TypeError(f"adapt() takes a transformers PreTrainedModel, got {type(model).__name__}")
    name = type(model).__name__
    if getattr(model.config, "is_encoder_decoder", False) or not model.can_generate():
        raise ValueError(f"{name} is not a decoder-only causal LM; adapt() serves those only")
    settable = model._can_set_attn_implementation()
    if not settable and not attention_swaps.swappable(model):
        raise ValueError(attention_swaps.unswappable_reason(model, ATTN_IMPLEMENTATION))
    reason = refusal(model)
    if reason is None:
        graph_safe_experts(model)
        attention_swaps.swap(model, ATTN_IMPLEMENTATION)  # modules outside the AttentionInterface, if any
        position_swaps.swap(model)  # positional embeddings that take no position_ids from their decoder
        index_dim = indexed.route(model)  # before the probe, which runs the indexers
        try:
            result = probe(model.eval())
        except Exception as e:  # e.g. a forward that needs more than token ids (embeddings, shared K/V states)
            attention_swaps.restore(model)
            position_swaps.restore(model)
            raise ValueError(f"{name} fails on a plain token-id forward ({type(e).__name__}: {e}); adapt() gives it nothing else") from e
        breaks = install_host_breaks(model, result) if result.layers else []  # a host read: a break, not a refusal
        reason = layout_refusal(name, result)
    if reason is not None:
        attention_swaps.restore(model)
        position_swaps.restore(model)
        raise ValueError(reason)
    drop_self_assignments(result.self_assigned)  # Dynamo would end a graph at each (ctrl's pos_encoding)
    kv_layers = result.kv_layers()
    chunked = chunked_layers(model)
    sites = result.call_site_modules()
    for layer, layout in result.layers.items():
        layout.module.pb_head_dim = result.head_dim
        layout.module.pb_kv_repeat = result.kv_shape()[1] // layout.kv_heads
        layout.module.pb_kv_layer = kv_layers[layer]
        layout.module.pb_chunk_size = chunked.get(layout.layer, 0)
        if sites is not None:
            layout.module.pb_call_sites = sites
    for _, indexer in indexed.indexers(model):
        indexer.pb_kv_layer = kv_layers[indexer.layer_idx]
    specs = mixers.specs(result.state_layers)
    keys = [(s.layer, s.kind) for s in specs]
    mixers.route(result.state_layers, lambda layer, kind: keys.index((layer, kind)))
    register_attention()
    if settable:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return own_code(TokensFirst)(model.eval(), result.kv_shape(), breaks, specs, index_dim, sites)


def chunked_layers(model: torch.nn.Module) -> dict[int, int]:
    """``{layer: attention_chunk_size}`` of the layers ``layer_types`` marks ``chunked_attention`` (llama4)."""
    text = model.config.get_text_config()
    chunk = getattr(text, "attention_chunk_size", None) or 0
    kinds = getattr(text, "layer_types", None) or ()
    return {i: chunk for i, kind in enumerate(kinds) if kind == "chunked_attention" and chunk}


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


class HFEngine(Engine):
    """Continuous batching of a HF causal LM: :class:`~piecewise_backend.serve.Engine` over :func:`adapt`.

    What only a transformers model has is here: the refusals of the probe (before the model is
    touched), the cache layout read from its attention modules, its host-reading modules as break
    points (no FULL graphs then), and its ``generation_config.eos_token_id`` as the default stop
    token. ``lazy_capture=True`` serves from the first call (a step without a graph runs eagerly) and
    :meth:`capture_idle` captures what traffic asked for; ``max_num_batched_tokens`` bounds every
    step's tokens (default: the largest capture size), longer prompts are prefilled in chunks;
    ``graph_memory_budget`` bounds the bytes the engine's graphs add to the graph pool.
    """

    @takes_engine_args(exclude=MODEL_EOS)
    def __init__(
        self, model: torch.nn.Module, config: CompilationConfig, *, args: EngineArgs | None = None, **engine_kwargs: Any,
    ):
        """The engine arguments as :class:`~piecewise_backend.serve.Engine`'s, but ``eos_token_id``: the
        default stop token is the model's ``generation_config.eos_token_id``."""
        # every argument is checked before adapt, which changes the model
        args = engine_args("HFEngine", args, engine_kwargs, exclude=MODEL_EOS)
        check_config(config)
        # tensor parallel: every rank must build the same engine (the same graphs, the same collectives)
        check_engine_agreement({"model": type(model).__name__, "config": config, **dataclasses.asdict(args)})
        if is_tensor_parallel(model):  # loaded with tp_plan: plain local shards and explicit collectives
            why = composition_refusal(model, lazy_capture=args.lazy_capture)
            if why is not None:
                raise ValueError(why)
            localize(model)
        vocab_size = check_hf_model(model, config, args.max_model_len)
        args.check_model(model)
        adapted = adapt(model)
        main = ModelRunner(adapted, no_full_graphs(config, adapted.host_breaks), args=args,
                           kv_layout=KVLayout(*kv_shape(adapted), adapted.indexer_dim), state_specs=adapted.state_specs)
        #: the HF model (adapted in place); ``.model_runners[0].model`` is the adapted one the engine compiled
        self.model = model
        self._start(args, [main], Decode(main), main.cache, main.states, vocab_size=vocab_size, eos_token_id=frozenset())

    def default_eos(self) -> Any:
        """The model's ``generation_config.eos_token_id``, as ``model.generate`` uses by default."""
        return generation_eos(self.model)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, config: CompilationConfig, **kwargs: Any) -> HFEngine:
        """An engine over the causal LM a local ``save_pretrained`` folder holds (nothing is downloaded).

        ``kwargs`` that :class:`HFEngine` takes go to it; the others (``dtype``, ``device_map``, ...)
        to transformers' ``AutoModelForCausalLM.from_pretrained``, with ``local_files_only=True``.
        """
        folder = os.fspath(path)
        if not os.path.isfile(os.path.join(folder, "config.json")):
            raise ValueError(
                f"HFEngine.from_pretrained: {folder!r} is not a folder written by save_pretrained (no config.json "
                "there); it loads local checkpoints only: download one first (huggingface_hub.snapshot_download)"
            )
        engine_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in _ENGINE_KWARGS}
        kwargs["local_files_only"] = True
        if kwargs.get("tp_plan") is not None:
            overrides = _join_tensor_parallel(folder)
            if overrides and kwargs["tp_plan"] == "auto":  # fewer KV heads than ranks: K/V loaded whole
                kwargs["tp_plan"] = overrides
        model = transformers_module().AutoModelForCausalLM.from_pretrained(folder, **kwargs)
        return cls(model.eval(), config, **engine_kwargs)


def _join_tensor_parallel(folder: str) -> dict[str, str]:
    """Before a ``tp_plan`` load: join torchrun's process group (or refuse without one), check the heads divide;
    returns the plan overrides that replicate K/V projections when the ranks outnumber the KV heads."""
    import torch.distributed as dist

    if not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
            raise ValueError(
                "HFEngine.from_pretrained(tp_plan=...): no process group is initialized and this process was not "
                "started by torchrun (no RANK/WORLD_SIZE): run it under `python -m torch.distributed.run "
                "--nproc-per-node N ...` or call piecewise_backend.parallel.init_tensor_parallel() first"
            )
        from ..runner.agreement import init_tensor_parallel

        init_tensor_parallel()
    config = transformers_module().AutoConfig.from_pretrained(folder, local_files_only=True)
    check_heads(config, dist.get_world_size())
    return replicated_kv_plan(config, dist.get_world_size())


def generation_eos(model: Any) -> Any:
    """The stop token(s) ``model.generate`` uses by default: ``model.generation_config.eos_token_id`` (None without one)."""
    return getattr(getattr(model, "generation_config", None), "eos_token_id", None)


def check_hf_model(model: Any, config: CompilationConfig, max_model_len: int) -> int:
    """Refusals of a HF model before it is adapted (its position limit, a length it cannot serve);
    returns its vocabulary size."""
    text = model.config.get_text_config()
    limit = getattr(text, "max_position_embeddings", None)
    if isinstance(limit, int) and 0 < limit < max_model_len:  # xlnet's -1: no limit
        raise ValueError(
            f"max_model_len={max_model_len} exceeds {type(model).__name__}'s max_position_embeddings={limit}: "
            f"use max_model_len <= {limit}"
        )
    why = length_refusal(model, max([max_model_len, *config.sizes]))
    if why is not None:
        raise ValueError(why)
    return text.vocab_size


#: Keyword arguments of HFEngine (the rest of from_pretrained's go to transformers): its engine arguments.
_ENGINE_KWARGS = frozenset({*engine_keywords(exclude=MODEL_EOS), "args"})
