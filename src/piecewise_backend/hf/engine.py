"""Serve a stock Hugging Face decoder-only model on GraphRunner with a paged KV cache.

Needs ``transformers`` (``pip install piecewise_backend[hf]``); importing ``piecewise_backend``
alone never imports it. Works for decoder-only models whose attention goes through
transformers' ``AttentionInterface`` (Llama, Qwen, Mistral, Mixtral, DeepSeek V2/V3, gpt-oss,
Gemma 2/3, ...); :func:`adapt` refuses, naming the reason, every model it would serve wrongly
(:mod:`piecewise_backend.hf.adapter`; docs/models.md lists every type's outcome):

* :func:`register_attention` adds ``pb_paged`` to the interface: HF's q/k/v (after RoPE) go to
  ``pb_kv::paged_attention``, which reads the step's metadata from the forward context. HF builds
  no mask and no cache for an implementation it does not know masks for, and ``use_cache=False``.
* :func:`adapt` reads the cache layout from the attention modules (a probe forward), pads
  narrower head dims and repeats KV heads of layers with fewer, and switches MoE experts to a
  sync-free implementation.
* :class:`TokensFirst` is the runner's layout: all tokens of a step as one row
  (``input_ids[None]``), with ``position_ids`` per token, so RoPE sees each token's own position.
* :class:`HFEngine` owns the cache and the runner and serves requests with continuous batching
  (:mod:`.serving`: chunked prefill, preemption, sampling, streaming, the online API): steps with
  prompt tokens replay PIECEWISE graphs, pure decode steps replay one FULL graph; with
  ``lazy_capture=True`` it serves before capturing and :meth:`HFEngine.capture_idle` captures later.
"""

from __future__ import annotations

import functools
import os
import types
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ..backend.compiler import make_backend
from ..config import CompilationConfig
from ..context import BatchDescriptor
from ..kv import cache as kv
from ..modes import AttentionGraphSupport, CUDAGraphMode
from ..runner.graph_runner import CaptureReport, GraphRunner, StaticInput
from ..state.cache import StateCache, StateSpec
from . import mixers
from .adapter import graph_safe_experts, layout_refusal, length_refusal, probe, refusal
from .arguments import check_attention_backend, check_generate, eos_ids, generation_eos
from .buffers import drop_self_assignments
from .sampling import SamplingParams, per_request
from .serving import RequestOutput, ServingLoop, StepInfo
from .host_breaks import install_host_breaks, no_full_graphs
from .tiny import TINY, _transformers, tiny_random_model  # noqa: F401 (TINY, tiny_random_model: public here)

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
    layer = getattr(module, "pb_kv_layer", module.layer_idx)  # the cache holds attention layers only
    torch.ops.pb_kv.paged_attention(
        q, k, v, out, layer, scale, sliding_window or -1, float(softcap or 0.0), sinks, getattr(module, "pb_chunk_size", 0)
    )
    return out[..., :v_dim].unsqueeze(0), None


def register_attention() -> str:
    """Register ``pb_paged`` with transformers' AttentionInterface (idempotent); returns the name."""
    _transformers().AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION


class TokensFirst(torch.nn.Module):
    """``(input_ids (tokens,), position_ids (tokens,)) -> logits (tokens, vocab)`` around a HF causal LM."""

    def __init__(
        self, model: torch.nn.Module, kv_shape: tuple[int, int, int] | None = None, host_breaks: list[str] | None = None,
        state_specs: Sequence[StateSpec] = (),
    ):
        super().__init__()
        self.model = model
        #: (attention layers, kv_heads, head_dim) of the cache the model needs (set by :func:`adapt`)
        self.kv_shape = kv_shape
        #: modules that read the host, run as break points (:mod:`~piecewise_backend.hf.host_breaks`)
        self.host_breaks = host_breaks or []
        #: the states its state layers keep per request, in the order of the state cache (set by :func:`adapt`)
        self.state_specs = list(state_specs)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        # A step has >= 1 token: with the unbacked token count known non-zero, a model's
        # ``reshape(..., -1, d)`` needs no data-dependent guard (qwen3_next broke its graph there).
        torch._check(input_ids.shape[0] >= 1)
        return self.model(input_ids=input_ids[None], position_ids=position_ids[None], use_cache=False).logits[0]


def adapt(model: torch.nn.Module) -> TokensFirst:
    """Switch ``model`` to paged attention and wrap it in the runner's layout (the model is modified).

    Refuses (``ValueError`` naming the reason) any model the paged attention would serve wrongly:
    see :mod:`piecewise_backend.hf.adapter`. Mixture-of-experts layers are switched to a sync-free
    implementation; the cache layout is read from the attention modules by a probe forward.
    """
    transformers = _transformers()
    if not isinstance(model, transformers.PreTrainedModel):
        raise TypeError(f"adapt() takes a transformers PreTrainedModel, got {type(model).__name__}")
    name = type(model).__name__
    if getattr(model.config, "is_encoder_decoder", False) or not model.can_generate():
        raise ValueError(f"{name} is not a decoder-only causal LM; adapt() serves those only")
    if not model._can_set_attn_implementation():
        raise ValueError(f"{name} does not route attention through transformers' AttentionInterface, so {ATTN_IMPLEMENTATION} cannot replace it")
    reason = refusal(model)
    if reason is None:
        graph_safe_experts(model)
        try:
            result = probe(model.eval())
        except Exception as e:  # e.g. a forward that needs more than token ids (embeddings, shared K/V states)
            raise ValueError(f"{name} fails on a plain token-id forward ({type(e).__name__}: {e}); adapt() gives it nothing else") from e
        breaks = install_host_breaks(model, result) if result.layers else []  # a host read: a break, not a refusal
        reason = layout_refusal(name, result)
    if reason is not None:
        raise ValueError(reason)
    drop_self_assignments(result.self_assigned)  # Dynamo would end a graph at each (ctrl's pos_encoding)
    kv_layers = result.kv_layers()
    chunked = chunked_layers(model)
    for layer, layout in result.layers.items():
        layout.module.pb_head_dim = result.head_dim
        layout.module.pb_kv_repeat = result.kv_shape()[1] // layout.kv_heads
        layout.module.pb_kv_layer = kv_layers[layer]
        layout.module.pb_chunk_size = chunked.get(layer, 0)
    specs = mixers.specs(result.state_layers)
    keys = [(s.layer, s.kind) for s in specs]
    mixers.route(result.state_layers, lambda layer, kind: keys.index((layer, kind)))
    model.set_attn_implementation(register_attention())
    return _own_code(TokensFirst)(model.eval(), result.kv_shape(), breaks, specs)


def chunked_layers(model: torch.nn.Module) -> dict[int, int]:
    """``{layer: attention_chunk_size}`` of the layers ``layer_types`` marks ``chunked_attention`` (llama4)."""
    text = model.config.get_text_config()
    chunk = getattr(text, "attention_chunk_size", None) or 0
    kinds = getattr(text, "layer_types", None) or ()
    return {i: chunk for i, kind in enumerate(kinds) if kind == "chunked_attention" and chunk}


def _own_code(cls: type[TokensFirst]) -> type[TokensFirst]:
    """A subclass of ``cls`` whose ``forward`` has a code object of its own.

    Dynamo keeps compiled code per code object and, past ``recompile_limit`` (8) entries, runs the
    frame uncompiled: with one shared ``forward`` the 5th engine of a process was served eagerly,
    its PIECEWISE graphs holding attention whole. A copy of the code per adapted model keeps each
    engine's entries apart (and frees them with the engine).
    """
    base = cls.forward
    forward = types.FunctionType(base.__code__.replace(), base.__globals__, base.__name__, base.__defaults__,
                                 base.__closure__)
    functools.update_wrapper(forward, base)
    del forward.__wrapped__  # a wrapper's __wrapped__ would send inspect (and Dynamo's tracing) to the shared code
    return type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__, "__qualname__": cls.__qualname__})


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


class HFEngine:
    """Continuous batching of a HF causal LM on a GraphRunner with a paged KV cache.

    ``lazy_capture=True`` serves from the first call (a step without a graph runs eagerly) and
    :meth:`capture_idle` captures what traffic asked for; ``max_num_batched_tokens`` bounds every
    step's tokens (default: the largest capture size), longer prompts are prefilled in chunks;
    ``graph_memory_budget`` bounds the bytes the engine's graphs add to the graph pool.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: CompilationConfig,
        *,
        max_num_reqs: int = 4,
        max_model_len: int = 128,
        block_size: int = 16,
        num_blocks: int | None = None,
        attention_backend: str = "auto",
        lazy_capture: bool = False,
        max_num_batched_tokens: int | None = None,
        graph_memory_budget: int | None = None,
    ):
        _check_tokens_budget(max_num_batched_tokens)
        self.model = model
        limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        if isinstance(limit, int) and max_model_len > limit:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={limit}: "
                f"use max_model_len <= {limit}"
            )
        self.vocab_size: int = model.config.get_text_config().vocab_size
        why = length_refusal(model, max(max_model_len, *config.sizes))
        if why is not None:
            raise ValueError(why)
        param = next(model.parameters())
        # before adapt, which changes the model
        check_attention_backend(attention_backend, device=param.device, dtype=param.dtype, block_size=block_size)
        adapted = adapt(model)
        config = no_full_graphs(config, adapted.host_breaks)
        layers, kv_heads, head_dim = kv_shape(adapted)
        self.cache = kv.PagedKVCache(
            layers, kv_heads, head_dim, block_size=block_size, max_model_len=max_model_len,
            num_blocks=num_blocks or max_num_reqs * -(-max_model_len // block_size),
            dtype=param.dtype, device=param.device, attention_backend=attention_backend,
        )
        self.attention_backend = self.cache.attention_backend  # e.g. "bounded", "varlen (then bounded)"
        #: one slot per running request for the state layers' conv and recurrent states (None: no state layer)
        self.states = StateCache(adapted.state_specs, num_slots=max_num_reqs, device=param.device) if adapted.state_specs else None
        self.backend = make_backend(config)  # .splits: the split of every graph Dynamo compiled
        compiled = torch.compile(adapted, backend=self.backend)
        inputs, context_fn = [StaticInput("input_ids"), *self.cache.static_inputs()], self.cache.context_fn
        support = self.cache.attention_graph_support
        if self.states is not None:  # FULL graphs hold state updates of one token per request only
            states = self.states
            inputs.extend(states.static_inputs())
            context_fn = lambda views: {**self.cache.context_fn(views), **states.context_fn(views)}  # noqa: E731
            support = min(support, AttentionGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE)
        self.runner = GraphRunner(
            compiled, config, inputs, model_kwargs=["input_ids", kv.POSITIONS], context_fn=context_fn,
            max_num_reqs=max_num_reqs, device=param.device, attention_support=support,
            attention_backend=self.attention_backend, lazy_capture=lazy_capture, graph_memory_budget=graph_memory_budget,
        )
        self.max_num_reqs = max_num_reqs
        self.max_step_tokens = self.runner.dispatcher.max_size
        budget = max_num_batched_tokens or self.max_step_tokens or max_model_len  # NONE mode: a whole prompt
        self._loop = ServingLoop(self.runner, self.cache, self.vocab_size, max_num_reqs, budget, self.states)

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
        model = _transformers().AutoModelForCausalLM.from_pretrained(folder, **kwargs)
        return cls(model.eval(), config, **engine_kwargs)

    @property
    def max_num_batched_tokens(self) -> int:
        """The most tokens a step runs; a longer prompt is prefilled in chunks over several steps."""
        return self._loop.scheduler.max_num_batched_tokens

    @max_num_batched_tokens.setter
    def max_num_batched_tokens(self, value: int) -> None:
        _check_tokens_budget(value)
        self._loop.scheduler.max_num_batched_tokens = value

    def capture(self, progress: bool = False) -> CaptureReport:
        """Capture every descriptor (within ``graph_memory_budget`` when set), under inference mode."""
        with torch.inference_mode():
            return self.runner.capture(progress=progress)

    def capture_idle(self, max_seconds: float) -> list[tuple[CUDAGraphMode, BatchDescriptor]]:
        """Capture, within ``max_seconds`` and ``graph_memory_budget``, the graphs steps ran without;
        returns the ``(mode, descriptor)`` pairs captured. Call it between steps (when idle), on the
        thread that steps: a capture must never overlap a step (see :mod:`.serving`)."""
        with self._loop.lock, torch.inference_mode():
            return self.runner.capture_idle(max_seconds)

    # ------------------------------------------------------------------ the online API

    def add_request(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        *,
        sampling: SamplingParams | None = None,
        stop_token_ids: int | Sequence[int] | None = None,
        request_id: Hashable | None = None,
        on_token: Callable[[Hashable, int], None] | None = None,
    ) -> Hashable:
        """Queue a request while others run (any thread); returns its id (default: the next free int).

        It joins the next step that has room. ``stop_token_ids`` end it (the stop token is kept), as
        :meth:`generate`'s ``eos_token_id``: an int or a list of ints (``[]``: none); None: the model's
        ``generation_config.eos_token_id``. ``on_token(request_id, token_id)`` is called as each of
        its tokens is produced.
        """
        stops = eos_ids(stop_token_ids, generation_eos(self.model), vocab_size=self.vocab_size, name="stop_token_ids")
        return self._loop.add(
            prompt, max_new_tokens, sampling=sampling, stop_token_ids=sorted(stops), request_id=request_id,
            on_token=on_token,
        )

    def cancel_request(self, request_id: Hashable) -> bool:
        """Stop a request and free its KV blocks at once; False when no such request is unfinished.
        The next :meth:`step` (or :meth:`results`) reports it with ``finish_reason="cancelled"``."""
        return self._loop.cancel(request_id)

    def step(self) -> list[RequestOutput]:
        """Run one step of the added requests; returns those that finished since the last call."""
        with torch.inference_mode():
            return self._loop.step()

    def results(self) -> Iterator[RequestOutput]:
        """Step until every added request has finished, yielding each one as it finishes."""
        yield from _inference(self._loop.results())

    def has_unfinished_requests(self) -> bool:
        return self._loop.has_unfinished()

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int | Sequence[int],
        *,
        eos_token_id: int | Sequence[int] | None = None,
        sampling: SamplingParams | Sequence[SamplingParams | None] | None = None,
        on_token: Callable[[int, int], None] | None = None,
        on_step: Callable[[StepInfo], None] | None = None,
    ) -> list[list[int]]:
        """Completions of ``prompts`` (token ids, without the prompt), in order; greedy unless ``sampling``.

        ``sampling``: one :class:`SamplingParams` for all, or one per prompt (None: greedy).
        ``on_token(request_index, token_id)`` is called as each token is produced, in order;
        ``on_step`` gets a :class:`StepInfo` per step. Every step schedules the running requests'
        decode tokens first, then prompt chunks, within ``max_num_batched_tokens`` and
        ``max_num_reqs``; when KV blocks run out the newest requests are preempted and recomputed.
        A request stops at its budget or at a token of ``eos_token_id`` (an int or a list of ints;
        ``[]``: none; None: the model's ``generation_config.eos_token_id``, as ``model.generate``).
        """
        args = check_generate(prompts, max_new_tokens, vocab_size=self.vocab_size, max_model_len=self.cache.max_model_len,
                              eos_token_id=eos_token_id, default_eos=generation_eos(self.model))
        prompts, budgets = args.prompts, args.budgets
        params = per_request(sampling, len(prompts))
        if on_token is not None and not callable(on_token):
            raise TypeError(f"on_token must be callable(request_index, token_id), got {type(on_token).__name__}")
        loop = self._loop
        if loop.has_unfinished():
            raise RuntimeError(
                "generate() serves a batch of its own, but requests added with add_request() are unfinished: "
                "iterate results() or cancel_request() them first"
            )
        stops = sorted(args.eos)
        requests = []
        loop.steps = 0
        try:
            with torch.inference_mode():
                for i, p in enumerate(prompts):
                    requests.append(loop.add_internal(p, budgets[i], params[i], stops, i, on_token))
                while loop.has_unfinished():
                    info = loop.advance()
                    if on_step is not None:
                        on_step(info)
        finally:  # an error mid-way must not leak the blocks of the requests still running
            loop.cancel_all()
        return [r.output for r in requests]


#: Keyword arguments of HFEngine (the rest of from_pretrained's go to transformers).
_ENGINE_KWARGS = frozenset({
    "max_num_reqs", "max_model_len", "block_size", "num_blocks", "attention_backend", "lazy_capture",
    "max_num_batched_tokens", "graph_memory_budget",
})


def _check_tokens_budget(value: Any) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"max_num_batched_tokens must be None or a positive int (tokens per step), got {value!r}")


def _inference(results: Iterator[RequestOutput]) -> Iterator[RequestOutput]:
    """``results`` with every step (each ``next``) under inference mode, but not the caller's loop body."""
    while True:
        with torch.inference_mode():
            out = next(results, None)
        if out is None:
            return
        yield out
