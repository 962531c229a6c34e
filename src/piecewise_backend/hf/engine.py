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
* :class:`HFEngine` owns the cache and the runner and runs a continuous-batching greedy loop:
  steps with prompt tokens replay PIECEWISE graphs, pure decode steps replay one FULL graph.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ..backend.compiler import make_backend
from ..config import CompilationConfig
from ..kv import cache as kv
from ..modes import CUDAGraphMode
from ..runner.graph_runner import CaptureReport, GraphRunner, StaticInput
from .adapter import graph_safe_experts, layout_refusal, probe, refusal
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
    torch.ops.pb_kv.paged_attention(q, k, v, out, module.layer_idx, scale, sliding_window or -1, float(softcap or 0.0), sinks)
    return out[..., :v_dim].unsqueeze(0), None


def register_attention() -> str:
    """Register ``pb_paged`` with transformers' AttentionInterface (idempotent); returns the name."""
    _transformers().AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION


class TokensFirst(torch.nn.Module):
    """``(input_ids (tokens,), position_ids (tokens,)) -> logits (tokens, vocab)`` around a HF causal LM."""

    def __init__(self, model: torch.nn.Module, kv_shape: tuple[int, int, int] | None = None, host_breaks: list[str] | None = None):
        super().__init__()
        self.model = model
        #: (layers, kv_heads, head_dim) of the cache the model needs (set by :func:`adapt`)
        self.kv_shape = kv_shape
        #: modules that read the host, run as break points (:mod:`~piecewise_backend.hf.host_breaks`)
        self.host_breaks = host_breaks or []

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
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
    for layout in result.layers.values():
        layout.module.pb_head_dim = result.head_dim
        layout.module.pb_kv_repeat = result.kv_shape()[1] // layout.kv_heads
    model.set_attn_implementation(register_attention())
    return TokensFirst(model.eval(), result.kv_shape(), breaks)


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
        if not result.layers:
            raise ValueError(f"{type(model_or_config).__name__} calls no attention through transformers' AttentionInterface")
        return result.kv_shape()
    config = model_or_config.get_text_config() if hasattr(model_or_config, "get_text_config") else model_or_config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, kv_heads, head_dim


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """What one engine step ran: token and request counts, whether it was pure decode, the mode."""

    step: int
    num_tokens: int
    num_reqs: int
    uniform_decode: bool
    mode: CUDAGraphMode


class HFEngine:
    """Greedy continuous batching of a HF causal LM on a GraphRunner with a paged KV cache."""

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
    ):
        self.model = model
        limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        if isinstance(limit, int) and max_model_len > limit:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={limit}: "
                f"use max_model_len <= {limit}"
            )
        self.vocab_size: int = model.config.get_text_config().vocab_size
        adapted = adapt(model)
        config = no_full_graphs(config, adapted.host_breaks)
        layers, kv_heads, head_dim = kv_shape(adapted)
        param = next(model.parameters())
        self.cache = kv.PagedKVCache(
            layers, kv_heads, head_dim, block_size=block_size, max_model_len=max_model_len,
            num_blocks=num_blocks or max_num_reqs * -(-max_model_len // block_size),
            dtype=param.dtype, device=param.device, attention_backend=attention_backend,
        )
        self.attention_backend = self.cache.attention_backend  # e.g. "bounded", "varlen (then bounded)"
        self.backend = make_backend(config)  # .splits: the split of every graph Dynamo compiled
        compiled = torch.compile(adapted, backend=self.backend)
        self.runner = GraphRunner(
            compiled, config, [StaticInput("input_ids"), *self.cache.static_inputs()],
            model_kwargs=["input_ids", kv.POSITIONS], context_fn=self.cache.context_fn,
            max_num_reqs=max_num_reqs, device=param.device,
            attention_support=self.cache.attention_graph_support, attention_backend=self.attention_backend,
        )
        self.max_num_reqs = max_num_reqs
        self.max_step_tokens = self.runner.dispatcher.max_size

    def capture(self, progress: bool = False) -> CaptureReport:
        with torch.inference_mode():
            return self.runner.capture(progress=progress)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int | Sequence[int],
        *,
        eos_token_id: int | None = None,
        on_step: Callable[[StepInfo], None] | None = None,
    ) -> list[list[int]]:
        """Greedy completions of ``prompts`` (token ids, without the prompt), in order.

        Each step decodes one token for every running request and admits waiting prompts whole
        while they fit ``max_num_reqs`` and the largest captured size.
        """
        budgets = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
        if len(budgets) != len(prompts) or any(b < 1 for b in budgets):
            raise ValueError(f"max_new_tokens must be a positive int or one per prompt ({len(prompts)}), got {max_new_tokens!r}")
        for i, p in enumerate(prompts):
            if not p or len(p) + budgets[i] > self.cache.max_model_len:
                raise ValueError(
                    f"prompt {i}: {len(p)} tokens + {budgets[i]} new must be in 1..max_model_len={self.cache.max_model_len}"
                )
            bad = [t for t in p if not 0 <= t < self.vocab_size]
            if bad:  # an embedding lookup out of range: IndexError here, a device-side assert inside a CUDA graph
                raise ValueError(f"prompt {i}: token id {bad[0]} is outside the vocabulary (ids 0..{self.vocab_size - 1})")
        outputs: list[list[int]] = [[] for _ in prompts]
        waiting, running, step = list(range(len(prompts))), [], 0
        try:
            with torch.inference_mode():
                while waiting or running:
                    info = self._step(step, prompts, outputs, budgets, waiting, running, eos_token_id)
                    if on_step is not None:
                        on_step(info)
                    step += 1
        finally:  # an error mid-way must not leak the blocks of the requests still running
            for r in running:
                if r in self.cache.tables:
                    self.cache.free(r)
        return outputs

    def _step(
        self,
        step: int,
        prompts: Sequence[Sequence[int]],
        outputs: list[list[int]],
        budgets: list[int],
        waiting: list[int],
        running: list[int],
        eos_token_id: int | None,
    ) -> StepInfo:
        """Schedule, run and sample one step; updates ``outputs``, ``waiting`` and ``running``."""
        chunks = [(r, len(prompts[r]) + len(outputs[r]) - 1, 1) for r in running]
        tokens = [outputs[r][-1] for r in running]
        while waiting and len(running) < self.max_num_reqs:
            r = waiting[0]
            if chunks and len(tokens) + len(prompts[r]) > self.max_step_tokens:
                break
            chunks.append((r, 0, len(prompts[r])))
            tokens += prompts[r]
            running.append(waiting.pop(0))
        decode = all(n == 1 for _, _, n in chunks)  # one query token per request: FULL-graph shaped
        meta = self.cache.step_inputs(chunks)
        ids = torch.tensor(tokens, dtype=torch.long, device=self.cache.device)
        logits = self.runner.run(uniform_decode=decode, num_reqs=len(chunks) if decode else None, input_ids=ids, **meta)
        last = torch.tensor(_ends(chunks), device=logits.device)
        for (r, _, _), tok in zip(chunks, logits[last].argmax(-1).tolist()):
            outputs[r].append(tok)
            if len(outputs[r]) >= budgets[r] or tok == eos_token_id:
                running.remove(r)
                self.cache.free(r)
        return StepInfo(step, len(tokens), len(chunks), decode, self.runner.last_mode)


def _ends(chunks: Sequence[tuple[Any, int, int]]) -> list[int]:
    """Row of each chunk's last token in the step's token layout."""
    ends, total = [], 0
    for _, _, n in chunks:
        total += n
        ends.append(total - 1)
    return ends
