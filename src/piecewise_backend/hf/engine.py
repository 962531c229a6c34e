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

* :func:`~.adaptation.adapt` (:mod:`.adaptation`) applies the adaptation mechanisms in one rollback and
  wraps the model in :class:`~.adaptation.TokensFirst`, the runner's layout; the ``pb_paged`` attention
  is :mod:`.paged_attention`'s. Both are named here too, as documented.
* :class:`HFEngine` is :class:`piecewise_backend.serve.Engine` over the adapted model: the serving
  loop (chunked prefill, preemption, sampling, streaming, the online API, lazy capture) is
  serve's; steps with prompt tokens replay PIECEWISE graphs, pure decode steps replay one FULL graph.
  An image-text-to-text model (llava, qwen2-vl, ...) is served with images in its requests
  (:mod:`.multimodal`: its text model adapted, its encoder as graphs, :mod:`.encoder_graphs`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import torch

from ..config import CompilationConfig
from ..serve.arguments import MODEL_EOS, EngineArgs, check_config, engine_args, engine_keywords, takes_engine_args
from ..context import BatchDescriptor
from ..modes import CUDAGraphMode
from ..runner import CaptureReport
from ..serve.engine import Engine, no_images
from ..serve.model_runner import Decode, KVLayout, ModelRunner
from ..serve.token_rules import RULE_FIELDS, TokenRules
from .adaptation import TokensFirst, adapt, adapting, kv_shape
from .adapter import length_refusal
from .modality import is_multimodal
from . import multimodal
from .host_breaks import host_read_downgrades, no_full_graphs
from .paged_attention import ATTN_IMPLEMENTATION, chunked_layers, paged_attention_forward, register_attention
from .tensor_parallel import (
    check_engine_agreement,
    check_heads,
    composition_refusal,
    is_tensor_parallel,
    localize,
    replicated_kv_plan,
    shards,
    tp_load_kwargs,
)
from .transformers_lib import transformers_module

__all__ = [  # adapt and the paged attention live in .adaptation and .paged_attention; named here as documented
    "ATTN_IMPLEMENTATION", "HFEngine", "TokensFirst", "adapt", "check_hf_model", "chunked_layers", "generation_eos",
    "generation_rules", "kv_shape", "paged_attention_forward", "register_attention",
]

logger = logging.getLogger(__name__)


class HFEngine(Engine):
    """Continuous batching of a HF causal LM: :class:`~piecewise_backend.serve.Engine` over :func:`adapt`.

    What only a transformers model has is here: the refusals of the probe (before the model is
    touched), the cache layout read from its attention modules, its host-reading modules as break
    points (no FULL graphs then), and its ``generation_config.eos_token_id`` as the default stop
    token. ``lazy_capture=True`` serves from the first call (a step without a graph runs eagerly) and
    :meth:`capture_idle` captures what traffic asked for; ``max_num_batched_tokens`` bounds every
    step's tokens (default: the largest capture size), longer prompts are prefilled in chunks;
    ``graph_memory_budget`` bounds the bytes the engine's graphs add to the graph pool. An
    image-text-to-text model's requests carry their images as ``mm_inputs`` (docs/engine.md,
    "Image-text-to-text models"); ``encoder_token_budgets`` sizes its encoder graphs.
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
        images = is_multimodal(model)
        if not images:
            no_images(args)
        else:
            why = multimodal.refusal(model, config, args, tensor_parallel=is_tensor_parallel(model))
            if why is not None:
                raise ValueError(why)
        rules = resolve_rules(model, args.token_rules, "HFEngine", vocab_size)
        with adapting(model) as adapted:  # a failure building on it undoes the adaptation
            layout = multimodal.layout(adapted, config, args) if images else adapted
            try:
                main = ModelRunner(layout, no_full_graphs(config, adapted.host_breaks), args=args,
                                   kv_layout=KVLayout(*kv_shape(adapted), adapted.indexer_dim),
                                   state_specs=adapted.state_specs,
                                   downgrades=host_read_downgrades(config, adapted.host_breaks), vocab_size=vocab_size)
            except BaseException:
                if images:
                    layout.restore()
                raise
        #: the HF model (adapted in place); ``.model_runners[0].model`` is the adapted one the engine compiled
        self.model = model
        #: the encoder's graphs over image budgets (None: a text model, or its encoder runs eagerly)
        self.encoder_graphs = (multimodal.build_encoder_graphs(model, config, args.encoder_token_budgets, args.lazy_capture)
                               if images else None)
        step = (multimodal.ImageDecode(main, layout, model, rules, self.encoder_graphs) if images
                else Decode(main, rules))
        self._start(args, [main], step, main.cache, main.states, vocab_size=vocab_size,
                    eos_token_id=frozenset(), token_rules=rules, images=images)
        if images:
            self._loop.multimodal = multimodal.Admit(model)

    @property
    def max_num_batched_tokens(self) -> int:
        """The most tokens a step runs (an image-text-to-text engine: at most its image-token buffers' rows)."""
        return Engine.max_num_batched_tokens.fget(self)  # type: ignore[attr-defined]

    @max_num_batched_tokens.setter
    def max_num_batched_tokens(self, value: int) -> None:
        layout = self.model_runners[0].model
        rows = getattr(layout, "rows", None) if self.encoder_graphs is not None or is_multimodal(self.model) else None
        if rows is not None and isinstance(value, int) and value > rows:
            raise ValueError(f"max_num_batched_tokens={value}: this image-text-to-text engine was built for steps of "
                             f"at most {rows} tokens (its image-token buffers); build it with max_num_batched_tokens="
                             f"{value}")
        Engine.max_num_batched_tokens.fset(self, value)  # type: ignore[attr-defined]

    def capture(self, progress: bool = False) -> CaptureReport:
        """:meth:`Engine.capture`, then the encoder's graphs of every image budget (an image-text-to-text model)."""
        report = super().capture(progress)
        if self.encoder_graphs is not None:
            with torch.inference_mode():
                self.encoder_graphs.capture()
        return report

    def capture_idle(self, max_seconds: float, *, retry_failed: bool = False) -> list[tuple[CUDAGraphMode, BatchDescriptor]]:
        """:meth:`Engine.capture_idle`, then the encoder graphs of the image budgets steps asked for."""
        captured = super().capture_idle(max_seconds, retry_failed=retry_failed)
        if self.encoder_graphs is not None and self.encoder_graphs.demand:
            with self._loop.lock, torch.inference_mode():
                captured += [(CUDAGraphMode.FULL, d) for d in self.encoder_graphs.capture(demanded=True)]
        return captured

    def estimate_capture_memory(self) -> int:
        """:meth:`Engine.estimate_capture_memory` plus what the encoder's graphs add."""
        extra = 0
        if self.encoder_graphs is not None:
            with torch.inference_mode():
                extra = self.encoder_graphs.estimate_memory()
        return super().estimate_capture_memory() + extra

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
        plan, given = kwargs.pop("tp_plan", None), kwargs.pop("distributed_config", None)
        if plan is not None and given is not None:
            raise ValueError("HFEngine.from_pretrained: pass tp_plan= or distributed_config=DistributedConfig(tp_plan=...), "
                             "not both")
        if plan is not None or shards(given):
            overrides = _join_tensor_parallel(folder)
            plan = plan if plan is not None else given.tp_plan
            if overrides and plan in ("auto", None):  # fewer KV heads than ranks: K/V loaded whole
                plan = overrides
            kwargs.update(tp_load_kwargs(plan, given))
        elif given is not None:
            kwargs["distributed_config"] = given
        model = auto_class(folder).from_pretrained(folder, **kwargs)
        return cls(model.eval(), config, **engine_kwargs)


def auto_class(folder: str) -> Any:
    """The transformers auto class that loads the checkpoint in ``folder``: ``AutoModelForImageTextToText`` for
    an image-text-to-text model's config, else ``AutoModelForCausalLM``."""
    transformers = transformers_module()
    config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    if type(config) in transformers.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING and "vision_config" in getattr(
            type(config), "sub_configs", {}):
        return transformers.AutoModelForImageTextToText
    return transformers.AutoModelForCausalLM


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


#: generation_config settings the engines do not apply, with the value that means "off".
UNAPPLIED = {"do_sample": False, "num_beams": 1, "guidance_scale": 1, "sequence_bias": None,
             "encoder_repetition_penalty": 1.0, "encoder_no_repeat_ngram_size": 0, "remove_invalid_values": False,
             "exponential_decay_length_penalty": None, "renormalize_logits": False, "penalty_alpha": None,
             "watermarking_config": None}


def generation_rules(model: Any) -> tuple[TokenRules, tuple[str, ...]]:
    """The per-token settings of ``model.generation_config`` (what ``model.generate`` applies to each
    step's scores by default), as :class:`~piecewise_backend.serve.TokenRules`, and those of its
    settings no engine applies, as ``name=value`` (``do_sample=True``: the engine samples as its
    ``sampling=`` says, greedy by default)."""
    config = getattr(model, "generation_config", None)
    if config is None:
        return TokenRules(), ()
    given = {f: getattr(config, f, None) for f in RULE_FIELDS}
    given["bad_words_ids"] = given["bad_words_ids"] or ()
    for name in ("forced_eos_token_id", "suppress_tokens", "begin_suppress_tokens"):
        given[name] = given[name] if given[name] is not None else ()
    unapplied = tuple(f"{name}={value!r}" for name, off in UNAPPLIED.items()
                      if (value := getattr(config, name, None)) is not None and value != off)
    return TokenRules(**given), unapplied


def resolve_rules(model: Any, given: TokenRules | None, engine: str, vocab_size: int, applies: bool = True) -> TokenRules:
    """An engine's rules: ``given`` (``token_rules=``), else the model's :func:`generation_rules`; checked
    against the vocabulary. One warning names the model's settings the engine leaves out (all of them
    when it applies none: ``applies=False``)."""
    rules, unapplied = generation_rules(model)
    if given is not None:
        rules, unapplied = given, ()
    elif not applies:
        unapplied = (*(f"{n}={getattr(rules, n)!r}" for n in rules.names()), *unapplied)
        rules = TokenRules()
    if unapplied:
        logger.warning("%s does not apply these generation_config settings of %s: %s (model.generate does; tokens "
                       "may differ from its)", engine, type(model).__name__, ", ".join(unapplied))
    rules.check(vocab_size)
    return rules


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
