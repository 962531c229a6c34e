"""Decode throughput of ``HFEngine`` (FULL graphs) vs transformers' continuous batching vs eager ``generate``.

One seeded tiny random llama (three copies of the same weights, one per engine: each engine changes
its model's attention implementation), the same prompts, greedy, the same number of new tokens:

* ``HFEngine`` in FULL_AND_PIECEWISE after ``capture()``: the prefill step replays PIECEWISE graphs,
  every pure decode step one FULL graph (counted and reported);
* transformers' own continuous batching, ``model.generate_batch`` with its default attention (5.17
  switches SDPA to ``paged|sdpa``, 5.24 keeps ``sdpa``) and default CUDA-graph choice, a persistent
  manager built and warmed up before timing; "not available" where the installed transformers lacks it;
* eager ``model.generate`` on the batch, left padded.

**Decode tokens/s**, the same rule for all three: per-token host timestamps (each engine reads its
tokens back, so they are synchronized), window from the moment every request has its first token to
the last token, tokens emitted inside it. Repetitions interleaved in a fresh random order each, ratios
paired per repetition. Tokens are checked against per-prompt ``generate`` (no padding): on the CPU
(float32) ``HFEngine`` must match it exactly or the benchmark fails; on CUDA (bf16 by default, kernels
round differently) a differing token must be a near-tie (within 3e-2 of the best logit given its own
prefix, 1e-3 in float32) or the exit status is 1; transformers' own engines are only reported. On the
CPU the graphs are simulated: those numbers say only that the script runs, not how fast anything is.

    python -m benchmarks.bench_hf_throughput [--quick] [--device cuda] [--dtype float32] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import logging
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.dirname(__file__)))

import torch

import piecewise_backend as pb
from benchmarks.common import (
    Section, env_table, environment, fmt_ratio, fmt_time, log, quiet_logs, raise_recompile_limits, table,
)

SIZES = {  # model sizes for tiny_random_model; the CUDA one is big enough for a decode step to cost real kernel time
    "cpu-quick": dict(num_hidden_layers=2),
    "cpu": dict(num_hidden_layers=4, hidden_size=128, intermediate_size=256),
    "cuda": dict(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=64, max_position_embeddings=2048),
}
SIZES["cuda-quick"] = {**SIZES["cuda"], "num_hidden_layers": 4}  # half the Inductor compile and capture time


@dataclasses.dataclass
class Run:
    """One generation: tokens per prompt, and the decode window (tokens in it, seconds)."""

    tokens: list[list[int]]
    decode_tokens: int
    decode_s: float
    total_s: float
    full_decode_steps: tuple[int, int] | None = None  # (decode steps that replayed FULL, decode steps)

    @property
    def rate(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else float("nan")


def decode_window(events: list[tuple[float, int]], all_started: float) -> tuple[int, float]:
    """(tokens emitted after ``all_started``, seconds from it to the last event); events are (time, tokens)."""
    later = [(t, n) for t, n in events if t > all_started]
    return sum(n for _, n in later), (max(t for t, _ in later) - all_started) if later else 0.0


def prompts_for(device: str, quick: bool, vocab: int) -> tuple[list[list[int]], int]:
    g = torch.Generator().manual_seed(1)
    if device == "cuda":
        lens, new = [4 + (7 * i) % 25 for i in range(16)], (32 if quick else 128)
    else:
        lens, new = ([12, 30, 7, 21], 8) if quick else ([12, 30, 7, 21, 16, 9, 25, 4], 32)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens], new


def hfengine(model: torch.nn.Module, prompts: list[list[int]], new: int, cuda: bool) -> tuple[str, Callable[[], Run]]:
    from piecewise_backend import hf

    total = sum(len(p) for p in prompts)
    # two sizes: the decode batch and the one prefill step (equal budgets: no other step shape), so capture is short
    sizes = sorted({1 << (len(prompts) - 1).bit_length(), 1 << (total - 1).bit_length()})
    config = pb.CompilationConfig(platform="cuda" if cuda else "simulated", cudagraph_mode="FULL_AND_PIECEWISE",
                                  compile_pieces="inductor" if cuda else "eager", capture_sizes=sizes)
    block = 256 if cuda else 16  # varlen takes blocks of 256
    need = max(len(p) for p in prompts) + new
    engine = hf.HFEngine(model, config, max_num_reqs=len(prompts), max_model_len=-(-need // block) * block,
                         block_size=block)
    engine.capture()

    def go() -> Run:
        events: list[tuple[float, int]] = []
        infos: list[hf.StepInfo] = []

        def on_step(info: hf.StepInfo) -> None:  # called after the step's tokens were read back (synchronized)
            events.append((time.perf_counter(), info.num_reqs))
            infos.append(info)

        t0 = time.perf_counter()
        tokens = engine.generate(prompts, new, eos_token_id=[], on_step=on_step)  # []: every prompt its `new` tokens, as the reference
        total_s = time.perf_counter() - t0
        admitted = max(i for i, info in enumerate(infos) if not info.uniform_decode)  # the last step with a prompt
        n, s = decode_window(events, events[admitted][0])
        decode = infos[admitted + 1:]
        full = sum(info.mode == pb.CUDAGraphMode.FULL for info in decode)
        return Run(tokens, n, s, total_s, (full, len(decode)))

    return f"HFEngine FULL_AND_PIECEWISE ({engine.attention_backend})", go


def continuous_batching(model: torch.nn.Module, prompts: list[list[int]], new: int) -> tuple[str, Callable[[], Run]]:
    import transformers

    if not hasattr(model, "generate_batch") or not hasattr(transformers, "ContinuousBatchingConfig"):
        raise NotImplementedError(f"not available in transformers {transformers.__version__}")
    before = model.config._attn_implementation
    need = max(len(p) for p in prompts) + new
    # explicit sizes: on the CPU 5.17 sizes the cache from psutil (absent: 0 bytes), on a GPU from 90 % of free memory
    cb_config = transformers.ContinuousBatchingConfig(num_blocks=len(prompts) * -(-need // 256) + 2,
                                                      max_batch_tokens=max(256, sum(len(p) for p in prompts)))

    def go() -> Run:
        gen = transformers.GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
        t0 = time.perf_counter()
        out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb_config,
                                   record_timestamps=True, persistent_manager=True)
        total_s = time.perf_counter() - t0
        results = list(out.values())  # generate_batch returns them in the order of the inputs
        if len(results) != len(prompts):
            raise RuntimeError(f"generate_batch returned {len(results)} results for {len(prompts)} prompts")
        events = [(t, 1) for r in results for t in r.timestamps]
        n, s = decode_window(events, max(r.timestamps[0] for r in results))
        return Run([list(r.generated_tokens) for r in results], n, s, total_s)

    go()  # builds the persistent manager (cache, warm-up, its own graphs where it uses them): not timed
    manager = getattr(model, "_cached_continuous_batching_manager", None)
    impl = getattr(getattr(manager, "model", model), "config", model.config)._attn_implementation
    graphs = getattr(getattr(manager, "continuous_batching_config", None), "use_cuda_graph", "?")
    return f"transformers generate_batch ({before} -> {impl}, cuda graphs {graphs})", go


class _Clock:
    """A stopping criterion that never stops: records when each step's tokens exist (after a sync)."""

    def __init__(self, cuda: bool):
        self.cuda, self.times = cuda, []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: object) -> torch.Tensor:
        if self.cuda:
            torch.cuda.synchronize()
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def generate_batch_padded(model: torch.nn.Module, prompts: list[list[int]], new: int, cuda: bool) -> Callable[[], Run]:
    import transformers

    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)  # left padding, pad id 0
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)

    def go() -> Run:
        gen = transformers.GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
        clock = _Clock(cuda)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, generation_config=gen,
                                 stopping_criteria=transformers.StoppingCriteriaList([clock]))
        total_s = time.perf_counter() - t0
        n, s = decode_window([(t, len(prompts)) for t in clock.times], clock.times[0])
        return Run(out[:, width:].tolist(), n, s, total_s)

    return go


def reference(model: torch.nn.Module, prompts: list[list[int]], new: int) -> list[list[int]]:
    """Per-prompt greedy ``generate`` (no padding): the tokens every engine is checked against."""
    device = next(model.parameters()).device
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            full = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
                                  eos_token_id=None, pad_token_id=0)
            out.append(full[0, len(p):].tolist())
    return out


def beyond_ties(model: torch.nn.Module, prompts: list[list[int]], tokens: list[list[int]], tol: float) -> list[int]:
    """Prompts whose tokens are not all within ``tol`` of the reference's best logit given their own prefix.

    Low-precision kernels round differently, so two greedy decodes may part where the top logits nearly
    tie; a token below the best by more than ``tol`` is a wrong one."""
    device = next(model.parameters()).device
    bad = []
    with torch.no_grad():
        for i, (p, out) in enumerate(zip(prompts, tokens)):
            logits = model(torch.tensor([p + out], device=device)).logits[0, len(p) - 1 : -1].float()
            picked = logits.gather(1, torch.tensor(out, device=device)[:, None])[:, 0]
            if len(out) and (logits.max(-1).values - picked).max().item() > tol:
                bad.append(i)
    return bad


def agreement(tokens: list[list[int]], expected: list[list[int]]) -> str:
    same = sum(a == b for a, b in zip(tokens, expected))
    if same == len(expected):
        return f"all {same} prompts"
    first = min(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                for a, b in zip(tokens, expected) if a != b)
    return f"MISMATCH: {same}/{len(expected)} prompts (earliest difference at new token {first})"


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' warnings (persistent manager, eos -1, psutil) would bury the tables."""
    import transformers

    level = transformers.logging.get_verbosity()
    cb_logger = logging.getLogger("ContinuousBatchingLogger")
    cb_level = cb_logger.level
    transformers.logging.set_verbosity_error()
    cb_logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        transformers.logging.set_verbosity(level)
        cb_logger.setLevel(cb_level)


def throughput_table(quick: bool, device: str, dtype: torch.dtype, deadline: float | None) -> Section:
    import transformers

    from piecewise_backend import hf

    cuda = device == "cuda"
    raise_recompile_limits()
    sizes = SIZES[("cuda" if cuda else "cpu") + ("-quick" if quick else "")]
    def make() -> torch.nn.Module:  # the same seed: the same weights every time
        return hf.tiny_random_model("llama", device=device, **sizes).to(dtype)

    prompts, new = prompts_for(device, quick, make().config.vocab_size)
    expected = reference(make(), prompts, new)
    runners: dict[str, Callable[[], Run]] = {}
    notes: list[str] = []
    log("hf_throughput: HFEngine (compile, capture)")
    label, hf_go = hfengine(make(), prompts, new, cuda)
    runners[label] = hf_go
    log("hf_throughput: transformers continuous batching")
    cb_model = make()
    try:
        cb_label, cb_go = continuous_batching(cb_model, prompts, new)
        runners[cb_label] = cb_go
    except NotImplementedError as e:
        cb_label, notes = "", [f"transformers continuous batching: {e}."]
    except Exception as e:  # its failure is a result to report, not a reason to lose the other rows
        hint = ""
        if not cuda and importlib.util.find_spec("psutil") is None:
            hint = " (on the CPU transformers reads the memory it may use from psutil, which is not installed here)"
        cb_label, notes = "", [f"transformers continuous batching failed{hint}: `{type(e).__name__}: {str(e)[:200]}`."]
    try:
        gen_label = "model.generate (eager, batch left padded)"
        runners[gen_label] = generate_batch_padded(make(), prompts, new, cuda)
        first = {name: go() for name, go in runners.items()}  # warm-up, and the tokens checked below
        hf_ok = first[label].tokens == expected
        if not hf_ok and not cuda:  # float32 on the CPU: the engine must agree with generate token for token
            raise AssertionError(f"HFEngine tokens differ from generate: {agreement(first[label].tokens, expected)}")
        tol = 1e-3 if dtype == torch.float32 else 3e-2
        wrong = [] if hf_ok else beyond_ties(make(), prompts, first[label].tokens, tol)
        if not hf_ok:
            notes.append(f"HFEngine's tokens that differ from generate's are near-ties (within {tol:g} of the best "
                         "logit given their prefix) except for prompts " + (str(wrong) if wrong else "none") + ".")
        reps = 3 if quick else 7
        runs: dict[str, list[Run]] = {name: [] for name in runners}
        order, rng = list(runners), random.Random(0)
        for rep in range(reps):
            if deadline is not None and rep >= 2 and time.monotonic() > deadline:
                break
            rng.shuffle(order)
            for name in order:
                runs[name].append(runners[name]())
    finally:  # the persistent manager holds a cache (and a thread pool) until destroyed
        with contextlib.suppress(Exception):
            cb_model.destroy_cached_continuous_batching_manager()
    rows = []
    for name in runners:
        rates = [r.rate for r in runs[name]]
        ratios = [a.rate / b.rate for a, b in zip(runs[name], runs[gen_label])]
        full = first[name].full_decode_steps
        rows.append([name, sum(map(len, first[name].tokens)), f"{statistics.median(rates):,.0f}",
                     fmt_ratio(ratios), fmt_time(statistics.median(r.total_s for r in runs[name])),
                     agreement(first[name].tokens, expected) + (f"; FULL replays {full[0]}/{full[1]} decode steps"
                                                                if full else "")])
    body = table(["engine", "tokens", "decode tokens/s", "vs generate", "whole call", "tokens equal to generate"],
                 rows)
    shape = ", ".join(f"{k}={v}" for k, v in sizes.items())
    body += (f"\n\ntiny random llama ({shape}), {str(dtype).removeprefix('torch.')}, {device}, transformers "
             f"{transformers.__version__}, torch {torch.__version__}; {len(prompts)} prompts of "
             f"{min(map(len, prompts))}..{max(map(len, prompts))} tokens, {new} new tokens each, greedy, no EOS; "
             f"{len(runs[gen_label])} interleaved repetitions, medians (ratios: median [p25, p75] of paired ones). "
             "Decode window: from the moment every request has its first token to the last token. "
             "Whole call: the median wall time of one call, each engine's fixed costs included (`generate_batch` "
             "starts and stops its manager's thread every call). Reference tokens: per-prompt `generate` without "
             "padding.\n")
    if not cuda:
        body += ("\n**CPU: the CUDA graphs are simulated (recorded and replayed op by op on the host), so these "
                 "numbers show that the comparison runs, not how fast any engine is. Measure with `--device cuda`.**\n")
    for note in notes:
        body += f"\n{note}\n"
    data = {"rates": {n: statistics.median(r.rate for r in runs[n]) for n in runners}, "hf_tokens_equal": hf_ok,
            "failed": [f"HFEngine tokens wrong for prompts {wrong}"] if wrong else [],
            "cb": cb_label}
    return Section(f"Decode throughput: HFEngine vs transformers continuous batching vs generate ({device})", body,
                   data)


def run(quick: bool = False, deadline: float | None = None, device: str = "cpu", dtype: str | None = None,
        threads: int = 1) -> list[Section]:
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        return [Section(f"Decode throughput ({device})", f"skipped: {e}")]
    torch_dtype = getattr(torch, dtype) if dtype else (torch.bfloat16 if device == "cuda" else torch.float32)
    before = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(threads)  # on a shared CPU, idle intra-op threads only add noise
    try:
        with quiet_logs(), quiet_transformers():
            return [throughput_table(quick, device, torch_dtype, deadline)]
    finally:
        torch.set_num_threads(before)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer new tokens and repetitions")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                    help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--threads", type=int, default=1, help="torch threads on the CPU (default 1)")
    ap.add_argument("--out", type=Path, help="markdown file to write the table to")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch.cuda.is_available() is False here; use --device cpu")
    sections = run(quick=args.quick, device=args.device, dtype=args.dtype, threads=args.threads)
    if args.out is not None:
        body = "\n".join(s.markdown() for s in sections)
        args.out.write_text(f"{env_table(environment(args.device))}\n\n{body}")
    for s in sections:
        print(s.markdown(), flush=True)
    failed = [f for s in sections for f in s.data.get("failed", ())]
    if failed:
        print(f"FAILED: {', '.join(failed)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
