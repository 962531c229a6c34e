"""One model served on its paged KV cache, its state cache and a GraphRunner; the plain decode step.

:class:`ModelRunner` is what an engine builds per model: the cache sized by a :class:`KVLayout`,
a :class:`~piecewise_backend.state.StateCache` when the model has state layers, the model compiled
with ``make_backend(config)`` (inside a wrapper whose ``forward`` has a code object of its own, see
:func:`own_code`), or uncompiled with ``compile_pieces="none"`` (no Dynamo; its splitting ops break at
run time, :mod:`piecewise_backend.capture.op_breaks`), and the :class:`~piecewise_backend.GraphRunner`
that pads, dispatches and replays.
:meth:`ModelRunner.run` runs one step's layout. :class:`Decode` is the plain engine's
:class:`~.loop.StepExecutor`: one step, one sampled token per request whose chunk ends its sequence.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from ..backend.compiler import make_backend
from ..config import CompilationConfig
from ..kv import cache as kv
from ..modes import AttentionGraphSupport, CUDAGraphMode
from ..runner import GraphRunner, StaticInput, StepResult
from ..state.cache import StateCache, StateSpec
from .arguments import EngineArgs, first_parameter, is_int
from .ladder import Ladder, cover_limits
from .loop import Executed, chunk_ends
from .sampling import mark_nan, noise_key, sample
from .scheduler import StepPlan
from .token_rules import TokenRules


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """The paged KV cache a model needs: attention layers (each indexes the cache by its own layer
    number, 0-based, in call order), KV heads per layer and the head dim; ``indexer_dim`` > 0: each
    layer also keeps one indexer key of that size per token (indexed attention, ``kv.indexed``)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    indexer_dim: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "indexer_dim"):
            value = getattr(self, name)
            least = 0 if name in ("num_layers", "indexer_dim") else 1  # a pure state-space model has no attention layer
            if not is_int(value) or value < least:
                raise ValueError(f"KVLayout.{name} must be an int >= {least}, got {value!r}")
            object.__setattr__(self, name, int(value))


class ProtocolStep(torch.nn.Module):
    """``model(input_ids=(T,), position_ids=(T,))``: the protocol's call, the module an engine compiles
    (not :class:`piecewise_backend.runner.Step`, the protocol of what runs a GraphRunner's wrapped model)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        # A step has >= 1 token: with the unbacked token count known non-zero, a model's
        # ``reshape(..., -1, d)`` needs no data-dependent guard.
        torch._check(input_ids.shape[0] >= 1)
        return self.model(input_ids=input_ids, position_ids=position_ids)


def own_code(cls: type[torch.nn.Module]) -> type[torch.nn.Module]:
    """A subclass of ``cls`` whose ``forward`` has a code object of its own.

    Dynamo keeps compiled code per code object and, past ``recompile_limit`` (8) entries, runs the
    frame uncompiled: with one shared ``forward`` the 9th engine of a process would be served
    eagerly, its PIECEWISE graphs holding attention whole. A copy of the code per engine keeps each
    engine's entries apart (and frees them with the engine).
    """
    base = cls.forward
    forward = types.FunctionType(base.__code__.replace(), base.__globals__, base.__name__, base.__defaults__,
                                 base.__closure__)
    functools.update_wrapper(forward, base)
    del forward.__wrapped__  # a wrapper's __wrapped__ would send inspect (and Dynamo's tracing) to the shared code
    return type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__, "__qualname__": cls.__qualname__})


class ModelRunner:
    """One model on its KV cache, state cache and GraphRunner (see the module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        config: CompilationConfig,
        *,
        kv_layout: KVLayout,
        args: EngineArgs,
        state_specs: Sequence[StateSpec] = (),
        drafter: bool = False,
        uniform_decode_query_len: int = 1,
        attention_support: AttentionGraphSupport = AttentionGraphSupport.ALWAYS,
        downgrades: Sequence[str] = (),
        vocab_size: int | None = None,
    ):
        """``model`` (checked by the engine: :meth:`EngineArgs.check_model`) on caches sized by ``args``;
        ``downgrades``: what the caller already took from ``config`` (listed first in ``runner.downgrades``);
        ``vocab_size``: the logits' width, checked at the first step (:func:`check_logits`; None: not checked)."""
        param = first_parameter(model)
        self.model = model
        self.vocab_size = vocab_size
        self._who = "the drafter" if drafter else "the model"
        self._checking = vocab_size is not None  # the protocol is checked at the first steps (_check_protocol)
        self._logits_checked = False
        #: the capture ladder: the config's sizes plus ``max_num_reqs`` and ``max_num_batched_tokens``
        self.ladder: Ladder = cover_limits(
            config, max_num_reqs=args.max_num_reqs, max_num_batched_tokens=args.max_num_batched_tokens,
            uniform_decode_query_len=uniform_decode_query_len, name="drafter" if drafter else "engine",
        )
        config = self.ladder.config
        blocks = args.num_blocks or args.max_num_reqs * -(-args.max_model_len // args.block_size)
        self.cache = kv.PagedKVCache(
            kv_layout.num_layers, kv_layout.num_kv_heads, kv_layout.head_dim, block_size=args.block_size,
            max_model_len=args.max_model_len, num_blocks=blocks, dtype=param.dtype, device=param.device,
            attention_backend=args.attention_backend, indexer_dim=kv_layout.indexer_dim,
        )
        self.attention_backend = self.cache.attention_backend  # e.g. "bounded", "varlen (then bounded)"
        if self._checking and kv_layout.num_layers:
            self.cache.check_layers()  # captures and steps note the layers attention reaches
        #: one slot per running request for the state layers' conv and recurrent states (None: no state layer)
        self.states = (StateCache(list(state_specs), num_slots=args.max_num_reqs, device=param.device)
                       if state_specs else None)
        no_dynamo = config.compile_pieces == "none"  # the model's own forward: splitting ops break at run time
        #: the backend Dynamo compiles with (``.splits``: the split of every graph it compiled); None with
        #: ``compile_pieces="none"``. Every call of the runner's graphs is in a forward context: no per-call
        #: standalone check (backend/standalone.py)
        self.backend = None if no_dynamo else make_backend(config.replace(standalone_capture=False))
        step = (ProtocolStep if no_dynamo else own_code(ProtocolStep))(model)
        compiled = step if no_dynamo else torch.compile(step, backend=self.backend)
        inputs = [StaticInput("input_ids"), *self.cache.static_inputs()]
        support = min(attention_support, self.cache.attention_graph_support)
        context_fn = self.cache.context_fn
        if self.states is not None:  # FULL graphs hold state updates of one token per request only
            states, cache = self.states, self.cache
            inputs.extend(states.static_inputs())
            context_fn = lambda views: {**cache.context_fn(views), **states.context_fn(views)}  # noqa: E731
            support = min(support, AttentionGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE)
        self.runner = GraphRunner(
            compiled, config, inputs, model_kwargs=["input_ids", kv.POSITIONS], context_fn=context_fn,
            max_num_reqs=args.max_num_reqs, device=param.device, attention_support=support,
            attention_backend=self.attention_backend, lazy_capture=args.lazy_capture,
            graph_memory_budget=args.graph_memory_budget,
            uniform_decode_query_len=uniform_decode_query_len, drafter=drafter,
            eager_model=None if no_dynamo else step,  # lazy: served uncompiled until capture_idle compiles
            downgrades=(*downgrades, *self.ladder.downgrades),
        )

    def run(
        self, layout: Sequence[tuple[Hashable, int, int]], tokens: Sequence[int] | torch.Tensor, uniform: bool,
        commit: bool = True,
    ) -> StepResult:
        """One step over ``layout`` (``(request slot, first position, tokens)`` each) and its ``tokens``
        (ids, or a device tensor of them); what the GraphRunner did, its ``output`` the logits of every
        token. They live in graph memory: read them before any other replay. ``commit=False`` leaves the state layers' states as they were
        before the step (the copies it wrote become current only through :meth:`commit`)."""
        if isinstance(tokens, torch.Tensor):
            _, meta = self.cache.stage_step(layout)
            ids = tokens.to(device=self.cache.device, dtype=torch.long)
        else:
            ids, meta = self.cache.stage_step(layout, tokens)  # views of the cache's staging buffer
        if self.states is not None:  # a new (or preempted) request gets a zeroed slot
            meta.update(self.states.step_inputs(layout))
        result = self.runner.run_step(
            uniform_decode=uniform, num_reqs=len(layout) if uniform else None, input_ids=ids, **meta
        )
        if self._checking:  # the first steps only: every later step runs the same code (or its graph)
            self._check_protocol(result, ids.shape[0])
        if commit and self.states is not None:
            self.commit([slot for slot, _, _ in layout])
        return result

    def _check_protocol(self, result: StepResult, num_tokens: int) -> None:
        """The model returns the logits (:func:`check_logits`) and its attention reaches every layer of the
        cache (once a capture or a step that ran the model's Python, not only FULL replays, has)."""
        if not self._logits_checked:
            check_logits(result.output, num_tokens, self.vocab_size, self._who)  # type: ignore[arg-type]
            self._logits_checked = True
        unused = self.cache.layers_unused(full_replay=result.mode is CUDAGraphMode.FULL)
        if unused is None:
            return
        self._checking = False
        if unused:
            n = len(self.cache.key_caches)
            raise ValueError(
                f"{self._who} never read or wrote KV cache layers {unused} of its KVLayout(num_layers={n}): their "
                "attention does not go through the paged KV cache (a model keeping its own dense attention is "
                "served with wrong tokens). Call torch.ops.pb_kv.paged_attention(q, k, v, out, layer, ...) in every "
                f"attention layer with its own layer index 0..{n - 1}, or give a KVLayout of the layers that do"
            )

    def commit(self, slots: Sequence[Hashable]) -> None:
        """The states the last step wrote for ``slots`` become current (no-op without state layers)."""
        if self.states is not None and slots:
            self.states.commit(slots)

    def snapshot(self, slots: Sequence[Hashable]) -> list[list[torch.Tensor]] | None:
        """Copies of the current states of ``slots`` (None without state layers): what :meth:`restore` puts back."""
        if self.states is None:
            return None
        return [[self.states.state(slot, i).clone() for i in range(len(self.states.states))] for slot in slots]

    def restore(self, slots: Sequence[Hashable], snapshot: list[list[torch.Tensor]] | None) -> None:
        """Put the states :meth:`snapshot` copied back as the current ones of ``slots``."""
        if self.states is None or snapshot is None:
            return
        for slot, saved in zip(slots, snapshot):
            for i, t in enumerate(saved):
                self.states.state(slot, i).copy_(t)


def check_logits(out: Any, num_tokens: int, vocab_size: int, who: str = "the model") -> None:
    """Refuse a step output that is not the protocol's logits, ``(num_tokens, vocab_size)``, naming what came back:
    wider logits would sample token ids outside the vocabulary, and other shapes fail deep in sampling."""
    if isinstance(out, torch.Tensor) and tuple(out.shape) == (num_tokens, vocab_size) and out.is_floating_point():
        return
    if isinstance(out, torch.Tensor):
        got = f"a {out.dtype} tensor of shape {tuple(out.shape)}"
        hint = ""
        if out.dim() == 3 and out.shape[0] == 1:
            hint = "; drop the batch dimension (return logits[0]): a step is one flat sequence of every request's tokens"
        elif out.dim() == 2 and out.shape[0] == num_tokens:
            hint = (f"; vocab_size={vocab_size} must be the logits' width (the model's output projection has "
                    f"{out.shape[1]} rows): give the engine vocab_size={out.shape[1]}, or slice the logits")
        elif not out.is_floating_point():
            hint = "; return the logits (floats), not token ids"
    else:
        got, hint = f"{type(out).__name__} {str(out)[:60]!s}", "; return the logits tensor alone"
    raise ValueError(
        f"{who} returned {got} for a step of {num_tokens} tokens, where the model protocol returns the logits of "
        f"every token: a float tensor of shape (T, vocab_size={vocab_size}) = ({num_tokens}, {vocab_size}){hint}"
    )


class Decode:
    """The plain engine's step: one model, one sampled token per request whose chunk ends its sequence
    (:data:`~.sampling.NAN_TOKEN` where its logits hold a NaN), under ``rules`` (none: skipped)."""

    def __init__(self, model: ModelRunner, rules: TokenRules | None = None):
        self.model = model
        self.rules = rules or None

    def execute(self, plan: StepPlan) -> Executed:
        chunks = plan.chunks
        layout = [(r.slot, start, count) for r, start, count in chunks]
        decode = all(count == 1 for _, _, count in chunks)  # one query token per request: FULL-graph shaped
        if decode:
            tokens = [r.token(start) for r, start, _ in chunks]
        else:
            tokens = [t for r, start, count in chunks for t in r.tokens(start, count)]
        result = self.model.run(layout, tokens, decode)
        logits = result.output
        new: list[list[int]] = [[] for _ in chunks]
        emit = [i for i, (r, start, count) in enumerate(chunks) if start + count == r.length]
        for r, start, count in chunks:
            r.computed = start + count
        if emit:
            emitting = [chunks[i][0] for i in emit]
            if len(emit) == logits.shape[0]:  # every token ends its sequence (a decode step): every row, in order
                rows = logits
            else:
                ends = chunk_ends(chunks)
                rows = logits.index_select(0, torch.tensor([ends[i] for i in emit], device=logits.device))
            if self.rules is not None:
                rows = self.rules.apply(rows, emitting)
            if all(r.greedy for r in emitting):  # argmax: no noise keys, no per-row parameters
                chosen = rows.argmax(-1)
            else:
                keys = [noise_key(r.seed, r.length) for r in emitting]  # the new token's position
                chosen = sample(rows, [r.sampling for r in emitting], keys)
            drawn = mark_nan(rows, chosen).tolist()  # read before any other replay
            for i, token in zip(emit, drawn):
                new[i] = [token]
        return Executed(new, len(tokens), decode, result.mode, result.reason)

    def kept(self, plan: StepPlan, executed: Executed, kept: list[int]) -> None:
        return None
