"""The arguments of the engines, checked in one place for every engine.

:class:`EngineArgs` holds the constructor arguments every engine shares (``max_num_reqs``,
``max_model_len``, ...), each checked by its own name when it is built, before an engine touches
its model; :func:`takes_engine_args` gives an engine's ``__init__(..., args=None, **engine_args)``
the signature its callers see (the fields as keyword-only parameters) and :func:`engine_args` turns
the keywords a call got (or its ``args=EngineArgs(...)``) into one :class:`EngineArgs`. A new
engine argument is one field of :class:`EngineArgs` (with its check in ``__post_init__``).
:meth:`EngineArgs.check_model` checks a model against them (a parameter to take the caches' dtype
and device from, an ``attention_backend`` that can serve that cache, :func:`check_attention_backend`).

:class:`~piecewise_backend.serve.Engine`, :class:`~piecewise_backend.hf.HFEngine` and
:class:`~piecewise_backend.spec.SpecEngine` take the same prompts, budgets and stop tokens; :func:`check_generate` turns them into plain lists of ints or raises a
``ValueError`` (a ``TypeError`` for a value of the wrong kind: text, a bare int, a set) that names
the bad value and what is valid, before any request is admitted. A prompt may be a list or tuple
of ints, a 1-D integer tensor or a numpy integer array; a float id is refused, never truncated.
Imports neither transformers nor numpy.
"""

from __future__ import annotations

import dataclasses
import inspect
import numbers
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, TypeVar

import torch

from ..attention.backends import attention_backends, describe, select_attention_backends
from ..config import CompilationConfig
from ..validation import is_int  # noqa: F401  (serve's modules import it from here)
from .token_rules import TokenRules

#: What a prompt may be, for the error messages.
PROMPT_KINDS = "a list or tuple of ints, a 1-D integer tensor or a 1-D numpy integer array"


@dataclasses.dataclass(frozen=True)
class GenerateArgs:
    """What :func:`check_generate` returns: every prompt as a list of ints, one budget per prompt,
    and the stop tokens (empty: stop at the budget only)."""

    prompts: list[list[int]]
    budgets: list[int]
    eos: frozenset[int]


def _is_array(value: Any) -> bool:
    """A torch tensor or a numpy array (duck-typed: neither is imported here)."""
    return hasattr(value, "ndim") and hasattr(value, "shape") and hasattr(value, "tolist")


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def prompt_ids(prompt: Any, where: str) -> list[int]:
    """``prompt`` as a list of ints; refuses text, 2-D batches and non-integer ids (the error starts with ``where``,
    e.g. ``"prompt 0"``)."""
    if isinstance(prompt, (str, bytes)):
        raise TypeError(f"{where} is text ({_show(prompt)}): generate takes token ids; tokenize it first")
    if is_int(prompt):
        raise TypeError(f"{where} is an int ({prompt}), not a sequence of token ids: prompts is a list of "
                        "prompts, so wrap a single prompt as [prompt]")
    if _is_array(prompt):
        if prompt.ndim != 1:
            raise ValueError(f"{where} is a {prompt.ndim}-D {type(prompt).__name__} of shape {tuple(prompt.shape)}; "
                             f"a prompt is {PROMPT_KINDS} (a batch of prompts is a list of them, without padding)")
        ids = prompt.tolist()
    elif isinstance(prompt, Sequence):
        ids = list(prompt)
    else:
        raise TypeError(f"{where} is a {type(prompt).__name__} ({_show(prompt)}); a prompt is {PROMPT_KINDS}")
    for position, t in enumerate(ids):
        if not is_int(t):
            raise ValueError(f"{where}: token id {_show(t)} ({type(t).__name__}) at position {position} is "
                             "not an integer; token ids are ints (a float id is not rounded)")
    return [int(t) for t in ids]


def budgets(max_new_tokens: Any, num_prompts: int) -> list[int]:
    """``max_new_tokens`` (a positive int, or one per prompt) as one budget per prompt."""
    if is_int(max_new_tokens):
        per_prompt = [max_new_tokens] * num_prompts
    elif isinstance(max_new_tokens, (list, tuple)) and len(max_new_tokens) == num_prompts:
        per_prompt = list(max_new_tokens)
    else:
        raise ValueError(f"max_new_tokens must be a positive int or one per prompt (a list or tuple of "
                         f"{num_prompts} positive ints), got {_show(max_new_tokens)}")
    for i, b in enumerate(per_prompt):
        if not is_int(b) or b < 1:
            where = "max_new_tokens" if is_int(max_new_tokens) else f"max_new_tokens[{i}]"
            raise ValueError(f"{where} must be a positive int (tokens to generate), got {_show(b)}")
    return [int(b) for b in per_prompt]


def check_salt(value: Any, where: str = "cache_salt") -> str | None:
    """A request's prefix-cache salt: a str or None (requests share cached blocks only with equal salts)."""
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{where} must be a str or None (requests share cached prompt blocks only with an equal "
                         f"salt), got {type(value).__name__} {_show(value)}")
    return value


def cache_salts(cache_salt: Any, num_prompts: int) -> list[str | None]:
    """``cache_salt`` (a str or None for every prompt, or one per prompt) as one salt per prompt."""
    if cache_salt is None or isinstance(cache_salt, str):
        return [cache_salt] * num_prompts
    if not isinstance(cache_salt, (list, tuple)) or len(cache_salt) != num_prompts:
        raise ValueError(f"cache_salt must be a str or None, or one per prompt (a list or tuple of {num_prompts} "
                         f"strs or Nones), got {_show(cache_salt)}")
    return [check_salt(s, f"cache_salt[{i}]") for i, s in enumerate(cache_salt)]


def eos_ids(
    eos_token_id: Any, default: Any = None, *, vocab_size: int | None = None, name: str = "eos_token_id"
) -> frozenset[int]:
    """The stop tokens: ``eos_token_id`` (an int, or a list/tuple of ints; ``[]``: none), or, when it is
    None, ``default`` (the model's ``generation_config.eos_token_id``, as ``model.generate`` uses).
    ``name``: the argument's name in the errors (``add_request`` calls it ``stop_token_ids``)."""
    given = eos_token_id is not None
    value, source = (eos_token_id, name) if given else (default, "the model's generation_config.eos_token_id")
    if value is None:
        return frozenset()
    ids = [value] if is_int(value) else list(value) if isinstance(value, (list, tuple)) else None
    if ids is None or not all(is_int(t) for t in ids):
        raise ValueError(f"{source} must be an int, a list or tuple of ints ([]: no stop token), or None "
                         f"(the model's generation_config.eos_token_id), got {_show(value)}")
    if given and vocab_size is not None:
        outside = [t for t in ids if not 0 <= t < vocab_size]
        if outside:
            raise ValueError(f"{name} {outside[0]} is outside the vocabulary (ids 0..{vocab_size - 1}): "
                             "it would never stop a request")
    return frozenset(int(t) for t in ids)


def check_attention_backend(attention_backend: Any, *, device: Any, dtype: Any, block_size: int) -> str:
    """``attention_backend`` of an engine whose cache is on ``device`` with ``dtype`` and ``block_size``:
    ``"auto"`` (the best one available, see :func:`~piecewise_backend.attention.select_attention_backends`)
    or a registered backend's name that can serve that cache. Returns the choice in words (an
    engine's ``.attention_backend``, e.g. ``"bounded"``); the error names the value and the valid ones."""
    registered = attention_backends()
    valid = ["auto", *sorted(n for n, b in registered.items() if b.available(device, block_size, dtype) is None)]
    if not isinstance(attention_backend, str):
        raise TypeError(f"attention_backend must be a backend's name, one of {valid} for this cache, "
                        f"got {type(attention_backend).__name__} {_show(attention_backend)}")
    if attention_backend != "auto" and attention_backend not in registered:
        raise ValueError(f"unknown attention backend {attention_backend!r}: attention_backend is one of {valid} for "
                         f"this cache (registered: {sorted(registered)})")
    try:
        return describe(select_attention_backends(attention_backend, device, block_size, dtype))
    except ValueError as e:  # registered, but not for this device, block size or dtype
        raise ValueError(f"{e}; valid for this cache: {valid}") from None


@dataclasses.dataclass(frozen=True)
class EngineArgs:
    """The constructor arguments every engine shares, each checked by its own name when built (a
    ``ValueError`` naming the argument, the value and what is valid; ``num_blocks=0`` is refused, not
    replaced by the default). Engines take them as keywords (or as ``args=EngineArgs(...)``); a new
    one is a field here. ``attention_backend`` is checked against each model's cache by
    :meth:`check_model`; the range of ``eos_token_id`` by :meth:`stop_tokens`, once the vocabulary
    is known. HF engines take every field but ``eos_token_id`` (:data:`MODEL_EOS`)."""

    max_num_reqs: int = 4  # requests a step runs at most
    max_model_len: int = 128  # tokens a request holds at most
    block_size: int = 16  # tokens per KV block
    num_blocks: int | None = None  # None: room for max_num_reqs requests of max_model_len tokens
    attention_backend: str = "auto"  # "auto" or a registered attention backend's name
    lazy_capture: bool = False  # True: serve at once, capture_idle (and the steps' catch-up) capture later
    max_num_batched_tokens: int | None = None  # tokens per step (None: the largest capture size)
    graph_memory_budget: int | None = None  # bytes the engine's graphs may add to the graph pool
    eos_token_id: int | Sequence[int] | None = None  # the default stop token(s) of generate, add_request (kept as a tuple)
    step_capture_budget_s: float | None = None  # seconds a lazy engine's step may capture (None: 0.05 lazy, else 0)
    #: generate's per-token settings on every step's logits (None: none; HF engines: the model's generation_config's)
    token_rules: TokenRules | None = None
    #: reuse the KV blocks of prompt prefixes other requests computed (docs/engine.md "Prefix caching")
    enable_prefix_caching: bool = True
    #: an image-text-to-text model's encoder graphs: the image tokens each holds (None: 1, 2, 4 and 8 images' worth)
    encoder_token_budgets: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name, meaning in (
            ("max_num_reqs", "requests a step runs at most"),
            ("max_model_len", "tokens a request holds at most"),
            ("block_size", "tokens per KV block"),
        ):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"{name} must be a positive int ({meaning}), got {_show(value)}")
            object.__setattr__(self, name, int(value))
        n = self.num_blocks
        if n is not None and (not is_int(n) or n < 1):
            raise ValueError(f"num_blocks must be None (room for max_num_reqs requests of max_model_len tokens) or a "
                             f"positive int, got {_show(n)}")
        if self.lazy_capture is not True and self.lazy_capture is not False:
            raise ValueError(f"lazy_capture must be a bool, got {_show(self.lazy_capture)}")
        if self.enable_prefix_caching is not True and self.enable_prefix_caching is not False:
            raise ValueError(f"enable_prefix_caching must be a bool, got {_show(self.enable_prefix_caching)}")
        check_tokens_budget(self.max_num_batched_tokens)
        if self.token_rules is not None and not isinstance(self.token_rules, TokenRules):
            raise ValueError(f"token_rules must be None or a serve.TokenRules(...), got {_show(self.token_rules)}")
        b = self.encoder_token_budgets
        if b is not None:
            if isinstance(b, (str, bytes)) or not hasattr(b, "__iter__") or not list(b) or any(
                    not is_int(t) or t < 1 for t in b):
                raise ValueError(f"encoder_token_budgets must be None or a non-empty list of positive ints (image "
                                 f"tokens per encoder graph), got {_show(b)}")
            object.__setattr__(self, "encoder_token_budgets", tuple(sorted({int(t) for t in b})))
        g = self.graph_memory_budget
        if g is not None and (not is_int(g) or g < 0):
            raise ValueError(f"graph_memory_budget must be None or a number of bytes >= 0, got {_show(g)}")
        s = self.step_capture_budget_s
        if s is not None and (isinstance(s, bool) or not isinstance(s, numbers.Real) or not s >= 0 or s == float("inf")):
            raise ValueError(f"step_capture_budget_s must be None (the default) or a finite number of seconds >= 0 "
                             f"(0: never capture inside a step), got {_show(s)}")
        eos = self.eos_token_id
        if eos is not None:
            eos_ids(eos)  # the kind of value here; its range once the vocabulary is known (stop_tokens)
            object.__setattr__(self, "eos_token_id", int(eos) if is_int(eos) else tuple(int(t) for t in eos))
        for name in ("num_blocks", "max_num_batched_tokens", "graph_memory_budget"):  # numpy ints as ints
            if getattr(self, name) is not None:
                object.__setattr__(self, name, int(getattr(self, name)))

    def stop_tokens(self, vocab_size: int) -> frozenset[int]:
        """``eos_token_id`` as the set of stop tokens of an engine of ``vocab_size`` tokens; refuses an id
        outside the vocabulary (it would never stop a request)."""
        return eos_ids(self.eos_token_id, vocab_size=vocab_size)

    def check_model(self, model: Any, role: str = "model") -> str:
        """Refuse a model the engine cannot build caches for: no ``nn.Module``, already compiled, without
        parameters (see :func:`first_parameter`), or whose cache ``attention_backend`` cannot serve
        (:func:`check_attention_backend`); returns the backend chosen, in words."""
        param = first_parameter(model, role)
        return check_attention_backend(self.attention_backend, device=param.device, dtype=param.dtype,
                                       block_size=self.block_size)


#: The engine arguments a HF engine does not take: its default stop token is the model's
#: ``generation_config.eos_token_id`` (as ``model.generate``'s); ``generate`` takes another.
MODEL_EOS = ("eos_token_id",)


def engine_keywords(exclude: Collection[str] = ()) -> tuple[str, ...]:
    """The names of :class:`EngineArgs`' fields, in order, less ``exclude``."""
    return tuple(f.name for f in dataclasses.fields(EngineArgs) if f.name not in exclude)


Init = TypeVar("Init", bound=Callable[..., None])


def takes_engine_args(exclude: Collection[str] = ()) -> Callable[[Init], Init]:
    """Decorate an engine's ``__init__(self, ..., args=None, **engine_args)``: its signature (what
    ``inspect.signature``, ``help`` and the docs show) lists :class:`EngineArgs`' fields but ``exclude``
    as keyword-only parameters with their defaults, before ``args``."""

    def decorate(init: Init) -> Init:
        sig = inspect.signature(init)
        own = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD and p.name != "args"]
        fields = {f.name: f for f in dataclasses.fields(EngineArgs)}
        given = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=fields[name].default,
                                   annotation=fields[name].type) for name in engine_keywords(exclude)]
        init.__signature__ = sig.replace(parameters=[*own, *given, sig.parameters["args"]])  # type: ignore[attr-defined]
        return init

    return decorate


def engine_args(
    owner: str, args: EngineArgs | None, keywords: Mapping[str, Any], exclude: Collection[str] = (),
) -> EngineArgs:
    """The :class:`EngineArgs` of a call of ``owner`` (e.g. ``"HFEngine"``): ``args`` (default: every
    field's default) with the ``keywords`` given beside it; a keyword that is no field, or one of
    ``exclude``, is a ``TypeError`` as Python's own for an unexpected keyword."""
    taken = engine_keywords(exclude)
    for name in keywords:
        if name not in taken:
            raise TypeError(f"{owner}.__init__() got an unexpected keyword argument {name!r}")
    if args is None:
        return EngineArgs(**keywords)
    if not isinstance(args, EngineArgs):
        raise TypeError(f"args must be a serve.EngineArgs (or give the engine arguments as keywords), got "
                        f"{type(args).__name__}")
    for name in exclude:
        if getattr(args, name) != getattr(EngineArgs, name):
            raise TypeError(f"{owner} takes no {name}: leave it at its default ({getattr(EngineArgs, name)!r}) in args")
    return dataclasses.replace(args, **keywords) if keywords else args


def check_engine_args(
    *, max_num_reqs: Any, max_model_len: Any, block_size: Any, num_blocks: Any, lazy_capture: Any,
    max_num_batched_tokens: Any, graph_memory_budget: Any, step_capture_budget_s: Any = None,
) -> None:
    """The checks of :class:`EngineArgs` for these arguments, each by its own name."""
    EngineArgs(max_num_reqs=max_num_reqs, max_model_len=max_model_len, block_size=block_size, num_blocks=num_blocks,
               lazy_capture=lazy_capture, max_num_batched_tokens=max_num_batched_tokens,
               graph_memory_budget=graph_memory_budget, step_capture_budget_s=step_capture_budget_s)


def check_config(config: Any, name: str = "config") -> None:
    """A :class:`~piecewise_backend.CompilationConfig` (``name``: the argument's, in the error)."""
    if not isinstance(config, CompilationConfig):
        raise TypeError(f"{name} must be a piecewise_backend.CompilationConfig, got {type(config).__name__}")


def check_vocab(vocab_size: Any) -> int:
    """The logits' last dim: a positive int."""
    if not is_int(vocab_size) or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive int (the logits' last dim), got {vocab_size!r}")
    return int(vocab_size)


def first_parameter(model: Any, role: str = "model") -> torch.Tensor:
    """The parameter whose dtype and device the caches take; a clear error for a model without one."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"the {role} must be an uncompiled torch.nn.Module, got {type(model).__name__}")
    if hasattr(model, "_orig_mod"):  # torch.compile's OptimizedModule
        raise TypeError(f"the {role} is already compiled (torch.compile); pass the nn.Module itself: the engine "
                        "compiles it with make_backend(config)")
    param = next(model.parameters(), None)
    if param is None:
        raise ValueError(f"the {role} {type(model).__name__} has no parameters: the caches take the dtype and device "
                         "of its first parameter")
    return param


def check_tokens_budget(value: Any) -> None:
    """``max_num_batched_tokens``: None or a positive int."""
    if value is not None and (not is_int(value) or value < 1):
        raise ValueError(f"max_num_batched_tokens must be None or a positive int (tokens per step), got {value!r}")


def check_generate(
    prompts: Any,
    max_new_tokens: Any,
    *,
    vocab_size: int,
    max_model_len: int,
    eos_token_id: Any = None,
    default_eos: Any = None,
    reserve: int = 0,
    reserve_reason: str = "",
) -> GenerateArgs:
    """Check the arguments of ``generate`` for an engine of ``vocab_size`` tokens and ``max_model_len``
    positions. Each request needs ``len(prompt) + budget + reserve <= max_model_len`` (``reserve``:
    positions past the last token an engine writes, e.g. speculative decoding's ``k - 1``, said in
    the error as ``reserve_reason``). ``eos_token_id``: see :func:`eos_ids` (``default_eos``: the
    model's, from :func:`generation_eos`)."""
    if isinstance(prompts, (str, bytes)) or _is_array(prompts) or not isinstance(prompts, Sequence):
        raise TypeError(f"prompts must be a list or tuple of prompts (each {PROMPT_KINDS}), got "
                        f"{type(prompts).__name__} {_show(prompts)}" + (
                            "; a padded batch would serve its padding as prompt tokens" if _is_array(prompts) else ""))
    ids = [prompt_ids(p, f"prompt {i}") for i, p in enumerate(prompts)]
    per_prompt = budgets(max_new_tokens, len(ids))
    extra = f" + {reserve} ({reserve_reason})" if reserve_reason else ""
    for i, p in enumerate(ids):
        if not p:
            raise ValueError(f"prompt {i} is empty: a prompt needs at least one token id")
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:  # an embedding lookup out of range: IndexError here, a device-side assert inside a CUDA graph
            raise ValueError(f"prompt {i}: token id {bad[0]} is outside the vocabulary (ids 0..{vocab_size - 1})")
        if len(p) + per_prompt[i] + reserve > max_model_len:
            raise ValueError(f"prompt {i}: {len(p)} tokens + {per_prompt[i]} new{extra} must be in "
                             f"1..max_model_len={max_model_len}")
    return GenerateArgs(ids, per_prompt, eos_ids(eos_token_id, default_eos, vocab_size=vocab_size))
