"""Prefix caching: a 480-token system prompt and short questions, time to first token with caching vs without.

Two ``HFEngine`` s over the same tiny random Llama (one with ``enable_prefix_caching=False``). Each serves the
questions one after another (a question is added once the one before finished): time to first token is
from ``add_request`` to the request's first streamed token. The first question computes the system prompt
on both engines (after a warm-up round of the same requests, then ``reset_prefix_cache()``); the table's
TTFT is the median over the questions after it (the prefix cached). Then
every question at once (``generate``): wall time and tokens/s. Tokens are checked identical across the two
engines; the hit rate is ``prefix_cache_hits / (hits + misses)`` of the caching engine.

    python -m benchmarks.bench_prefix [--quick] [--device cuda] [--out FILE]

Exit status 1 when the tokens differ.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

import piecewise_backend as pb
from benchmarks.common import Section, env_table, environment, fmt_time, log, quiet_logs, table

SYSTEM_TOKENS = 480


def workload(quick: bool) -> tuple[list[list[int]], int]:
    """The prompts (system prompt + a question each) and the new tokens per request."""
    g = torch.Generator().manual_seed(5)
    system = torch.randint(3, 256, (SYSTEM_TOKENS,), generator=g).tolist()
    questions = [torch.randint(3, 256, (int(n),), generator=g).tolist()
                 for n in torch.randint(8, 24, (4 if quick else 12,), generator=g)]
    return [system + q for q in questions], 4 if quick else 16


def make_engine(device: str, caching: bool, max_len: int):
    from piecewise_backend import hf

    cuda = device == "cuda"
    config = pb.CompilationConfig(
        platform="cuda" if cuda else "simulated", compile_pieces="inductor" if cuda else "eager",
        cudagraph_mode="FULL_AND_PIECEWISE" if cuda else "NONE", max_capture_size=16,
    )
    model = hf.tiny_random_model("llama", device=device, max_position_embeddings=1024)
    model = model.to(torch.bfloat16 if cuda else torch.float32)
    engine = hf.HFEngine(model, config, max_num_reqs=4, max_model_len=max_len, block_size=16,
                         max_num_batched_tokens=512, enable_prefix_caching=caching,
                         attention_backend="auto" if cuda else "reference")  # bounded loops over chunks in Python
    if cuda:
        engine.capture()
    return engine


def ttfts(engine, prompts: list[list[int]], new: int) -> tuple[list[float], list[list[int]]]:
    """Seconds to each question's first token, served one after another, and the tokens."""
    seconds, outputs = [], []
    for p in prompts:
        first: list[float] = []
        began = time.perf_counter()
        rid = engine.add_request(p, new, stop_token_ids=[],
                                 on_token=lambda _r, _t: first or first.append(time.perf_counter()))
        out = next(o for o in engine.results() if o.request_id == rid)
        seconds.append(first[0] - began)
        outputs.append(out.token_ids)
    return seconds, outputs


def run(quick: bool = False, device: str = "cpu") -> tuple[Section, bool]:
    prompts, new = workload(quick)
    max_len = -(-(max(map(len, prompts)) + new) // 16) * 16
    rows, tokens, data = [], {}, {}
    for caching in (False, True):
        name = "caching on" if caching else "caching off"
        engine = make_engine(device, caching, max_len)
        ttfts(engine, prompts, new)  # warm-up: the same steps once (Dynamo's compiles of each step shape)
        engine.reset_prefix_cache()
        engine.generate(prompts, new, eos_token_id=[])
        engine.reset_prefix_cache()
        hits0, misses0 = pb.counters["prefix_cache_hits"], pb.counters["prefix_cache_misses"]
        seconds, outs = ttfts(engine, prompts, new)
        hits, misses = pb.counters["prefix_cache_hits"] - hits0, pb.counters["prefix_cache_misses"] - misses0
        engine.reset_prefix_cache()
        began = time.perf_counter()
        batch = engine.generate(prompts, new, eos_token_id=[])
        wall = time.perf_counter() - began
        tokens[name] = (outs, batch)
        later = statistics.median(seconds[1:])
        data[name] = later
        rate = hits / (hits + misses) if hits + misses else 0.0
        rows.append([name, fmt_time(seconds[0]), fmt_time(later), f"{rate:.0%}", fmt_time(wall),
                     f"{len(prompts) * new / wall:.1f}"])
        log(f"{name}: first {seconds[0]:.4f}s, later median {later:.4f}s, hit rate {rate:.2f}, batch {wall:.3f}s")
    same = tokens["caching on"] == tokens["caching off"]
    ratio = data["caching on"] / data["caching off"]
    body = "\n".join([
        f"{SYSTEM_TOKENS}-token system prompt, {len(prompts)} questions of 8-23 tokens, {new} new tokens each, "
        f"tiny random Llama on {device}, block_size 16, 512 tokens a step. TTFT: one question at a time "
        "(the first computes the system prompt; later: median of the others).", "",
        table(["engine", "TTFT, first question", "TTFT, later questions (median)", "hit rate", "all at once (generate)",
               "tokens/s"], rows), "",
        f"TTFT with caching / without: **{ratio:.2f}x** (goal <= 0.3x); tokens identical: {'yes' if same else 'NO'}.",
    ])
    return Section("Prefix caching: a shared 480-token system prompt (bench_prefix.py)", body,
                   {"ttft_ratio": ratio, "identical": same}), same


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    with quiet_logs():
        section, same = run(args.quick, args.device)
    text = section.markdown() + "\n" + env_table(environment(args.device))
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
