"""Speculative decoding of a HF causal LM: a drafter proposes k tokens, the target verifies them in one step.

:class:`SpecEngine` runs two models, each on its own :class:`~piecewise_backend.GraphRunner` and
:class:`~piecewise_backend.kv.PagedKVCache`; one round of its continuous-batching greedy loop:

1. the drafter proposes ``k`` tokens per running request (k drafter steps: the first feeds each
   request what the drafter has not cached yet, a whole prompt for a new request; the others one
   token each). The drafter runner is built with ``drafter=True``: breakable PIECEWISE graphs only;
2. the target runs one step over every request's uncached tokens plus its ``k`` drafts. A step
   of running requests only is uniform, ``k + 1`` query tokens each: FULL graphs keyed with
   ``uniform_decode_query_len = k + 1``; a step with a new prompt is a mixed batch;
3. greedy acceptance keeps the longest prefix of drafts equal to the target's argmax, plus the
   target's own next token, and both caches drop the rejected tokens (:meth:`PagedKVCache.truncate`).

Two caches rather than one with two layer groups: the models differ in layer count (and may
differ in KV heads), each model's attention indexes its cache by its own ``layer_idx``, and the
two run ahead of each other by different amounts, so each keeps its own block tables.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch

from ..backend.compiler import make_backend
from ..config import CompilationConfig
from ..hf.arguments import check_attention_backend, check_generate, generation_eos
from ..hf.engine import adapt, kv_shape
from ..hf.mixers import candidates
from ..hf.sampling import SamplingParams, per_request
from ..hf.host_breaks import no_full_graphs
from ..kv import cache as kv
from ..modes import AttentionGraphSupport, CUDAGraphMode
from ..runner.graph_runner import CaptureReport, GraphRunner, StaticInput
from .state import RequestStates, RoundInfo, SpecStats, chunk_ends

__all__ = ["RoundInfo", "SpecEngine", "SpecStats", "truncated_drafter"]


class _Side:
    """One model of the pair: adapted, compiled, with its own cache and runner."""

    def __init__(
        self, model: torch.nn.Module, config: CompilationConfig, *, drafter: bool, query_len: int,
        support: AttentionGraphSupport, max_num_reqs: int, max_model_len: int, block_size: int, num_blocks: int | None,
        attention_backend: str,
    ):
        self.model = model
        adapted = adapt(model)
        # HFEngine's layout source: the probe of the attention modules (the config's fields can be
        # wrong: multi-query gpt_bigcode, MLA's K/V head dims)
        layers, kv_heads, head_dim = kv_shape(adapted)
        param = next(model.parameters())
        self.cache = kv.PagedKVCache(
            layers, kv_heads, head_dim, block_size=block_size, max_model_len=max_model_len,
            num_blocks=num_blocks or max_num_reqs * -(-max_model_len // block_size), dtype=param.dtype, device=param.device,
            attention_backend=attention_backend,
        )
        config = no_full_graphs(config, adapted.host_breaks)  # a break point: no FULL graph holds it
        self.backend = make_backend(config)
        self.runner = GraphRunner(
            torch.compile(adapted, backend=self.backend), config, [StaticInput("input_ids"), *self.cache.static_inputs()],
            model_kwargs=["input_ids", kv.POSITIONS], context_fn=self.cache.context_fn, max_num_reqs=max_num_reqs,
            attention_support=min(support, self.cache.attention_graph_support), attention_backend=self.cache.attention_backend,
            uniform_decode_query_len=query_len, drafter=drafter, device=param.device,
        )

    def step(self, chunks: list[tuple[int, int, int]], tokens: list[int], uniform: bool) -> list[int]:
        """Run one step; the argmax of every token's logits (read before any other graph replays)."""
        meta = self.cache.step_inputs(chunks)
        ids = torch.tensor(tokens, dtype=torch.long, device=self.cache.device)
        logits = self.runner.run(uniform_decode=uniform, num_reqs=len(chunks) if uniform else None, input_ids=ids, **meta)
        return logits.argmax(-1).tolist()  # graph memory: the next replay of any graph may overwrite it


def truncated_drafter(model: torch.nn.Module, num_layers: int) -> torch.nn.Module:
    """A draft model: ``model``'s first ``num_layers`` decoder layers with its embeddings, final norm
    and head (self-speculation by early exit); same vocabulary by construction. ``model`` is untouched."""
    config = copy.deepcopy(model.config)
    total = config.get_text_config().num_hidden_layers
    if not isinstance(num_layers, int) or isinstance(num_layers, bool) or not 1 <= num_layers <= total:
        raise ValueError(f"num_layers must be an int in 1..{total} (the target's layer count), got {num_layers!r}")
    config.get_text_config().num_hidden_layers = num_layers
    for name in ("layer_types",):  # per-layer lists follow the layer count
        if isinstance(getattr(config, name, None), list):
            setattr(config, name, getattr(config, name)[:num_layers])
    draft = type(model)(config)
    missing = draft.load_state_dict(model.state_dict(), strict=False).missing_keys
    if missing:
        raise ValueError(f"truncated_drafter: the draft model has weights the target lacks: {missing[:3]}")
    param = next(model.parameters())
    return draft.to(device=param.device, dtype=param.dtype).eval()


class SpecEngine:
    """Greedy continuous batching with speculative decoding: ``drafter`` proposes, ``target`` verifies.

    ``drafter`` may be ``target`` itself (every draft is then accepted). Both models are switched
    to paged attention (:func:`~piecewise_backend.hf.adapt`). ``config`` is the target's; the
    drafter uses ``drafter_config`` (default: ``config``) with ``drafter=True``. ``attention_backend``
    is ``HFEngine``'s, for both models' caches (reported as ``.attention_backend``). The target's
    capture sizes gain every verify size ``r * (k + 1)`` up to ``max_num_reqs`` requests (within
    ``max_capture_size``), so each verify step has an exact FULL key.
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
    ):
        k = num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"num_speculative_tokens must be a positive int, got {k!r}")
        vocab = [m.config.get_text_config().vocab_size for m in (target, drafter)]
        if vocab[0] != vocab[1]:
            raise ValueError(f"the drafter's vocabulary ({vocab[1]} tokens) must be the target's ({vocab[0]})")
        for role, m in (("target", target), ("drafter", drafter)):
            stateful = candidates(m)
            if stateful:  # before either model is adapted
                layer, module = stateful[0]
                raise ValueError(
                    f"SpecEngine cannot serve the {role} {type(m).__name__}: {type(module).__name__} (layer {layer}) "
                    "keeps a recurrent or convolution state, which rejected draft tokens would leave advanced (no "
                    "per-position state snapshots to roll back to); serve it with HFEngine"
                )
            limit = getattr(m.config.get_text_config(), "max_position_embeddings", None)
            if limit is not None and max_model_len > limit:
                raise ValueError(f"max_model_len={max_model_len} exceeds {type(m).__name__}'s max_position_embeddings={limit}")
            param = next(m.parameters())
            check_attention_backend(attention_backend, device=param.device, dtype=param.dtype, block_size=block_size)
        self.k = k
        self.vocab_size: int = vocab[0]
        verify = sorted({r * (k + 1) for r in range(1, max_num_reqs + 1)} | set(config.sizes))
        if not getattr(config, "_max_derived", True):
            verify = [s for s in verify if s <= config.max_capture_size]
        target_config = config.replace(capture_sizes=verify) if config.cudagraph_mode != CUDAGraphMode.NONE else config
        common = dict(max_num_reqs=max_num_reqs, max_model_len=max_model_len, block_size=block_size, num_blocks=num_blocks,
                      attention_backend=attention_backend)
        self.target = _Side(target, target_config, drafter=False, query_len=k + 1, support=target_attention_support, **common)
        self.drafter = _Side(drafter, drafter_config or config, drafter=True, query_len=1,
                             support=AttentionGraphSupport.ALWAYS, **common)
        chosen = self.target.cache.attention_backend, self.drafter.cache.attention_backend
        #: the caches' attention backend(s) in words, as ``HFEngine.attention_backend`` (both's, when they differ)
        self.attention_backend = chosen[0] if chosen[0] == chosen[1] else f"target: {chosen[0]}; drafter: {chosen[1]}"
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.max_step_tokens = self.target.runner.dispatcher.max_size
        self.stats = SpecStats()
        self._state: RequestStates | None = None
        self._on_token: Callable[[int, int], None] | None = None

    def cached_tokens(self) -> dict[int, tuple[int, int]]:
        """Per running request of the current :meth:`generate` call: how many of its tokens hold
        valid K/V in (the target's cache, the drafter's cache). Slots past them are free to rewrite."""
        state = self._state
        if state is None:
            return {}
        return {r: (state.target_len[r], state.draft_len[r]) for r in state.running}

    def capture(self, progress: bool = False) -> CaptureReport:
        """Capture both runners before serving (target first; all graphs share one pool): one report
        over both (also ``.capture_report``); each runner's own is ``.target_report``, ``.drafter_report``."""
        with torch.inference_mode():
            self.target_report = self.target.runner.capture(progress=progress)
            self.drafter_report = self.drafter.runner.capture(progress=progress)
        t, d = self.target_report, self.drafter_report
        self.capture_report = CaptureReport(
            t.graphs + d.graphs, t.seconds + d.seconds, f"target: {t.stats}; drafter: {d.stats}",
            t.memory_bytes + d.memory_bytes, t.graph_segments + d.graph_segments,
        )
        return self.capture_report

    def estimate_capture_memory(self) -> int:
        """Bytes :meth:`capture` will add to the pool: each runner's estimate, summed (an upper bound:
        the drafter's graphs may reuse pool memory the target's graphs no longer hold)."""
        with torch.inference_mode():
            return self.target.runner.estimate_capture_memory() + self.drafter.runner.estimate_capture_memory()

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int | Sequence[int],
        *,
        eos_token_id: int | Sequence[int] | None = None,
        sampling: SamplingParams | Sequence[SamplingParams | None] | None = None,
        on_token: Callable[[int, int], None] | None = None,
        on_round: Callable[[RoundInfo], None] | None = None,
    ) -> list[list[int]]:
        """Greedy completions of ``prompts`` (token ids, without the prompt), equal to the target's own
        greedy decoding; :attr:`stats` holds this call's totals. ``sampling`` must be greedy (None or
        temperature 0): acceptance compares drafts with the target's argmax. ``on_token(request_index,
        token_id)`` is called for each token kept, in order, as its round ends. ``eos_token_id`` as in
        :meth:`HFEngine.generate <piecewise_backend.hf.HFEngine.generate>` (None: the target's
        ``generation_config.eos_token_id``)."""
        if any(not p.greedy for p in per_request(sampling, len(prompts))):
            raise ValueError(
                "SpecEngine accepts drafts greedily (equal to the target's argmax), so it cannot sample: "
                f"sampling={sampling!r} needs rejection sampling, which it does not have; use temperature 0, "
                "or HFEngine to sample"
            )
        # the last verify step of a request writes k positions past its next-to-last token
        args = check_generate(prompts, max_new_tokens, vocab_size=self.vocab_size, max_model_len=self.max_model_len,
                              eos_token_id=eos_token_id, default_eos=generation_eos(self.target.model),
                              reserve=self.k - 1, reserve_reason="speculative tokens - 1")
        prompts, budgets = args.prompts, args.budgets
        self._check_blocks(prompts, budgets)
        self.stats = SpecStats()
        state = self._state = RequestStates(prompts, budgets, args.eos)
        self._on_token = on_token
        try:
            with torch.inference_mode():
                while state.waiting or state.running:
                    info = self._round(state)
                    if on_round is not None:
                        on_round(info)
        finally:  # an error mid-way must not leak the blocks of the requests still running
            for side in (self.target, self.drafter):
                for r in state.running:
                    if r in side.cache.tables:
                        side.cache.free(r)
            self._state = None
        return state.outputs

    def _check_blocks(self, prompts: Sequence[Sequence[int]], budgets: list[int]) -> None:
        """SpecEngine does not preempt: refuse up front a batch whose requests running together could
        need more KV blocks than a cache has (the ``max_num_reqs`` largest ones at once)."""
        cache = self.target.cache
        needs = sorted((cache.blocks_for(len(p) + b + self.k - 1) for p, b in zip(prompts, budgets)), reverse=True)
        worst = sum(needs[: self.max_num_reqs])
        total = min(cache.allocator.num_blocks, self.drafter.cache.allocator.num_blocks)
        if worst > total:
            raise ValueError(
                f"SpecEngine has no preemption: {min(len(needs), self.max_num_reqs)} of these requests running together "
                f"may need {worst} KV blocks, the caches have {total}; raise num_blocks, lower max_num_reqs, or use "
                "HFEngine, which preempts and recomputes"
            )

    def _admit(self, state: RequestStates) -> None:
        tokens = sum(state.length(r) - state.target_len[r] + self.k for r in state.running)
        while state.waiting and len(state.running) < self.max_num_reqs:
            need = len(state.prompts[state.waiting[0]]) + self.k
            if state.running and tokens + need > self.max_step_tokens:
                break
            tokens += need
            state.running.append(state.waiting.pop(0))

    def _draft(self, state: RequestStates) -> tuple[dict[int, list[int]], list[CUDAGraphMode]]:
        """k drafter steps: each running request's k proposals, and the mode of each step."""
        drafts: dict[int, list[int]] = {r: [] for r in state.running}
        modes = []
        for j in range(self.k):
            if j == 0:  # what the drafter has not cached: a prompt, or the last round's 1 or 2 new tokens
                chunks = [(r, state.draft_len[r], state.length(r) - state.draft_len[r]) for r in state.running]
                tokens = [t for r in state.running for t in state.seq(r)[state.draft_len[r]:]]
            else:
                chunks = [(r, state.length(r) + j - 1, 1) for r in state.running]
                tokens = [drafts[r][-1] for r in state.running]
            argmax = self.drafter.step(chunks, tokens, uniform=all(n == 1 for _, _, n in chunks))
            for r, end in zip(state.running, chunk_ends(chunks)):
                drafts[r].append(argmax[end])
            modes.append(self.drafter.runner.last_mode)
        return drafts, modes

    def _round(self, state: RequestStates) -> RoundInfo:
        self._admit(state)
        drafts, drafter_modes = self._draft(state)
        k, running = self.k, list(state.running)
        chunks = [(r, state.target_len[r], state.length(r) - state.target_len[r] + k) for r in running]
        tokens = [t for r in running for t in state.seq(r)[state.target_len[r]:] + drafts[r]]
        verify_only = all(n == k + 1 for _, _, n in chunks)
        argmax = self.target.step(chunks, tokens, uniform=verify_only)
        target_mode = self.target.runner.last_mode
        target_key = self.target.runner.dispatcher.dispatch(
            len(tokens), uniform_decode=verify_only, num_reqs=len(chunks) if verify_only else None
        )[1]
        accepted, emitted = [], []
        for r, end in zip(running, chunk_ends(chunks)):
            verdict = argmax[end - k : end + 1]  # the target's token after each of the last k + 1 positions
            a = 0
            while a < k and drafts[r][a] == verdict[a]:
                a += 1
            length = state.length(r)
            kept = state.extend(r, drafts[r][:a] + [verdict[a]])
            if self._on_token is not None:
                for token in state.outputs[r][-kept:]:
                    self._on_token(r, token)
            accepted.append(a)
            emitted.append(kept)
            if state.done(r):
                state.running.remove(r)
                self.target.cache.free(r)
                self.drafter.cache.free(r)
                continue
            # valid K/V: the target fed seq[:length] and a accepted drafts; the drafter fed drafts[:k - 1]
            state.target_len[r] = length + a
            state.draft_len[r] = length + min(a, k - 1)
            self.target.cache.truncate(r, state.target_len[r])
            self.drafter.cache.truncate(r, state.draft_len[r])
        s = self.stats
        s.rounds += 1
        s.request_steps += len(running)
        s.proposed += k * len(running)
        s.accepted += sum(accepted)
        s.emitted += sum(emitted)
        return RoundInfo(
            s.rounds - 1, tuple(running), target_mode, target_key, len(tokens), verify_only, tuple(drafter_modes),
            tuple(accepted), tuple(emitted),
        )
