"""The composition matrix: every engine x cudagraph_mode x use_ubatching x use_breakable x CPU attention backend.

Each cell builds one engine on the simulated platform with eager pieces, runs a small workload
(prompts, decode steps, a request joining mid-decode) and compares it with its reference: eager
logits for ``GraphRunner`` + ``PagedKVCache`` (tests/support/pbtest's ``PagedTinyLM``), HF
``model.generate`` tokens for ``HFEngine`` and ``SpecEngine``. Outcomes:

* ``works``: equals its reference, doing all the config asked;
* ``downgraded``: equals its reference, with a feature dropped, saying what (``runner.downgrades``);
* ``refused``: construction raised an error naming the combination;
* ``not offered``: the engine has no option for this axis (named);
* ``wrong`` / ``crash``: a difference from the reference, or an error after construction: a bug.

Run: python scripts/compat_matrix.py [--engines runner serve serve-prefix hf spec spec-lazy spec-sample spec-state compile runner-none serve-none hf-none] [--out docs/compatibility.md]
(some engines: their sections are rerun, the others kept from --out; docs/engine.md's "What composes" table is
rewritten from the whole page; ``--composes`` does only that, from --out)
Dynamo is reset before every cell (each cell compiles its own models).
"""

from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import itertools
import logging
import re
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))  # PagedTinyLM: the toy model the kv tests use

import piecewise_backend as pb  # noqa: E402
from piecewise_backend import attention, kv  # noqa: E402

ENGINES = ("runner", "serve", "serve-prefix", "hf", "spec", "spec-lazy", "spec-sample", "spec-state", "compile",
           "runner-none", "serve-none", "hf-none")
#: Engines run with ``compile_pieces="none"``: no Dynamo, the model's own forward (splitting ops break at run time).
NO_DYNAMO = ("runner-none", "serve-none", "hf-none")
MODES = tuple(m.name for m in pb.CUDAGraphMode)
OUTCOMES = ("works", "downgraded", "refused", "not offered", "wrong", "crash")
BLOCK = 4
CAPTURE_SIZES = [2, 4, 8, 16]
ATOL = 1e-4  # eager logits vs a graph's: the same ops, in the same order up to chunking
#: Micro-batching splits decode steps of 2 requests and up, and steps with a prompt of 4 tokens and up.
UBATCH_THRESHOLDS = dict(dbo_decode_token_threshold=2, dbo_prefill_token_threshold=4)


def cpu_backends() -> list[str]:
    """The registered attention backends that run on the CPU (for a float32 cache of BLOCK-token blocks)."""
    cpu = torch.device("cpu")
    return sorted(n for n, b in attention.attention_backends().items() if b.available(cpu, BLOCK, torch.float32) is None)


#: The library's CPU backends, read when this module loads (before a user or a test registers its own).
BACKENDS = tuple(cpu_backends())


@dataclasses.dataclass(frozen=True)
class Cell:
    engine: str
    mode: str
    ubatching: bool
    breakable: bool
    backend: str

    def config(self) -> pb.CompilationConfig:
        return pb.CompilationConfig(
            cudagraph_mode=self.mode, use_ubatching=self.ubatching, use_breakable=self.breakable,
            platform="simulated", compile_pieces="none" if self.engine in NO_DYNAMO else "eager",
            capture_sizes=CAPTURE_SIZES, **UBATCH_THRESHOLDS,
        )

    def key(self) -> tuple[str, str, str, str]:
        """The cell's columns on the page."""
        return self.mode, _on(self.ubatching), _on(self.breakable), self.backend


@dataclasses.dataclass
class Result:
    cell: Cell
    outcome: str
    why: str = ""  # what was downgraded, refused, not offered, or went wrong
    ran: str = ""  # the modes the steps ran, and how many were micro-batched
    seconds: float = 0.0

    def row(self) -> str:
        return "| " + " | ".join([*self.cell.key(), self.outcome, self.ran, _cell_text(self.why)]) + " |"


def all_cells(engines: Sequence[str] = ENGINES) -> list[Cell]:
    return [
        Cell(e, m, u, b, a)
        for e, m, u, b, a in itertools.product(engines, MODES, (False, True), (True, False), BACKENDS)
    ]


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def _cell_text(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


class _Steps:
    """The runtime mode of every step and whether it was micro-batched, read from the runners."""

    def __init__(self) -> None:
        self.modes: collections.Counter[str] = collections.Counter()
        self.split = 0

    def add(self, runner: pb.GraphRunner) -> None:
        self.modes[runner.last_mode.name] += 1
        self.split += bool(runner.last_ubatched)

    def text(self) -> str:
        modes = ", ".join(f"{m} {n}" for m, n in sorted(self.modes.items(), key=lambda kv_: MODES.index(kv_[0])))
        return f"{modes}; {self.split} split" if self.split else modes


# --- the workloads ---------------------------------------------------------------------------

PROMPTS = ([5, 6, 7], [8, 9], [10, 11, 12, 13])  # + a request joining mid-decode
LATE = [14, 15]
LONG = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]  # longer than the serve cell's 8-token budget: prefilled in chunks


def _runner_cell(cell: Cell) -> tuple[list[pb.GraphRunner], Callable[[_Steps], str | None]]:
    """GraphRunner + PagedKVCache on PagedTinyLM; every step's logits against an eager reference cache."""
    from pbtest.helpers import PagedTinyLM, paged_cache

    config = cell.config()
    model = PagedTinyLM().eval()
    cache = paged_cache(model, max_model_len=32, attention_backend=cell.backend)
    ref_cache = paged_cache(model, max_model_len=32, attention_backend="reference")
    served = model if config.compile_pieces == "none" else torch.compile(model, backend=pb.make_backend(config))
    runner = pb.GraphRunner(
        served, config,
        [pb.StaticInput("input_ids"), *cache.static_inputs()], model_args=["input_ids"], context_fn=cache.context_fn,
        max_num_reqs=4, attention_support=cache.attention_graph_support, attention_backend=cache.attention_backend,
    )

    def workload(steps: _Steps) -> str | None:
        lens = {r: len(p) for r, p in enumerate(PROMPTS)}
        schedule = [
            [(r, 0, n) for r, n in lens.items()],  # three prompts: 9 tokens, PIECEWISE-sized
            [(r, n, 1) for r, n in lens.items()],  # decode of 3
            [*((r, n + 1, 1) for r, n in lens.items()), (3, 0, len(LATE))],  # 3 decodes and a new prompt
            [*((r, n + 2, 1) for r, n in lens.items()), (3, len(LATE), 1)],  # decode of 4
        ]
        with torch.inference_mode():
            runner.capture(progress=False)
            for i, chunks in enumerate(schedule):
                n = sum(c for _, _, c in chunks)
                ids = (torch.arange(n) * 7 + i) % 64
                uniform = all(c == 1 for _, _, c in chunks)
                out = runner.run(input_ids=ids, uniform_decode=uniform, num_reqs=len(chunks) if uniform else None,
                                 query_lens=[c for _, _, c in chunks], **cache.step_inputs(chunks))
                steps.add(runner)
                with pb.set_forward_context(attn_metadata=ref_cache.metadata(ref_cache.step_inputs(chunks))):
                    expected = model(ids)
                diff = (out - expected).abs().max().item()
                if not diff <= ATOL:
                    return f"step {i} ({runner.last_mode.name}): max |logits - eager| = {diff:.3g}"
        return None

    return [runner], workload


_EXPECTED: dict[tuple[str, int], list[list[int]]] = {}


def _generate(arch: str, layers: int, prompts: Sequence[Sequence[int]], n: int) -> list[list[int]]:
    """HF greedy ``generate`` of a fresh tiny model (computed once per process)."""
    key = (arch, layers)
    if key not in _EXPECTED:
        from piecewise_backend.hf import tiny_random_model

        model = tiny_random_model(arch, num_hidden_layers=layers) if layers else tiny_random_model(arch)
        # no stop token, as the engines' eos_token_id=[]: the config's is cleared too, so that generate
        # has no eos to fall back to (the tiny llama's is 2, which prompt [8, 9] reaches at its 3rd token)
        model.generation_config.eos_token_id = None
        out = []
        with torch.no_grad():
            for p in prompts:
                ids = torch.tensor([list(p)])
                gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                                     eos_token_id=None, pad_token_id=0)
                out.append(gen[0, ids.shape[1]:].tolist())
        _EXPECTED[key] = out
    return _EXPECTED[key]


GEN_TOKENS = 5


def _compare(outputs: list[list[int]], expected: list[list[int]], reference: str = "generate's") -> str | None:
    for i, (got, want) in enumerate(zip(outputs, expected)):
        if got != want:
            return f"request {i}: tokens {got} != {reference} {want}"
    return None


def _hf_cell(cell: Cell) -> tuple[list[pb.GraphRunner], Callable[[_Steps], str | None]]:
    """HFEngine on a tiny llama: four prompts (more than max_num_reqs=3: one joins mid-decode) vs generate."""
    from piecewise_backend.hf import HFEngine, tiny_random_model

    engine = HFEngine(tiny_random_model("llama", num_hidden_layers=2), cell.config(), max_num_reqs=3,
                      max_model_len=32, block_size=BLOCK, attention_backend=cell.backend)
    prompts = [*PROMPTS, LATE]

    def workload(steps: _Steps) -> str | None:
        engine.capture()
        # eos_token_id=[]: no stop token, as the reference (the default would stop at the model's eos)
        outputs = engine.generate(prompts, GEN_TOKENS, eos_token_id=[], on_step=lambda info: steps.add(engine.runner))
        return _compare(outputs, _generate("llama", 2, prompts, GEN_TOKENS))

    return [engine.runner], workload


def _spec_cell(cell: Cell) -> tuple[list[pb.GraphRunner], Callable[[_Steps], str | None]]:
    """SpecEngine, k=2, a 1-layer drafter of a 2-layer tiny llama: the target's greedy tokens vs generate."""
    from piecewise_backend.hf import tiny_random_model
    from piecewise_backend.spec import SpecEngine, truncated_drafter

    target = tiny_random_model("llama", num_hidden_layers=2)
    engine = SpecEngine(target, truncated_drafter(target, 1), cell.config(), num_speculative_tokens=2,
                        max_num_reqs=3, max_model_len=32, block_size=BLOCK, attention_backend=cell.backend)
    prompts = [*PROMPTS, LATE]

    def workload(steps: _Steps) -> str | None:
        engine.capture()
        outputs = engine.generate(prompts, GEN_TOKENS, eos_token_id=[],  # no stop token, as the reference
                                  on_round=lambda info: steps.add(engine.target.runner))
        return _compare(outputs, _generate("llama", 2, prompts, GEN_TOKENS))

    return [engine.target.runner, engine.drafter.runner], workload


def _serve_cell(cell: Cell) -> tuple[list[pb.GraphRunner], Callable[[_Steps], str | None]]:
    """serve.Engine on examples/own_model.py's decoder, with an 8-token budget (chunked prefill) and a cache
    too small for every request at once (preemption): its tokens vs a full recompute."""
    from pbtest.helpers import load_file
    from piecewise_backend import serve

    own = load_file("examples/own_model.py")
    engine = serve.Engine(own.make_model(), cell.config(), kv_layout=own.KV_LAYOUT, vocab_size=own.VOCAB,
                          max_num_reqs=3, max_model_len=32, block_size=BLOCK, num_blocks=5, max_num_batched_tokens=8,
                          attention_backend=cell.backend)
    prompts = [*PROMPTS, LATE, LONG]

    def workload(steps: _Steps) -> str | None:
        engine.capture()
        preempted = []
        outputs = engine.generate(prompts, GEN_TOKENS, on_step=lambda info: (steps.add(engine.runner),
                                                                             preempted.extend(info.preempted)))
        reference = own.make_model()
        wrong = _compare(outputs, [own.reference(reference, p, GEN_TOKENS) for p in prompts], "the full recompute's")
        return wrong or (None if preempted else "no request was preempted")

    return [engine.runner], workload


SHARED = [3, 1, 4, 1, 5, 9, 2, 6]  # two blocks of BLOCK tokens: the prefix the serve-prefix cell's requests share


def _serve_prefix_cell(cell: Cell) -> tuple[list[pb.GraphRunner], Callable[[_Steps], str | None]]:
    """serve.Engine as in ``serve``, with prefix caching (on by default): a request computes a shared prefix, then
    requests starting with it (one prompt cached whole but its last block) reuse its blocks; their tokens vs a full
    recompute, cached prompt tokens counted, and every block free or evictable at the end."""
    from pbtest.helpers import load_file
    from piecewise_backend import serve

    own = load_file("examples/own_model.py")
    engine = serve.Engine(own.make_model(), cell.config(), kv_layout=own.KV_LAYOUT, vocab_size=own.VOCAB,
                          max_num_reqs=3, max_model_len=32, block_size=BLOCK, num_blocks=12, max_num_batched_tokens=8,
                          attention_backend=cell.backend)
    first, later = [SHARED + [7]], [SHARED + [8, 10], SHARED[:4] + [11], SHARED]

    def workload(steps: _Steps) -> str | None:
        if not engine.prefix_caching:
            return "prefix caching is off"
        engine.capture()
        hits = pb.counters["prefix_cache_hits"]
        outputs = [engine.generate(p, GEN_TOKENS, on_step=lambda info: steps.add(engine.runner)) for p in (first, later)]
        cached = pb.counters["prefix_cache_hits"] - hits
        reference = own.make_model()
        prompts = first + later
        wrong = _compare(outputs[0] + outputs[1], [own.reference(reference, p, GEN_TOKENS) for p in prompts],
                         "the full recompute's")
        if wrong:
            return wrong
        if cached != 8 + 4 + 4:  # the shared blocks; SHARED alone recomputes its last block (its logits)
            return f"{cached} prompt tokens were found cached, not 16"
        if engine.cache.tables or engine.cache.num_free_blocks != engine.cache.total_blocks:
            return f"{engine.cache.total_blocks - engine.cache.num_free_blocks} blocks held after every request finished"
        return None

    return [engine.runner], workload


def _spec_lazy_cell(cell: Cell) -> tuple[list[pb.GraphRunner], Callable[[_Steps], str | None]]:
    """SpecEngine as in ``spec``, with lazy capture and a cache too small for every request at once: serves
    before any capture (preempting), captures when idle, serves again; both times the target's tokens."""
    from piecewise_backend.hf import tiny_random_model
    from piecewise_backend.spec import SpecEngine, truncated_drafter

    target = tiny_random_model("llama", num_hidden_layers=2)
    engine = SpecEngine(target, truncated_drafter(target, 1), cell.config(), num_speculative_tokens=2,
                        max_num_reqs=3, max_model_len=32, block_size=BLOCK, num_blocks=6, lazy_capture=True, step_capture_budget_s=0,
                        max_num_batched_tokens=16, attention_backend=cell.backend)
    prompts = [*PROMPTS, LATE]

    def workload(steps: _Steps) -> str | None:
        preempted = []

        def step(info) -> None:
            steps.add(engine.target.runner)
            preempted.extend(info.preempted)

        expected = _generate("llama", 2, prompts, GEN_TOKENS)
        wrong = _compare(engine.generate(prompts, GEN_TOKENS, eos_token_id=[], on_step=step), expected)
        if wrong:
            return "before capture_idle: " + wrong
        engine.capture_idle(600.0)
        wrong = _compare(engine.generate(prompts, GEN_TOKENS, eos_token_id=[], on_step=step), expected)
        if wrong:
            return "after capture_idle: " + wrong
        return None if preempted else "no request was preempted"

    return [engine.target.runner, engine.drafter.runner], workload


def _spec_sample_cell(cell: Cell) -> tuple[list[pb.GraphRunner], Callable[[_Steps], str | None]]:
    """SpecEngine as in ``spec``, sampling: greedy and seeded requests in one batch; the greedy ones must be
    generate's tokens, the sampled ones reproduced by their seeds in a second run."""
    from piecewise_backend.hf import SamplingParams, tiny_random_model
    from piecewise_backend.spec import SpecEngine, truncated_drafter

    target = tiny_random_model("llama", num_hidden_layers=2)
    engine = SpecEngine(target, truncated_drafter(target, 1), cell.config(), num_speculative_tokens=2,
                        max_num_reqs=3, max_model_len=32, block_size=BLOCK, attention_backend=cell.backend)
    prompts = [*PROMPTS, LATE]
    sampling = [None if i % 2 == 0 else SamplingParams(temperature=0.8, top_p=0.9, seed=i) for i in range(len(prompts))]

    def workload(steps: _Steps) -> str | None:
        engine.capture()
        runs = [engine.generate(prompts, GEN_TOKENS, eos_token_id=[], sampling=sampling,
                                on_round=lambda info: steps.add(engine.target.runner)) for _ in range(2)]
        expected = _generate("llama", 2, prompts, GEN_TOKENS)
        greedy = [i for i, s in enumerate(sampling) if s is None]
        wrong = _compare([runs[0][i] for i in greedy], [expected[i] for i in greedy])
        if wrong:
            return "greedy " + wrong
        if runs[0] != runs[1]:
            return f"the seeds did not reproduce the sampled tokens: {runs[0]} then {runs[1]}"
        return None

    return [engine.target.runner, engine.drafter.runner], workload


def _spec_state_cell(cell: Cell) -> tuple[list[pb.GraphRunner], Callable[[_Steps], str | None]]:
    """SpecEngine on a state-layer model: a tiny qwen3_next (gated delta nets and attention), k=2, its first
    layer as the drafter; the target's greedy tokens vs generate."""
    from piecewise_backend.hf import tiny_random_model
    from piecewise_backend.spec import SpecEngine, truncated_drafter

    target = tiny_random_model("qwen3_next")
    engine = SpecEngine(target, truncated_drafter(target, 1), cell.config(), num_speculative_tokens=2,
                        max_num_reqs=3, max_model_len=32, block_size=BLOCK, attention_backend=cell.backend)
    prompts = [*PROMPTS, LATE]

    def workload(steps: _Steps) -> str | None:
        engine.capture()
        outputs = engine.generate(prompts, GEN_TOKENS, eos_token_id=[],
                                  on_round=lambda info: steps.add(engine.target.runner))
        return _compare(outputs, _generate("qwen3_next", 0, prompts, GEN_TOKENS))

    return [engine.target.runner, engine.drafter.runner], workload


class _Standalone:
    """What a plain torch.compile cell reports in the place of a runner: its downgrades, after the workload."""

    def __init__(self) -> None:
        self.downgrades: list[str] = []


def _compile_cell(cell: Cell) -> tuple[list[Any], Callable[[_Steps], str | None]]:
    """Plain torch.compile, no runner: a tiny llama's forward compiled with the backend, served by transformers'
    own generate with a static cache (its decode steps capture and replay by themselves) vs plain generate."""
    from piecewise_backend.hf import tiny_random_model

    model = tiny_random_model("llama", num_hidden_layers=2)
    backend = pb.make_backend(cell.config())
    model.forward = torch.compile(model.forward, backend=backend)
    report = _Standalone()

    def workload(steps: _Steps) -> str | None:
        replays = pb.counters["replays"]
        outputs = []
        with torch.no_grad():
            for p in (*PROMPTS, LATE):
                ids = torch.tensor([p])
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=GEN_TOKENS,
                                     do_sample=False, eos_token_id=None, pad_token_id=0, cache_implementation="static")
                outputs.append(out[0, len(p):].tolist())
        replayed = pb.counters["replays"] - replays
        modes = sorted({m.name for g in backend.standalone for m in g.captured()}, key=MODES.index)
        for m in modes:
            steps.modes[m] += replayed // len(modes)
        if cell.mode != "NONE" and not replayed:
            report.downgrades.append("no graph replayed")
        steps.modes["NONE"] += len(PROMPTS) + 1 + (len(PROMPTS) + 1) * (GEN_TOKENS - 1) - replayed
        return _compare(outputs, _generate("llama", 2, (*PROMPTS, LATE), GEN_TOKENS))

    return [report], workload


BUILDERS = {"runner": _runner_cell, "serve": _serve_cell, "serve-prefix": _serve_prefix_cell, "hf": _hf_cell, "spec": _spec_cell,
            "spec-lazy": _spec_lazy_cell, "spec-sample": _spec_sample_cell, "spec-state": _spec_state_cell,
            "compile": _compile_cell, "runner-none": _runner_cell, "serve-none": _serve_cell, "hf-none": _hf_cell}


def not_offered(cell: Cell) -> str | None:
    """Why the engine has no way to ask for this cell, or None (every engine takes every axis, but plain
    torch.compile: no batch to split, and the model's own attention over its own cache)."""
    if cell.engine == "compile":
        if cell.ubatching:
            return "plain torch.compile: micro-batching splits a runner's batch of requests; a plain call has none"
        if cell.backend != BACKENDS[0]:
            return f"plain torch.compile: the model keeps its own attention and cache (the column {BACKENDS[0]} runs it)"
    return None


def run_cell(cell: Cell) -> Result:
    """Build the cell's engine and run its workload; the outcome and what it says."""
    reason = not_offered(cell)
    if reason is not None:
        return Result(cell, "not offered", reason)
    torch._dynamo.reset()  # each cell compiles its own models: no cell inherits another's cache entries
    start = time.perf_counter()
    try:
        runners, workload = BUILDERS[cell.engine](cell)
    except (ValueError, TypeError) as e:
        return Result(cell, "refused", f"{type(e).__name__}: {e}", seconds=time.perf_counter() - start)
    names = ["", "drafter: "] if cell.engine.startswith("spec") else [""]
    steps = _Steps()
    try:
        wrong = workload(steps)
    except Exception as e:  # after construction: a bug, whatever it is
        first = str(e).splitlines()[0] if str(e) else ""
        return Result(cell, "crash", f"{type(e).__name__}: {first}", steps.text(), time.perf_counter() - start)
    seconds = time.perf_counter() - start
    downgrades = [name + d for name, r in zip(names, runners) for d in r.downgrades]
    if wrong is not None:
        return Result(cell, "wrong", wrong, steps.text(), seconds)
    return Result(cell, "downgraded" if downgrades else "works", "; ".join(downgrades), steps.text(), seconds)


def run(cells: Iterable[Cell], progress: Callable[[Result], None] | None = None) -> list[Result]:
    results = []
    logging.getLogger("piecewise_backend").setLevel(logging.ERROR)  # downgrades are read from the runners
    for cell in cells:
        result = run_cell(cell)
        results.append(result)
        if progress is not None:
            progress(result)
    return results


# --- the page --------------------------------------------------------------------------------

TITLES = {
    "runner": "`GraphRunner` + `PagedKVCache` (a toy LM; reference: eager logits of every step)",
    "hf": "`HFEngine` (tiny llama; reference: `model.generate`)",
    "spec": "`SpecEngine` (tiny llama, 1-layer drafter, k=2; reference: the target's `model.generate`)",
    "serve": "`serve.Engine` on your own model (examples/own_model.py's decoder; chunked prefill and preemption; "
             "reference: a full recompute)",
    "serve-prefix": "`serve.Engine` with prefix caching (as `serve`; requests sharing a computed prefix reuse its "
                    "blocks, one prompt cached whole but its last block; reference: a full recompute, 16 prompt tokens "
                    "found cached, every block free or evictable at the end)",
    "spec-lazy": "`SpecEngine` with `lazy_capture` and preemption (as `spec`; served before and after `capture_idle`; "
                 "reference: the target's `model.generate`)",
    "spec-sample": "`SpecEngine` sampling (as `spec`; greedy and seeded requests in one batch; reference: generate for "
                   "the greedy ones, a second run for the seeded ones)",
    "spec-state": "`SpecEngine` on state layers (tiny qwen3_next, its first layer as the drafter, k=2; reference: "
                  "the target's `model.generate`)",
    "compile": "plain `torch.compile` (a tiny llama's forward compiled with the backend, no runner; transformers' "
               "`generate` with a static cache: each graph captured by the compiled call itself; reference: plain "
               "`generate`)",
    "runner-none": "`GraphRunner` + `PagedKVCache` with `compile_pieces=\"none\"` (no Dynamo: the toy LM's own forward, "
                   "its attention op a break at run time; reference: eager logits of every step)",
    "serve-none": "`serve.Engine` with `compile_pieces=\"none\"` (as `serve`, no Dynamo; reference: a full recompute)",
    "hf-none": "`HFEngine` with `compile_pieces=\"none\"` (as `hf`, no Dynamo; reference: `model.generate`)",
}
HEADER = "| cudagraph_mode | use_ubatching | use_breakable | attention backend | outcome | steps ran | why |"


def render(results: Sequence[Result]) -> str:
    """docs/compatibility.md for ``results`` (every cell of every engine run)."""
    counts = collections.Counter(r.outcome for r in results)
    summary = ", ".join(f"{counts[o]} {o}" for o in OUTCOMES if counts[o])
    lines = [
        "# Compatibility: which features compose",
        "",
        "Written by `python scripts/compat_matrix.py` (do not edit by hand). Every engine x",
        "`cudagraph_mode` x `use_ubatching` x `use_breakable` x attention backend that runs on the CPU,",
        "on the simulated platform with eager pieces (`capture_sizes` "
        f"{CAPTURE_SIZES}, micro-batching from {UBATCH_THRESHOLDS['dbo_decode_token_threshold']} decode tokens or "
        f"{UBATCH_THRESHOLDS['dbo_prefill_token_threshold']} tokens with a prompt).",
        "Each cell runs prompts, decode steps and a request joining mid-decode, and compares with its",
        "reference. Outcomes: **works** (equals its reference, doing all that was asked); **downgraded**",
        "(equals its reference with a feature dropped, named under *why*: the runner's `.downgrades`,",
        "also a warning for micro-batching); **refused** (the engine's constructor raised, naming the",
        "combination); **not offered** (the engine has no option for it); **wrong** / **crash** (a bug).",
        "*Steps ran*: the runtime mode of each step (the target's, for `SpecEngine`), and how many were",
        "split into two micro-batches.",
        "",
        f"Total: {len(results)} cells: {summary}. Tensor parallelism is not in the matrix yet: `GraphRunner` on a",
        "sharded model (`parallel.shard_toy_llama`, 2 gloo ranks) is checked against the unsharded model by",
        "`examples/tensor_parallel.py --check`, and `HFEngine` over a `tp_plan=\"auto\"` load (llama, qwen3_moe, 2 gloo ranks:",
        "FULL_AND_PIECEWISE, chunked prefill, greedy and seeded sampling) by `tests/hf/test_tensor_parallel.py`; with TP,",
        "`lazy_capture`, state layers and `SpecEngine` are refused ([distributed.md](distributed.md#hugging-face-models-hfenginefrom_pretrained-tp_planauto)).",
        "",
    ]
    for engine in ENGINES:
        rows = [r for r in results if r.cell.engine == engine]
        if not rows:
            continue
        lines += [f"## {TITLES[engine]}", "", HEADER, "| --- | --- | --- | --- | --- | --- | --- |"]
        lines += [r.row() for r in rows]
        lines.append("")
    return "\n".join(lines)


ROW = re.compile(r"^\| (\w+) \| (on|off) \| (on|off) \| (\w+) \| ([\w ]+?) \| (.*?) \| (.*) \|$")


def parse(page: str) -> dict[Cell, tuple[str, str, str]]:
    """The page's cells: ``Cell -> (outcome, steps ran, why)``."""
    cells = {}
    engine = None
    for line in page.splitlines():
        if line.startswith("## "):
            engine = next(e for e, t in TITLES.items() if line == f"## {t}")
        m = ROW.match(line)
        if m and engine is not None and m.group(1) in MODES:
            mode, ub, br, backend, outcome, ran, why = m.groups()
            cells[Cell(engine, mode, ub == "on", br == "on", backend)] = (outcome, ran, why)
    return cells


#: What each engine of the matrix composes, for docs/engine.md's table (the column a cell counts in: micro-batching).
FEATURES = {
    "runner": "`GraphRunner` + `PagedKVCache`",
    "serve": "`serve.Engine`: online requests, chunked prefill, preemption",
    "serve-prefix": "`serve.Engine`: prefix caching (shared prompt blocks reused)",
    "hf": "`HFEngine`: online requests",
    "spec": "`SpecEngine`: online requests",
    "spec-lazy": "`SpecEngine` with `lazy_capture`, `capture_idle`, preemption",
    "spec-sample": "`SpecEngine` sampling (greedy and seeded requests in one batch)",
    "spec-state": "`SpecEngine` on state layers",
    "compile": "plain `torch.compile` (no runner)",
    "runner-none": "`GraphRunner` + `PagedKVCache`, `compile_pieces=\"none\"`",
    "serve-none": "`serve.Engine`, `compile_pieces=\"none\"`",
    "hf-none": "`HFEngine`, `compile_pieces=\"none\"`",
}
COMPOSES_BEGIN = "<!-- composes: written by scripts/compat_matrix.py --composes from docs/compatibility.md -->"
COMPOSES_END = "<!-- end composes -->"


def _summary(cells: Sequence[tuple[str, str, str]]) -> str:
    """``N works, M downgraded (reasons)`` of some cells of one engine."""
    counts = collections.Counter(o for o, _, _ in cells)
    reasons = sorted({why.split(":")[0].strip() for o, _, why in cells if o != "works" and why})
    text = ", ".join(f"{counts[o]} {o}" for o in OUTCOMES if counts[o])
    return text + (f" ({'; '.join(reasons)})" if reasons else "")


def composes(cells: dict[Cell, tuple[str, str, str]]) -> str:
    """docs/engine.md's "What composes" table: each engine's cells of the matrix, without and with micro-batching."""
    lines = [
        COMPOSES_BEGIN,
        "| engine, as the matrix runs it | cells without micro-batching (every mode, both `use_breakable`, every CPU "
        "attention backend) | with `use_ubatching` |",
        "| --- | --- | --- |",
    ]
    for engine in ENGINES:
        mine = {c: v for c, v in cells.items() if c.engine == engine}
        if mine:
            off = [v for c, v in mine.items() if not c.ubatching]
            on = [v for c, v in mine.items() if c.ubatching]
            lines.append(f"| {FEATURES[engine]} | {_summary(off)} | {_summary(on)} |")
    lines.append(COMPOSES_END)
    return "\n".join(lines)


def write_composes(page: str, table: str) -> str:
    """``page`` (docs/engine.md) with its composes block replaced by ``table``."""
    start, end = page.index(COMPOSES_BEGIN), page.index(COMPOSES_END) + len(COMPOSES_END)
    return page[:start] + table + page[end:]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--out", default=str(ROOT / "docs" / "compatibility.md"))
    parser.add_argument("--composes", action="store_true",
                        help="only rewrite docs/engine.md's 'What composes' table from --out (run nothing)")
    args = parser.parse_args(argv)
    engine_md = ROOT / "docs" / "engine.md"
    if args.composes:
        engine_md.write_text(write_composes(engine_md.read_text(), composes(parse(Path(args.out).read_text()))))
        print(f"wrote {engine_md} from {args.out}")
        return 0
    torch.set_num_threads(1)  # tiny models: threads cost more than they save

    def show(r: Result) -> None:
        print(f"{r.cell.engine:6} {' '.join(r.cell.key()):40} {r.outcome:11} {r.seconds:5.1f}s {r.ran}  {r.why[:120]}",
              flush=True)

    results = run(all_cells(args.engines), show)
    out = Path(args.out)
    if set(args.engines) != set(ENGINES) and out.exists():  # the other engines' sections as the page has them
        kept = [Result(c, o, why, ran) for c, (o, ran, why) in parse(out.read_text()).items()
                if c.engine not in args.engines]
        results = sorted(kept + results, key=lambda r: ENGINES.index(r.cell.engine))
    out.write_text(render(results))
    engine_md.write_text(write_composes(engine_md.read_text(), composes(parse(render(results)))))
    bugs = [r for r in results if r.outcome in ("wrong", "crash")]
    print(f"wrote {args.out}: {len(results)} cells, {len(bugs)} wrong or crashed")
    return 1 if bugs else 0


if __name__ == "__main__":
    sys.exit(main())
